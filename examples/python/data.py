"""A byte-level tokenizer and a real English text corpus from a Debian package.

The corpus is the `fortunes` collection (Debian packages fortunes-min and
fortunes: quotations, jokes and literature excerpts in plain English),
installed by scripts/install-deps.sh and never committed. Any directory of
text files works through --corpus.
"""
import os

import torch

BOS, EOS, PAD = 256, 257, 258
VOCAB_SIZE = 260  # 256 bytes, BOS, EOS, PAD, one spare (a multiple of 4)
FORTUNES_DIR = "/usr/share/games/fortunes"


def encode(text):
    return list(text.encode("utf-8"))


def decode(ids):
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def _fortune_files(directory):
    out = []
    for root, _, files in os.walk(directory):
        for name in sorted(files):
            if name.endswith((".dat", ".u8")) or name.startswith("."):
                continue
            path = os.path.join(root, name)
            if os.path.islink(path):
                continue
            out.append(path)
    return sorted(out)


def load_corpus(directory=None):
    """The corpus as one string: every fortune, separated by blank lines."""
    directory = directory or FORTUNES_DIR
    if not os.path.isdir(directory):
        raise FileNotFoundError(
            f"no text corpus at {directory}: install the Debian packages fortunes-min and fortunes "
            f"(scripts/install-deps.sh does), or pass --corpus DIR")
    parts = []
    for path in _fortune_files(directory):
        with open(path, "rb") as f:
            raw = f.read().decode("utf-8", errors="ignore")
        for entry in raw.split("\n%\n"):
            entry = entry.strip("%\n ")
            if entry:
                parts.append(entry)
    if not parts:
        raise FileNotFoundError(f"no text files in {directory}")
    return "\n\n".join(parts)


class TokenStream:
    """Fixed-length training windows over the encoded corpus: a train split and
    a held-out split (the last `held_out` share). Deterministic given a seed;
    `position` is the state to checkpoint."""

    def __init__(self, text, seq_len, held_out=0.05, seed=0):
        ids = torch.tensor(encode(text), dtype=torch.long)
        cut = int(len(ids) * (1 - held_out))
        self.train, self.val = ids[:cut], ids[cut:]
        self.seq_len = seq_len
        self.generator = torch.Generator().manual_seed(seed)
        self.position = 0

    def batch(self, batch_size):
        """The next batch of random windows of the train split (input ids, which
        are also the labels: the model shifts them)."""
        starts = torch.randint(0, len(self.train) - self.seq_len - 1, (batch_size,), generator=self.generator)
        self.position += 1
        x = torch.stack([self.train[s:s + self.seq_len] for s in starts.tolist()])
        return x

    def state(self):
        return {"position": self.position, "generator": self.generator.get_state()}

    def restore(self, state):
        self.position = state["position"]
        self.generator.set_state(state["generator"])

    def held_out_batches(self, batch_size, count):
        """`count` fixed batches of consecutive windows of the held-out split."""
        n = self.seq_len
        out = []
        step = max(1, (len(self.val) - n - 1) // max(1, batch_size * count))
        for b in range(count):
            starts = [(b * batch_size + i) * step for i in range(batch_size)]
            out.append(torch.stack([self.val[s:s + n] for s in starts if s + n <= len(self.val)]))
        return out
