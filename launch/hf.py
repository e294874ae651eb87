"""``model=hf``: pretrained weights from a local directory, peft LoRA, and ``RUN_DIR/hf/`` at the end.

transformers and peft are the ``hf`` extra; they are imported here only when ``model=hf`` asks for them.
"""

from __future__ import annotations

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


def build_hf(m: DictConfig) -> MultiTaskHF:
    """The causal LM of ``model=hf`` with its classification head: from ``model.pretrained`` (a local
    directory, never a download) or randomly initialised from ``model.config_name``; with LoRA adapters
    when ``model.lora.r > 0`` (the base frozen, the adapters and the task head trainable).

    Raises:
        ConfigError: a missing directory, a ``model.vocab_size`` above the pretrained vocabulary, or LoRA
            target modules that the model does not have.
    """
    if m.pretrained:
        from transformers import AutoModelForCausalLM  # optional dependency (extra "hf")

        check_pretrained(m.pretrained)
        lm = AutoModelForCausalLM.from_pretrained(m.pretrained, local_files_only=True)
        lm.config.use_cache = False  # checkpointed layers must not write a cache (docs: DESIGN.md)
        if m.vocab_size > lm.config.vocab_size:
            raise ConfigError(
                f"model.vocab_size={m.vocab_size} exceeds the pretrained vocabulary "
                f"({lm.config.vocab_size}) of {m.pretrained}; lower model.vocab_size."
            )
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
