"""Typed schemas for the Hydra configs in ``conf/`` (registered in a ConfigStore) and their validation.

Each YAML file in a group starts from its schema (``defaults: [<name>_schema]``), so a wrong type,
an unknown key or a missing value fails at composition; :func:`validate` catches the bad
combinations that no single field can express. Errors name the override to fix.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from distckpt.errors import ConfigError
from distckpt.options import GRAPHS, OPTIMIZERS, STRATEGIES, check_run

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


# --- model -----------------------------------------------------------------------------------------
@dataclass
class GPTModelConfig:
    name: str = "gpt"
    vocab_size: int = 64
    seq_len: int = 32
    d_model: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_classes: int = 4
    dropout: float = 0.0


@dataclass
class MLPModelConfig:
    name: str = "mlp"
    in_features: int = 32
    hidden: int = 128
    n_layer: int = 4
    n_classes_a: int = 10
    dropout: float = 0.0


@dataclass
class LoRAConfig:
    r: int = 0  # the adapters' rank; 0: no LoRA (the whole model trains)
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: Optional[list[str]] = None  # None: peft's default for the model type (gpt2: c_attn)


@dataclass
class HFModelConfig:
    name: str = "hf"
    config_name: str = MISSING  # a transformers model type: gpt2, llama, ... (ignored with `pretrained`)
    pretrained: Optional[str] = None  # a local directory written by save_pretrained (never a download)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    vocab_size: int = 64
    seq_len: int = 32
    d_model: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_classes: int = 4
    dropout: float = 0.0


# --- data ------------------------------------------------------------------------------------------
@dataclass
class DataConfig:
    name: str = "synthetic"  # synthetic | digits
    batch_size: int = 32  # the global batch: split over ranks and micro-batches
    seed: int = 0  # the data set (synthetic) and the per-epoch shuffling
    shuffle: bool = True  # a new seeded permutation each epoch
    drop_last: bool = True  # drop an incomplete last global batch of an epoch
    num_workers: int = 0  # DataLoader worker processes per rank
    pin_memory: bool = True  # on CUDA only
    n: int = 4096  # synthetic: samples in the train split
    n_eval: int = 256  # samples in the eval split (0: no eval split)
    noise: float = 0.05  # synthetic tokens only


@dataclass
class TokensDataConfig(DataConfig):
    name: str = "tokens"
    path: str = MISSING  # a flat binary of token ids (nanoGPT's train.bin; scripts/make_tokens.py writes one)
    eval_path: Optional[str] = None  # the eval split's file (e.g. val.bin); None: no eval split
    dtype: str = "uint16"  # uint16 | uint32


# --- strategy, activation checkpointing (the `ac` group), precision --------------------------------------------------
@dataclass
class StrategyConfig:
    name: str = "ddp"  # none | ddp | fsdp | fsdp2
    graph: str = "auto"  # auto | static | dynamic (distckpt.parallelize)


@dataclass
class ACConfig:
    name: str = "full"
    policy: str = "full"  # distckpt.wrap spec: none, full, every:N, first:N, fraction:F, budget:SIZE, selective
    n: int = 2  # every_n
    size: str = "auto"  # budget: e.g. 2GiB, 512MiB, auto
    blocks: Optional[list[str]] = None  # FQN globs; None: distckpt finds the repeated blocks
    reentrant: bool = False
    offload: bool = False  # keep the saved block inputs in host memory


@dataclass
class PrecisionConfig:
    name: str = "fp32"
    dtype: str = "fp32"  # fp32 | bf16 | fp16
    sharded: bool = False  # FSDP/FSDP2 mixed precision (params cast per unit, fp32 reduce) instead of autocast
    grad_scaler: bool = False  # needed for fp16


# --- optimizer, logger, trainer ---------------------------------------------------------------------
@dataclass
class OptimConfig:
    name: str = "adamw"  # adamw | sgd
    lr: float = 3e-3
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    momentum: float = 0.9  # sgd
    scheduler: str = "cosine"  # constant | cosine | linear
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1


@dataclass
class LoggerConfig:
    name: str = "jsonl"
    tensorboard: bool = False
    wandb: Optional[str] = None  # None | online | offline | disabled
    wandb_project: str = "distckpt"


@dataclass
class FaultConfig:
    """Fault injection, for tests of the recovery paths."""

    nan_at_steps: list[int] = field(default_factory=list)
    kill_at_step: Optional[int] = None  # SIGKILL rank `kill_rank` at this step (first attempt only)
    kill_rank: int = 1


@dataclass
class TrainerConfig:
    max_steps: int = 200
    grad_accum: int = 1
    clip_grad_norm: float = 1.0
    log_every: int = 10
    save_every: int = 100
    keep_last: int = 2
    eval_every: int = 0
    seed: int = 0
    resume: bool = True
    on_nonfinite: str = "skip"  # skip | stop
    task_weights: dict[str, float] = field(default_factory=dict)  # loss = sum of weight * task loss (default 1)
    guard_every: int = 0  # distckpt.GradSyncGuard every N steps; 0 = off
    verify_recompute: bool = False  # distckpt.verify_recompute once at start
    progress: bool = True
    device: str = "auto"  # auto | cpu | cuda
    fault: FaultConfig = field(default_factory=FaultConfig)


@dataclass
class Config:
    model: Any = MISSING  # untyped: model=custom takes any keys (its target's arguments)
    data: Any = MISSING  # likewise for data=custom; the built-in data sets use DataConfig
    strategy: StrategyConfig = MISSING
    ac: ACConfig = MISSING  # activation checkpointing; `ckpt` was its old name (refused in launch/check.py)
    precision: PrecisionConfig = MISSING
    optim: OptimConfig = MISSING
    logger: LoggerConfig = MISSING
    trainer: TrainerConfig = MISSING


def _run_id() -> str:
    """The default run folder's last part: the torchrun run id (one per launch, the same on every rank,
    node and restart), or a timestamp for a plain ``python launch/train.py``."""
    rid = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if rid and rid != "none":
        return rid.split("-")[0] if len(rid) == 36 else rid  # a uuid4 (standalone): its first 8 hex digits
    return time.strftime("%Y%m%d-%H%M%S")


def register() -> None:
    """Register the schemas and the ``run_id`` resolver (idempotent)."""
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)
    for group, name, node in [
        ("model", "gpt_schema", GPTModelConfig), ("model", "mlp_schema", MLPModelConfig),
        ("model", "hf_schema", HFModelConfig), ("data", "data_schema", DataConfig),
        ("data", "tokens_schema", TokensDataConfig),
        ("strategy", "strategy_schema", StrategyConfig), ("ac", "ac_schema", ACConfig),
        ("precision", "precision_schema", PrecisionConfig), ("optim", "optim_schema", OptimConfig),
        ("logger", "logger_schema", LoggerConfig), ("trainer", "trainer_schema", TrainerConfig),
    ]:
        cs.store(group=group, name=name, node=node)
    if not OmegaConf.has_resolver("run_id"):
        OmegaConf.register_new_resolver("run_id", _run_id, use_cache=True)


CHOICES = {
    "strategy.name": STRATEGIES,
    "strategy.graph": GRAPHS,
    "data.name": ("synthetic", "digits", "custom", "tokens", "multitask"),
    "precision.dtype": ("fp32", "bf16", "fp16"),
    "optim.name": OPTIMIZERS,
    "optim.scheduler": ("constant", "cosine", "linear"),
    "trainer.on_nonfinite": ("skip", "stop"),
    "trainer.device": ("auto", "cpu", "cuda"),
}


def validate(cfg: DictConfig, world_size: int = 1) -> None:
    """Check values and combinations of a composed config before anything is built or written.

    Args:
        cfg: the composed config.
        world_size: the number of processes of the job (``WORLD_SIZE``).

    Raises:
        ConfigError: naming the override to change.
    """
    try:
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except Exception as e:  # MissingMandatoryValue, InterpolationResolutionError
        key = getattr(e, "full_key", "") or "?"
        raise ConfigError(f"{key} has no value: set it on the command line, e.g. {key}=...") from None
    for key, allowed in CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of {', '.join(allowed)}; fix the override {key}=...")
    if cfg.logger.wandb not in (None, "online", "offline", "disabled"):
        raise ConfigError(f"logger.wandb={cfg.logger.wandb!r}: use null, online, offline or disabled.")
    t, s, d, m = cfg.trainer, cfg.strategy.name, cfg.data, cfg.model
    for key in ("max_steps", "grad_accum", "log_every"):
        if t[key] < 1:
            raise ConfigError(f"trainer.{key}={t[key]} must be >= 1.")
    for key in ("save_every", "eval_every", "guard_every", "keep_last"):
        if t[key] < 0:
            raise ConfigError(f"trainer.{key}={t[key]} must be >= 0 (0 turns it off).")
    if s == "none" and world_size > 1:
        raise ConfigError(f"strategy=none with {world_size} processes would train {world_size} unrelated "
                          "copies; use strategy=ddp (or fsdp, fsdp2), or run one process.")
    if d.batch_size % (world_size * t.grad_accum):
        raise ConfigError(f"data.batch_size={d.batch_size} must be a multiple of {world_size} ranks x "
                          f"trainer.grad_accum={t.grad_accum}; change data.batch_size or trainer.grad_accum.")
    if m.name == "hf" and m.pretrained:
        from launch.hf import check_pretrained

        check_pretrained(m.pretrained)
    if m.name == "hf" and m.lora.r < 0:
        raise ConfigError(f"model.lora.r={m.lora.r} must be >= 0 (0: no LoRA).")
    if d.name == "multitask":
        total = sum(task.weight for task in d.tasks.values())
        for name, task in d.tasks.items():
            share = d.batch_size * task.weight / total
            if share != int(share) or share % (world_size * t.grad_accum):
                raise ConfigError(f"data.tasks.{name}: weight {task.weight} gives {share:g} of data.batch_size="
                                  f"{d.batch_size} samples, not a multiple of {world_size} ranks x trainer.grad_accum="
                                  f"{t.grad_accum}; change data.batch_size or the task weights.")
    if d.name == "tokens":
        if d.dtype not in ("uint16", "uint32"):
            raise ConfigError(f"data.dtype={d.dtype!r} is not one of uint16, uint32.")
        for key in ("path", "eval_path"):
            if d[key] is not None and not Path(d[key]).is_file():
                raise ConfigError(f"data.{key}={d[key]} is not a file; write one with scripts/make_tokens.py.")
        if "seq_len" not in m:
            raise ConfigError(f"data=tokens cuts the file into model.seq_len windows: model={m.name} has no "
                              "seq_len (add +model.seq_len=N).")
    if d.name == "digits" and m.name not in ("mlp", "custom"):
        raise ConfigError(f"data=digits is image features: it needs model=mlp (got model={m.name}).")
    if cfg.precision.dtype == "fp16" and not cfg.precision.grad_scaler:
        raise ConfigError("precision.dtype=fp16 without a grad scaler underflows; use precision=fp16 "
                          "(which sets precision.grad_scaler=true) or precision=bf16.")
    if cfg.precision.sharded and s not in ("fsdp", "fsdp2"):
        raise ConfigError(f"precision.sharded=true needs strategy=fsdp or fsdp2 (got strategy={s}); "
                          "use precision=bf16 (autocast) instead.")
    try:  # the library's own rule for these settings, so --check and parallelize agree
        check_run(s, reentrant=cfg.ac.reentrant, graph=cfg.strategy.graph, accumulate=t.grad_accum > 1)
    except ConfigError as e:
        raise ConfigError(f"strategy={s} strategy.graph={cfg.strategy.graph} ac.reentrant={cfg.ac.reentrant} "
                          f"trainer.grad_accum={t.grad_accum}: {e}") from None
    if "n_head" in m and m.d_model % m.n_head:
        raise ConfigError(f"model.d_model={m.d_model} must be divisible by model.n_head={m.n_head}.")
