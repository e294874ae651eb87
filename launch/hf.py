"""``model=hf``: pretrained weights from a local directory, peft LoRA, and ``RUN_DIR/hf/`` at the end.

transformers and peft are the ``hf`` extra; they are imported here only when ``model=hf`` asks for them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from omegaconf import DictConfig, OmegaConf

from distckpt._dist import rank_world
from distckpt.errors import ConfigError, first_lines
from distckpt.train.models import MultiTaskHF, build_hf_causal_lm


def check_pretrained(path: str) -> None:
    """Raise unless ``path`` is a local directory written by ``save_pretrained`` (it has a ``config.json``)."""
    if not (Path(path) / "config.json").is_file():
        raise ConfigError(
            f"model.pretrained={path} is not a local directory with a config.json (one written by "
            "save_pretrained); nothing is downloaded: give the directory of a saved model."
        )


# The longest default window taken from a pretrained context length: long-context models (Llama 3: 131072
# positions) would otherwise default to windows no first run can hold; model.seq_len=N sets any length.
MAX_DEFAULT_SEQ_LEN = 2048


@dataclass(frozen=True)
class PretrainedFacts:
    """What a run needs to know about a saved model before building it: read from its ``config.json`` (and
    its tokenizer, when the directory holds one), never from the launcher's defaults."""

    vocab_size: int  # rows of the input embedding: every token id must be below it
    context: int | None  # positions the model was built for (n_positions / max_position_embeddings)
    eos_token_id: int | None  # the tokenizer's (else the config's) end-of-text id: separates packed documents
    bos_token_id: int | None
    tokenizer: bool  # the directory holds a tokenizer (the default one of data=hf)

    @property
    def seq_len(self) -> int | None:
        """The default ``model.seq_len``: the context length, at most :data:`MAX_DEFAULT_SEQ_LEN`."""
        return min(self.context, MAX_DEFAULT_SEQ_LEN) if self.context else None


@functools.lru_cache(maxsize=8)
def pretrained_facts(path: str) -> PretrainedFacts:
    """The vocabulary size, context length and special tokens of the model saved in ``path``.

    Raises:
        ConfigError: ``path`` has no ``config.json`` (see :func:`check_pretrained`).
    """
    from transformers import AutoConfig  # optional dependency (extra "hf")

    check_pretrained(path)
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    context = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
    eos, bos = getattr(text, "eos_token_id", None), getattr(text, "bos_token_id", None)
    has_tokenizer = any((Path(path) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json"))
    if has_tokenizer:
        tok = load_tokenizer(path)
        eos = tok.eos_token_id if tok.eos_token_id is not None else eos
        bos = tok.bos_token_id if tok.bos_token_id is not None else bos
    first = lambda v: v[0] if isinstance(v, (list, tuple)) else v  # some configs list several eos ids
    return PretrainedFacts(int(text.vocab_size), context, first(eos), first(bos), has_tokenizer)


def load_tokenizer(path: str) -> Any:
    """``AutoTokenizer.from_pretrained(path, local_files_only=True)``: a tokenizer saved in a local directory.

    Raises:
        ConfigError: ``path`` holds no tokenizer that transformers can load.
    """
    from transformers import AutoTokenizer  # optional dependency (extra "hf")

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(
            f"{path} holds no tokenizer transformers can load ({first_lines(e)}); give a directory written by "
            "tokenizer.save_pretrained (nothing is downloaded)."
        ) from None


def pretrained_default(path: str | None, key: str, default: int) -> int:
    """``model.vocab_size`` / ``model.seq_len`` of ``model=hf``: the pretrained model's own with
    ``model.pretrained=DIR``, else ``default`` (the ``hf_pretrained`` resolver of ``conf/model/hf.yaml``).

    Never raises: an unreadable ``DIR`` gives ``default`` here and its own error from :func:`check_pretrained`."""
    if not path:
        return default
    try:
        value = getattr(pretrained_facts(str(path)), key)
    except Exception:  # no config.json, transformers missing: check_pretrained and check_extras say it
        return default
    return int(value) if value is not None else default


def check_pretrained_sizes(m: DictConfig) -> None:
    """An explicit ``model.vocab_size`` / ``model.seq_len`` must fit the pretrained model.

    Raises:
        ConfigError: a vocabulary above the pretrained one, or windows longer than its context.
    """
    facts = pretrained_facts(m.pretrained)
    if m.vocab_size > facts.vocab_size:
        raise ConfigError(
            f"model.vocab_size={m.vocab_size} exceeds the vocabulary ({facts.vocab_size}) of model.pretrained="
            f"{m.pretrained}; leave model.vocab_size unset (it defaults to the pretrained vocabulary) or lower it."
        )
    if facts.context and m.seq_len > facts.context:
        raise ConfigError(
            f"model.seq_len={m.seq_len} is longer than the {facts.context} positions of model.pretrained="
            f"{m.pretrained}; set model.seq_len={facts.context} or less."
        )


def build_hf(m: DictConfig) -> MultiTaskHF:
    """The causal LM of ``model=hf`` with its classification head: from ``model.pretrained`` (a local
    directory, never a download) or randomly initialised from ``model.config_name``; with LoRA adapters
    when ``model.lora.r > 0`` (the base frozen, the adapters and the task head trainable).

    Raises:
        ConfigError: a missing directory, a ``model.vocab_size`` or ``model.seq_len`` above the pretrained
            model's (:func:`check_pretrained_sizes`), or LoRA
            target modules that the model does not have.
    """
    if m.pretrained:
        from transformers import AutoModelForCausalLM  # optional dependency (extra "hf")

        check_pretrained_sizes(m)
        lm = AutoModelForCausalLM.from_pretrained(m.pretrained, local_files_only=True)
        lm.config.use_cache = False  # checkpointed layers must not write a cache (docs: DESIGN.md)
        model = MultiTaskHF(lm, m.n_classes)
    else:
        model = build_hf_causal_lm(
            m.config_name,
            vocab_size=m.vocab_size,
            seq_len=m.seq_len,
            n_layer=m.n_layer,
            d_model=m.d_model,
            n_head=m.n_head,
            n_classes=m.n_classes,
            dropout=m.dropout,
            intermediate_size=m.intermediate_size,
            kv_heads=m.kv_heads,
        )
    if m.lora.r > 0:
        model.lm = _add_lora(model.lm, m.lora)
    return model


def _add_lora(lm: nn.Module, c: DictConfig) -> nn.Module:
    from peft import LoraConfig, get_peft_model  # optional dependency (extra "hf")

    targets = OmegaConf.to_container(c.target_modules) if c.target_modules else None
    try:
        return get_peft_model(
            lm,
            LoraConfig(
                r=c.r, lora_alpha=c.alpha, lora_dropout=c.dropout, target_modules=targets, task_type="CAUSAL_LM"
            ),
        )
    except ValueError as e:  # peft: unknown default targets for this model type, or targets not found
        raise ConfigError(
            f"model.lora: {first_lines(e)} Set model.lora.target_modules=[...] to module "
            "names of this model (e.g. [c_attn] for gpt2, [q_proj,v_proj] for llama)."
        ) from None


def save_hf(model: nn.Module, inner: MultiTaskHF, run_dir: str) -> Path | None:
    """Write ``run_dir/hf/``: ``save_pretrained`` of the LoRA adapter (peft) or of the whole LM, plus the
    task head's weights (``task_head.pt``). Call it on every rank (the full state dict is gathered
    from the shards); rank 0 writes. Returns the folder on rank 0, else ``None``.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank_world()[0] != 0:
        return None
    out = Path(run_dir) / "hf"
    lm_sd = {k[len("lm.") :]: v for k, v in full.items() if k.startswith("lm.")}
    inner.lm.save_pretrained(str(out), state_dict=lm_sd)
    torch.save({k[len("cls_head.") :]: v for k, v in full.items() if k.startswith("cls_head.")}, out / "task_head.pt")
    return out


def hf_inner(model: Any) -> MultiTaskHF | None:
    """``model`` if it is the launcher's HF model (before parallelize), else ``None``."""
    return model if isinstance(model, MultiTaskHF) else None
