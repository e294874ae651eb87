"""Small models for the memory tests and the benchmarks (no downloads).

``GPT`` is a pre-LayerNorm decoder with ``scaled_dot_product_attention`` and a 4x GELU MLP; given
targets it returns the cross-entropy loss (computed inside the model, so a profile sees it).
``hf_gpt2`` builds Hugging Face's GPT-2 architecture from a ``GPTConfig`` (random weights), ``hf_llama`` its
Llama architecture from a ``LlamaConfig`` of the same size (SwiGLU width 8/3 of the model's, as Llama's).
``Chain`` is a heterogeneous MLP chain (every block of another width), ``TwoTower`` a CLIP-like model
of two towers of different widths with a contrastive loss.

The memory tests (tests/unit/test_profile.py, test_budget*.py, ...) and the benchmarks
(benchmarks/memory.py, budget_accuracy.py, ...) use these same models on purpose: what the tests assert
about the profiler and the budget must hold on the very model the benchmark tables report, so each model
has one definition, here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "GPT",
    "Block",
    "Chain",
    "ChainMLP",
    "GPTConfig",
    "MLP",
    "SIZES",
    "TwoTower",
    "batch",
    "hf_checkpointing_enable",
    "hf_gpt2",
    "hf_llama",
    "is_chain_block",
]


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256
    seq: int = 64
    dim: int = 64
    heads: int = 4
    layers: int = 4
    dropout: float = 0.0


SIZES = {
    "tiny": GPTConfig(vocab=256, seq=64, dim=64, heads=4, layers=4),
    "small": GPTConfig(vocab=512, seq=128, dim=128, heads=4, layers=8),
    "medium": GPTConfig(vocab=1024, seq=256, dim=256, heads=8, layers=8),
    "large": GPTConfig(vocab=8192, seq=1024, dim=1024, heads=16, layers=24),
}


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int, dropout: float = 0.0):
        super().__init__()
        self.fc = nn.Linear(dim, hidden)
        self.proj = nn.Linear(hidden, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.dropout = cfg.dropout
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.mlp = MLP(cfg.dim, 4 * cfg.dim, cfg.dropout)

    def attn(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.seq, cfg.dim)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def batch(cfg: GPTConfig, size: int, device: torch.device | str = "cpu", seed: int = 0) -> tuple[torch.Tensor, ...]:
    """A random (idx, targets) batch."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(cfg.vocab, (size, cfg.seq), generator=g)
    tgt = torch.randint(cfg.vocab, (size, cfg.seq), generator=g)
    return idx.to(device), tgt.to(device)


def hf_gpt2(cfg: GPTConfig) -> nn.Module:
    """Hugging Face's GPT-2 (``GPT2LMHeadModel``) built from a config of the same size as ``cfg``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    conf = GPT2Config(
        vocab_size=cfg.vocab,
        n_positions=cfg.seq,
        n_embd=cfg.dim,
        n_layer=cfg.layers,
        n_head=cfg.heads,
        resid_pdrop=cfg.dropout,
        embd_pdrop=cfg.dropout,
        attn_pdrop=cfg.dropout,
        use_cache=False,
    )
    conf._attn_implementation = "sdpa"
    return GPT2LMHeadModel(conf)


def hf_llama(cfg: GPTConfig) -> nn.Module:
    """Hugging Face's Llama (``LlamaForCausalLM``) built from a config of the same size as ``cfg``: as many
    key/value heads as query heads, an MLP of width ``8/3 * dim`` (a multiple of 8), no cache in training."""
    from transformers import LlamaConfig, LlamaForCausalLM

    conf = LlamaConfig(
        vocab_size=cfg.vocab,
        hidden_size=cfg.dim,
        intermediate_size=cfg.dim * 8 // 3 // 8 * 8,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.heads,
        max_position_embeddings=cfg.seq,
        attention_dropout=cfg.dropout,
        use_cache=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    conf._attn_implementation = "sdpa"
    return LlamaForCausalLM(conf)


def hf_checkpointing_enable(model: nn.Module, *, use_reentrant: bool = False) -> nn.Module:
    """Hugging Face's own checkpointing on every layer: ``activation_checkpointing_enable``
    (transformers 5), else its older name ``gradient_checkpointing_enable`` (4.x; deprecated in 5)."""
    kwargs = {"use_reentrant": use_reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model


class ChainMLP(nn.Module):
    """One block of :class:`Chain`: widths differ from block to block, so do its input, activations and FLOPs."""

    def __init__(self, a: int, b: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(a, 2 * b), nn.Linear(2 * b, b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc2(torch.relu(self.fc1(x))))


class Chain(nn.Module):
    """A heterogeneous MLP chain: 8 input features, one :class:`ChainMLP` per pair of ``widths``, a scalar loss."""

    def __init__(self, widths: tuple[int, ...]):
        super().__init__()
        self.inp = nn.Linear(8, widths[0])
        self.blocks = nn.ModuleList(ChainMLP(a, b) for a, b in zip(widths[:-1], widths[1:]))
        self.head = nn.Linear(widths[-1], 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h).square().mean()


def is_chain_block(m: nn.Module) -> bool:
    """``blocks=`` for a :class:`Chain`."""
    return isinstance(m, ChainMLP)


class Tower(nn.Module):
    def __init__(self, d_in: int, d: int, layers: int, out: int):
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d, 2, 2 * d, dropout=0.0, batch_first=True) for _ in range(layers)
        )
        self.proj = nn.Linear(d, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.proj(h.mean(1))


class TwoTower(nn.Module):
    """CLIP-like: an image tower and a text tower of different widths, a contrastive loss."""

    def __init__(self):
        super().__init__()
        self.image = Tower(48, 64, 3, 32)
        self.text = Tower(16, 32, 3, 32)

    def forward(self, pixels: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        a = nn.functional.normalize(self.image(pixels), dim=-1)
        b = nn.functional.normalize(self.text(tokens), dim=-1)
        logits = a @ b.t() / 0.07
        target = torch.arange(len(a))
        return (nn.functional.cross_entropy(logits, target) + nn.functional.cross_entropy(logits.t(), target)) / 2
