"""Typed schemas for the Hydra configs in ``conf/``, registered in a ConfigStore.

Each YAML file in a group starts from its schema (``defaults: [<name>_schema]``), so a wrong type,
an unknown key or a missing value fails at composition; :mod:`launch.config` validates what no single
field can express. The bottom of the launcher: the builders (``launch/build.py``) take these types too.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

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
    intermediate_size: Optional[int] = None  # MLP width (llama: intermediate_size, gpt2: n_inner); None: 4 x d_model
    kv_heads: Optional[int] = None  # key/value heads (GQA: llama num_key_value_heads); None: n_head
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


@dataclass
class HFDataConfig(DataConfig):
    name: str = "hf"
    path: str = MISSING  # a datasets directory (save_to_disk) or local .jsonl/.json/.parquet/.txt files (a glob)
    eval_path: Optional[str] = None  # the eval split, the same kinds of path; None: no eval split
    text_field: str = "text"  # the column holding each document's text
    tokenizer: Optional[str] = None  # a directory written by save_pretrained; None: model.pretrained's
    streaming: bool = False  # false: tokenize once into a token cache (map-style); true: datasets' streaming
    shuffle_block: int = 256  # streaming with shuffle: windows shuffled together (the state re-reads one block)
    cache_dir: Optional[str] = None  # the token cache (streaming=false); None: $DISTCKPT_CACHE or ~/.cache/distckpt


# --- strategy, activation checkpointing (the `ac` group), precision --------------------------------------------------
@dataclass
class StrategyConfig:
    name: str = "ddp"  # none | ddp | fsdp | fsdp2 | hsdp
    graph: str = "auto"  # auto | static | dynamic (distckpt.parallelize)
    shard_size: Optional[int] = None  # hsdp: ranks per shard group; None: LOCAL_WORLD_SIZE (one node's ranks)
    tp: int = 1  # tensor-parallel ranks per data-parallel rank (fsdp2; model=gpt or a Llama-style hf model)
    # torch.compile backend for each block, after checkpointing and before sharding (parallelize's compile=), e.g.
    # inductor or aot_eager; None: no compile
    compile: Optional[str] = None


@dataclass
class ACConfig:
    name: str = "full"
    policy: str = "full"  # distckpt.wrap spec: none, full, every:N, first:N, fraction:F, budget:SIZE, selective
    n: int = 2  # every_n
    size: str = "auto"  # budget: e.g. 2GiB, 512MiB, auto
    blocks: Optional[list[str]] = None  # FQN globs; None: distckpt finds the repeated blocks
    reentrant: bool = False
    offload: bool = False  # keep the saved block inputs in host memory
    # budget: the "offload" mode's price, FLOPs per byte moved to the host and back (null: offload not offered;
    # off CUDA it never is)
    offload_flops_per_byte: Optional[float] = None


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
    wandb_init_timeout: float = 20.0  # seconds to wait for wandb's server before logging offline


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
    max_consecutive_skips: int = 10  # skip: stop the run after this many skipped steps in a row (0: no limit)
    task_weights: dict[str, float] = field(default_factory=dict)  # loss = sum of weight * task loss (default 1)
    # Resume a streamed data set saved on another layout (ranks x data workers) at its global position, although
    # its order cannot be kept there (samples may repeat or be skipped); false: such a resume is refused.
    allow_reshuffle: bool = False
    guard_every: int = 0  # distckpt.GradSyncGuard every N steps; 0 = off
    verify_recompute: bool = False  # distckpt.verify_recompute once at start
    progress: bool = True
    device: str = "auto"  # auto | cpu | cuda
    # distckpt.train.Callback objects for fit(), each a `{_target_: pkg.Class, arg: value}` the launcher
    # instantiates (e.g. the tests' fault injection, tests/faults.py).
    callbacks: list[Any] = field(default_factory=list)


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


# Every schema with its group; register() stores them and the range test walks their fields.
SCHEMAS: list[tuple[str, str, type]] = [
    ("model", "gpt_schema", GPTModelConfig),
    ("model", "mlp_schema", MLPModelConfig),
    ("model", "hf_schema", HFModelConfig),
    ("data", "data_schema", DataConfig),
    ("data", "tokens_schema", TokensDataConfig),
    ("data", "hf_data_schema", HFDataConfig),
    ("strategy", "strategy_schema", StrategyConfig),
    ("ac", "ac_schema", ACConfig),
    ("precision", "precision_schema", PrecisionConfig),
    ("optim", "optim_schema", OptimConfig),
    ("logger", "logger_schema", LoggerConfig),
    ("trainer", "trainer_schema", TrainerConfig),
]


def register() -> None:
    """Register the schemas and the ``run_id`` resolver (idempotent)."""
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)
    for group, name, node in SCHEMAS:
        cs.store(group=group, name=name, node=node)
    if not OmegaConf.has_resolver("run_id"):
        OmegaConf.register_new_resolver("run_id", _run_id, use_cache=True)
    if not OmegaConf.has_resolver("hf_pretrained"):
        OmegaConf.register_new_resolver("hf_pretrained", _hf_pretrained, use_cache=True)


def _hf_pretrained(path: str | None, key: str, default: int) -> int:
    """``${hf_pretrained:${.pretrained},vocab_size,64}``: the pretrained model's own size, else the default."""
    from launch.hf import pretrained_default  # transformers only when a pretrained directory is named

    return pretrained_default(path, key, default)
