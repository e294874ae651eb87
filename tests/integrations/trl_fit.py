"""TRL's ``DPOTrainer`` and ``SFTTrainer`` on the ranks of the test pool (tests/harness.py), and the single-process
reference they are compared with, for tests/integrations/test_trl.py.

The model is a Llama built from a tiny config (no download), with TRL's own LoRA (``peft_config``); the tokenizer a
word-level one built here; the data rebuilt from a seed. Every run is SGD at a constant rate, no clipping, the
sequential sampler: step ``s`` of rank ``r`` holds items ``[(s * world + r) * B, ... + B)``, so one process with a batch
of ``world * B`` sees the same global batch. The reference is TRL's own trainer in one process without checkpointing.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from typing import Any

import torch
from accelerate_fit import kept_environ
from hf_fit import HF_CKPT, PLAIN_SGD, Record, _name, _release_accelerate
from torch import nn

import distckpt

STEPS = 3  # optimizer steps
BATCH = 2  # items per rank per step
VOCAB = 64
LR = 0.1
KINDS = ("dpo", "sft")


def tokenizer() -> Any:
    """A word-level tokenizer over ``w0 .. w60`` (ids 3..63), built in memory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(VOCAB - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def _words(g: torch.Generator, n: int) -> str:
    return " ".join(f"w{int(i)}" for i in torch.randint(0, VOCAB - 3, (n,), generator=g))


def dataset(kind: str, n: int) -> Any:
    """``n`` items, the same in every process: preference pairs (DPO: prompt, chosen, rejected; lengths vary, so
    batches are padded) or plain text (SFT)."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(1)
    lengths = lambda: int(torch.randint(3, 7, (1,), generator=g))  # noqa: E731
    if kind == "dpo":
        # The completions start with a space: the prompt's last word and the completion's first stay two tokens.
        rows = [{"prompt": _words(g, lengths()), "chosen": " " + _words(g, lengths()),
                 "rejected": " " + _words(g, lengths())} for _ in range(n)]  # fmt: skip
    else:
        rows = [{"text": _words(g, 2 * lengths())} for _ in range(n)]
    return Dataset.from_list(rows)


def tiny_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=1,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


def lora() -> Any:
    """TRL applies it (``peft_config``); B initialized randomly, so every adapter gets a gradient from step one."""
    from peft import LoraConfig

    return LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )  # fmt: skip


def config(kind: str, out: str, batch: int, **kw: Any) -> Any:
    """TRL's config for ``kind``, with TRL's defaults (``gradient_checkpointing=True`` among them) unless ``kw``."""
    from trl import DPOConfig, SFTConfig

    cls = DPOConfig if kind == "dpo" else SFTConfig
    extra = {"dataset_text_field": "text"} if kind == "sft" else {}
    return cls(
        **PLAIN_SGD,
        output_dir=out,
        bf16=False,
        per_device_train_batch_size=batch,
        max_steps=STEPS,
        learning_rate=LR,
        train_sampling_strategy="sequential",
        **extra,
        **kw,
    )


def trainer_class(kind: str, distckpt_trainer: bool) -> type:
    from trl import DPOTrainer, SFTTrainer

    cls = DPOTrainer if kind == "dpo" else SFTTrainer
    if distckpt_trainer:
        from distckpt.integrations.hf import with_distckpt

        return with_distckpt(cls)
    return cls


def fit(
    rank: int, world: int, kind: str, how: str, *, reentrant: bool = False, batch: int = BATCH, **cfg: Any
) -> dict[str, Any]:
    """TRL's ``kind`` trainer ("dpo", "sft") with LoRA, ``STEPS`` steps, on this rank. ``how``: "distckpt"
    (``with_distckpt(TRLTrainer)`` and ``DistckptCallback(reentrant=reentrant, guard_every=1)``, TRL's
    checkpointing default left on for distckpt to take over), "prepare" (TRL's trainer, then ``prepare(trainer)``),
    "trl" (TRL alone: its default HF checkpointing, ``use_reentrant=reentrant``), "none" (TRL, no checkpointing).
    ``cfg``: more config fields. {"grads", "params", "checkpointed", "find_unused", "log_history"} or {"error",
    "message"}."""
    from distckpt.integrations.hf import DistckptCallback, prepare

    rec = Record()
    callbacks: list[Any] = [rec]
    if how in ("distckpt", "prepare"):
        callbacks.append(DistckptCallback(guard_every=1, reentrant=reentrant))
    if how == "trl":
        cfg[f"{HF_CKPT}_kwargs"] = {"use_reentrant": reentrant}  # TRL's default turns HF's checkpointing on
    if how == "none":
        cfg[HF_CKPT] = False
    with tempfile.TemporaryDirectory() as out, kept_environ():

        def train() -> Any:
            trainer = trainer_class(kind, how == "distckpt")(
                model=tiny_llama(),
                args=config(kind, out, batch, **cfg),
                train_dataset=dataset(kind, STEPS * world * batch),
                processing_class=tokenizer(),
                peft_config=lora(),
                callbacks=callbacks,
            )
            if how == "prepare":
                prepare(trainer)
            trainer.train()
            return trainer

        return trained(train, rec)


def trained(train: Callable[[], Any], rec: Record) -> dict[str, Any]:
    """What a TRL run measured: ``train()`` builds and trains a trainer, ``rec`` recorded its gradients.
    {"grads", "params", "checkpointed", "hf_checkpointing", "find_unused", "log_history"}, or {"error",
    "message"} when it raised (what the trainer raises is the measurement)."""
    try:
        trainer = train()
    except Exception as e:  # noqa: BLE001 - what the trainer raises is the measurement
        return {
            "error": (type(e).__name__, str(e).strip().splitlines()[0] if str(e).strip() else ""),
            "message": str(e),
        }
    finally:
        _release_accelerate()
    model = trainer.model
    return {
        "grads": rec.grads,
        "params": {_name(n): p.detach().clone() for n, p in model.named_parameters() if p.requires_grad},
        "checkpointed": distckpt.checkpointed(model),
        "hf_checkpointing": bool(trainer.args.activation_checkpointing),
        "find_unused": getattr(trainer.model_wrapped, "find_unused_parameters", None),
        "log_history": trainer.state.log_history,
    }


def reference(kind: str, world: int = 2) -> tuple[list[dict], dict]:
    """TRL's ``kind`` trainer in one process without checkpointing on the global batch (``world * BATCH``):
    (per-step grads, final trainable params), for tests/patterns.py's ``assert_matches``."""
    out = fit(0, 1, kind, "none", batch=world * BATCH)
    assert "error" not in out, out["message"]
    return out["grads"], out["params"]


def sweep(rank: int, world: int, cases: list[tuple[str, str, bool]]) -> dict[tuple, dict]:
    """Every ``(kind, how, reentrant)`` of ``cases`` in one pool call."""
    return {case: fit(rank, world, case[0], case[1], reentrant=case[2]) for case in cases}
