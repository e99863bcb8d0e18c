"""What the tests of examples/python/train_llama.py share: the script's path,
the tiny model's flags, and a small corpus written into a test's folder."""
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "python", "train_llama.py")
DEFAULT_CONFIG = os.path.join(ROOT, "examples", "configs", "llama_default.json")


def tiny(eval_every=1):
    """The flags of a one-layer tiny Llama on 16-byte windows, quiet, no sample."""
    return ["--size", "tiny", "--layers", "1", "--seq-len", "16", "--eval-every", str(eval_every), "--eval-batches",
            "1", "--sample", "0", "--no-progress"]


def corpus(tmp_path):
    """A corpus folder under tmp_path (200 short lines, as the fortunes are split); its path."""
    d = tmp_path / "corpus"
    d.mkdir(exist_ok=True)
    (d / "text").write_text("\n%\n".join(f"The quick brown fox {i} jumps over the lazy dog." for i in range(200)))
    return str(d)
