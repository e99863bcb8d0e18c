"""A Llama-architecture decoder in plain PyTorch: RMSNorm, rotary position
embeddings, SwiGLU, grouped-query attention. Parameter names follow Hugging
Face's LlamaForCausalLM, so its checkpoints (safetensors) load into this model
and strata exports load into it.

Runs on torch >= 1.13 (uses scaled_dot_product_attention when present).
"""
import dataclasses
import math

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn


@dataclasses.dataclass
class LlamaConfig:
    vocab_size: int = 260
    hidden_size: int = 256
    intermediate_size: int = 688
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02

    @property
    def head_dim(self):
        return self.hidden_size // self.num_attention_heads

    def param_count(self):
        h, i, v, L = self.hidden_size, self.intermediate_size, self.vocab_size, self.num_hidden_layers
        kv = self.num_key_value_heads * self.head_dim
        per_layer = h * h * 2 + h * kv * 2 + 3 * h * i + 2 * h
        return v * h * (1 if self.tie_word_embeddings else 2) + L * per_layer + h

    def flops_per_token(self, seq_len):
        """Forward + backward matmul FLOPs per token (6 x weights in matmuls,
        plus attention scores and values)."""
        h, L, v = self.hidden_size, self.num_hidden_layers, self.vocab_size
        # Every weight is a matmul but the norms and the embedding lookup (when
        # the output projection is tied to it, the matrix counts once, as a matmul).
        matmul_params = self.param_count() - (2 * L + 1) * h - (0 if self.tie_word_embeddings else v * h)
        return 6 * matmul_params + 12 * L * h * seq_len


SIZES = {
    # name: (hidden, intermediate, layers, heads, kv heads)
    "tiny": (128, 344, 2, 4, 2),
    "small": (256, 688, 4, 8, 4),
    "base": (512, 1376, 8, 8, 4),
    "1b": (2048, 5632, 22, 32, 4),
    "7b": (4096, 11008, 32, 32, 32),
}


def config_for(size, vocab_size=260, **kw):
    h, i, L, nh, kv = SIZES[size]
    return LlamaConfig(vocab_size=vocab_size, hidden_size=h, intermediate_size=i, num_hidden_layers=L,
                       num_attention_heads=nh, num_key_value_heads=kv, **kw)


class RMSNorm(nn.Module):
    def __init__(self, size, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


def rotary_tables(seq_len, head_dim, theta, device, dtype):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    t = torch.arange(seq_len, dtype=torch.float32, device=device)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(q, k, cos, sin):
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class LlamaAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        hd = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_attention_heads * hd, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * hd, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * hd, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        cfg = self.cfg
        hd = cfg.head_dim
        q = self.q_proj(x).view(b, t, cfg.num_attention_heads, hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, cfg.num_key_value_heads, hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, cfg.num_key_value_heads, hd).transpose(1, 2)
        q, k = apply_rotary(q, k, cos, sin)
        rep = cfg.num_attention_heads // cfg.num_key_value_heads
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        if hasattr(F, "scaled_dot_product_attention"):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            scores = scores.masked_fill(mask, float("-inf"))
            out = torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class LlamaMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.self_attn = LlamaAttention(cfg)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gradient_checkpointing = False
        self.checkpoint_reentrant = True

    def forward(self, input_ids):
        x = self.embed_tokens(input_ids)
        cos, sin = rotary_tables(input_ids.shape[1], self.cfg.head_dim, self.cfg.rope_theta, x.device, x.dtype)
        for layer in self.layers:
            if self.gradient_checkpointing and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, use_reentrant=self.checkpoint_reentrant)
            else:
                x = layer(x, cos, sin)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.apply(self._init_weights)

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            if module.weight.device.type != "meta":
                nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.Embedding):
            if module.weight.device.type != "meta":
                nn.init.normal_(module.weight, mean=0.0, std=std)

    def gradient_checkpointing_enable(self, use_reentrant=True):
        self.model.gradient_checkpointing = True
        self.model.checkpoint_reentrant = use_reentrant

    def forward(self, input_ids, labels=None):
        """Logits [batch, seq, vocab]; with labels, (loss, logits): the mean
        next-token cross-entropy in fp32 (labels shifted inside, -100 ignored)."""
        logits = self.lm_head(self.model(input_ids))
        if labels is None:
            return logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                               labels[:, 1:].reshape(-1), ignore_index=-100)
        return loss, logits

    @torch.no_grad()
    def generate(self, input_ids, max_new_tokens, temperature=0.0, generator=None):
        """Greedy (temperature 0) or sampled continuation; recomputes the whole
        prefix each token (no cache: a small model, an example)."""
        ids = input_ids
        for _ in range(max_new_tokens):
            logits = self(ids)[:, -1].float()
            if temperature > 0:
                probs = torch.softmax(logits / temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator)
            else:
                nxt = logits.argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
        return ids
