"""Models the launcher trains: a small multi-task GPT, a multi-task MLP, and a Hugging Face causal LM.

Every model takes a batch dict and returns a dict of per-task losses, so the whole loss (and every
head) is computed inside ``forward``: every trainable parameter takes part in every step, which
is what DDP with ``find_unused_parameters=False`` and FSDP2's root forward need.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from distckpt.errors import ConfigError

# The config fields of an HF model type that carry its MLP width and its key/value head count.
HF_FFN_KEYS = ("intermediate_size", "n_inner", "ffn_dim")
HF_KV_HEAD_KEYS = ("num_key_value_heads",)

__all__ = ["Block", "MLPBlock", "MultiTaskGPT", "MultiTaskHF", "MultiTaskMLP", "build_hf_causal_lm"]


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention then an MLP.

    Query, key and value are separate linears and the head count is read from their outputs' width, so that
    tensor parallel (``strategy.tp``) splits them column-wise into whole heads per rank (torchtitan's layout): a
    fused ``qkv`` split column-wise would give a rank the queries of some heads and the keys of others."""

    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.head_dim = d_model // n_head
        self.ln1 = nn.LayerNorm(d_model)
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.fc_out = nn.Linear(4 * d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.ln1(x)
        # -1 heads: all of them, or this rank's under tensor parallel (q, k, v hold whole heads).
        q, k, v = (lin(h).view(b, t, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))
        # Dropout is applied to the block's output rather than inside SDPA so that the RNG stream
        # (restored on resume, replayed by the recompute) is the same on every backend.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, -1)))
        return x + self.drop(self.fc_out(F.gelu(self.fc(self.ln2(x)))))


class MultiTaskGPT(nn.Module):
    """A GPT-style trunk (blocks in ``self.blocks``, an ``nn.ModuleList``) with two task heads.

    Tasks: ``lm`` (next-token prediction over ``tokens``) and ``cls`` (a sequence label from the
    mean-pooled final hidden state).
    """

    def __init__(
        self,
        vocab_size: int = 64,
        seq_len: int = 32,
        d_model: int = 64,
        n_layer: int = 4,
        n_head: int = 4,
        n_classes: int = 4,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.cls_head = nn.Linear(d_model, n_classes)
        self.apply(_init_weights)
        for name, p in self.named_parameters():
            if name.endswith(("proj.weight", "fc_out.weight")):  # GPT-2's scaled residual init
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layer))

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        tokens = batch["tokens"]
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        h = self.ln_f(x)
        logits = self.lm_head(h[:, :-1])
        lm = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))
        return _with_cls(lm, self.cls_head(h.mean(dim=1)), batch)


class MLPBlock(nn.Module):
    """A residual pre-norm MLP block."""

    def __init__(self, hidden: int, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, hidden)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(F.gelu(self.fc(self.norm(x))))


class MultiTaskMLP(nn.Module):
    """An MLP trunk of residual blocks with two classification heads (``a`` and ``b``)."""

    def __init__(
        self,
        in_features: int = 32,
        hidden: int = 128,
        n_layer: int = 4,
        n_classes_a: int = 10,
        n_classes_b: int = 2,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.inp = nn.Linear(in_features, hidden)
        self.blocks = nn.ModuleList(MLPBlock(hidden, dropout) for _ in range(n_layer))
        self.head_a = nn.Linear(hidden, n_classes_a)
        self.head_b = nn.Linear(hidden, n_classes_b)
        self.apply(_init_weights)

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        x = self.inp(batch["x"])
        for block in self.blocks:
            x = block(x)
        return {
            "a": F.cross_entropy(self.head_a(x).float(), batch["y_a"]),
            "b": F.cross_entropy(self.head_b(x).float(), batch["y_b"]),
        }


class MultiTaskHF(nn.Module):
    """A Hugging Face causal LM (``self.lm``) plus a sequence-classification head on its last hidden state."""

    def __init__(self, lm: nn.Module, n_classes: int) -> None:
        super().__init__()
        self.lm = lm
        self.cls_head = nn.Linear(lm.config.hidden_size, n_classes)

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = self.lm(input_ids=batch["tokens"], labels=batch["tokens"], output_hidden_states=True)
        return _with_cls(out.loss, self.cls_head(out.hidden_states[-1].mean(dim=1)), batch)


def build_hf_causal_lm(
    config_name: str,
    *,
    vocab_size: int,
    seq_len: int,
    n_layer: int,
    d_model: int,
    n_head: int,
    n_classes: int,
    dropout: float = 0.0,
    intermediate_size: int | None = None,
    kv_heads: int | None = None,
) -> MultiTaskHF:
    """Build a randomly initialised Hugging Face causal LM from a model type name; nothing is downloaded.

    Args:
        config_name: a ``transformers`` model type such as ``"gpt2"`` or ``"llama"``.
        vocab_size, seq_len, n_layer, d_model, n_head: the architecture's size.
        n_classes: classes of the second (sequence classification) task.
        dropout: dropout probability where the architecture has one.
        intermediate_size: the MLP's hidden width (Llama ``intermediate_size``, GPT-2 ``n_inner``, OPT
            ``ffn_dim``); ``None``: ``4 * d_model``.
        kv_heads: key/value heads for grouped-query attention (``num_key_value_heads``); ``None``: ``n_head``.

    Returns:
        A :class:`MultiTaskHF` around ``AutoModelForCausalLM.from_config(...)``.

    Raises:
        ValueError: ``config_name`` is not a model type ``transformers`` knows.
        ConfigError: ``intermediate_size``/``kv_heads`` given for a model type whose config has no such field,
            or ``kv_heads`` not dividing ``n_head``.
    """
    from transformers import AutoConfig, AutoModelForCausalLM  # optional dependency (extra "hf")

    if kv_heads is not None and (kv_heads < 1 or n_head % kv_heads):
        raise ConfigError(
            f"kv_heads={kv_heads} must divide n_head={n_head} (each key/value head serves "
            "n_head / kv_heads query heads)."
        )
    config = AutoConfig.for_model(config_name)
    sizes = dict(
        vocab_size=vocab_size,
        n_positions=seq_len,
        max_position_embeddings=seq_len,
        n_layer=n_layer,
        num_hidden_layers=n_layer,
        n_embd=d_model,
        hidden_size=d_model,
        n_head=n_head,
        num_attention_heads=n_head,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
    )
    # Llama/Mistral/Gemma configs store head_dim (128 in their defaults); it is not derived again from the
    # new hidden size, so without this a d_model=64, n_head=4 Llama had 4 heads of 128 (q_proj 64 -> 512).
    sizes["head_dim"] = d_model // n_head
    # The same two sizes under each family's own name (Llama/Mistral/Qwen2/NeoX, GPT-2/GPT-J, OPT).
    for value, keys, what in (
        (intermediate_size, HF_FFN_KEYS, "an MLP width"),
        (kv_heads, HF_KV_HEAD_KEYS, "grouped-query attention"),
    ):
        present = [k for k in keys if hasattr(config, k)]
        if value is not None and not present:
            raise ConfigError(
                f"transformers' {config_name} config has no {what} field (none of {', '.join(keys)}); "
                f"leave it unset for {config_name}."
            )
        default = 4 * d_model if keys is HF_FFN_KEYS else n_head
        sizes.update({k: default if value is None else value for k in present})
    config.update({k: v for k, v in sizes.items() if hasattr(config, k)})
    config.use_cache = False
    return MultiTaskHF(AutoModelForCausalLM.from_config(config), n_classes)


def _with_cls(lm: torch.Tensor, cls_logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The task losses: ``lm``, and ``cls`` when the batch has labels. Without labels (token files) the
    classification head joins the loss with weight zero, so that every trainable parameter still takes
    part in the step (DDP with ``find_unused_parameters=False``, FSDP2's root forward)."""
    if "label" not in batch:
        return {"lm": lm + 0.0 * cls_logits.sum()}
    return {"lm": lm, "cls": F.cross_entropy(cls_logits.float(), batch["label"])}


def _init_weights(m: nn.Module) -> None:
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, std=0.02)
        if getattr(m, "bias", None) is not None:
            nn.init.zeros_(m.bias)
