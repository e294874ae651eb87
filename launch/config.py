"""Validation of a composed launcher config: every field against its range, the choices, the combinations
that no single field can express, the optional packages, and the ``ac`` group on the model itself (built
on the meta device). The typed schemas the YAML files start from are in :mod:`launch.schema`. Errors
name the override to fix.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from distckpt.errors import ConfigError
from distckpt.options import GRAPHS, OPTIMIZERS, STRATEGIES, check_run
from launch.build import layout_of

CHOICES = {
    "strategy.name": STRATEGIES,
    "strategy.graph": GRAPHS,
    "data.name": ("synthetic", "digits", "custom", "tokens", "hf", "multitask"),
    "precision.dtype": ("fp32", "bf16", "fp16"),
    "optim.name": OPTIMIZERS,
    "optim.scheduler": ("constant", "cosine", "linear"),
    "trainer.on_nonfinite": ("skip", "stop"),
    "trainer.device": ("auto", "cpu", "cuda"),
}


@dataclass(frozen=True)
class Range:
    """The allowed values of a numeric field: an interval, closed unless ``lo_open``/``hi_open``.
    Non-finite values (nan, inf) are never in it."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    why: str = ""  # said after the range when a value is refused

    def __contains__(self, v: object) -> bool:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            return False
        above = self.lo is None or (v > self.lo if self.lo_open else v >= self.lo)
        return above and (self.hi is None or (v < self.hi if self.hi_open else v <= self.hi))

    def __str__(self) -> str:
        if self.lo is not None and self.hi is not None:
            return f"in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"
        if self.lo is not None:
            return f"{'>' if self.lo_open else '>='} {self.lo:g}"
        return f"{'<' if self.hi_open else '<='} {self.hi:g}" if self.hi is not None else "finite"


SIZE = Range(1)  # counts and sizes
OFF_OR_EVERY = Range(0, why="0 turns it off")
PROBABILITY = Range(0, 1)
DROPOUT = Range(0, 1, hi_open=True)
# The typed range of every numeric field of the schemas (launch/schema.py; tests/launch/test_config.py checks that
# none is missing). A key absent from a composed config (model.hidden under model=gpt) is skipped; a
# list's elements are checked one by one.
RANGES: dict[str, Range] = {
    "model.vocab_size": SIZE,
    "model.seq_len": Range(2, why="the lm task predicts each next token, so a sequence needs two"),
    "model.d_model": SIZE,
    "model.n_layer": SIZE,
    "model.n_head": SIZE,
    "model.intermediate_size": Range(1, why="the MLP width; null: 4 x model.d_model"),
    "model.kv_heads": Range(1, why="key/value heads, dividing model.n_head; null: model.n_head"),
    "model.n_classes": SIZE,
    "model.in_features": SIZE,
    "model.hidden": SIZE,
    "model.n_classes_a": SIZE,
    "model.dropout": DROPOUT,
    "model.lora.r": Range(0, why="the adapters' rank; 0: no LoRA"),
    "model.lora.alpha": Range(0, lo_open=True),
    "model.lora.dropout": DROPOUT,
    "data.batch_size": SIZE,
    "data.seed": Range(0),
    "data.num_workers": Range(0, why="0 reads in the training process"),
    "data.n": SIZE,
    "data.n_eval": Range(0, why="0: no eval split"),
    "data.noise": PROBABILITY,
    "data.shuffle_block": Range(1, why="windows shuffled together; 1: no shuffle"),
    "strategy.shard_size": Range(1, why="ranks per shard group; null: the ranks of one node"),
    "strategy.tp": Range(1, why="tensor-parallel ranks per data-parallel rank; 1: no tensor parallel"),
    "ac.n": SIZE,
    "ac.offload_flops_per_byte": Range(0, lo_open=True),
    "optim.lr": Range(0, lo_open=True),
    "optim.weight_decay": Range(0),
    "optim.betas": DROPOUT,
    "optim.momentum": DROPOUT,
    "optim.warmup_steps": Range(0),
    "optim.min_lr_ratio": PROBABILITY,
    "logger.wandb_init_timeout": Range(0, 25, lo_open=True, why="the fallback to offline must come within 30 s"),
    "trainer.max_steps": SIZE,
    "trainer.grad_accum": SIZE,
    "trainer.clip_grad_norm": Range(0, why="0 turns clipping off"),
    "trainer.log_every": SIZE,
    "trainer.save_every": OFF_OR_EVERY,
    "trainer.keep_last": Range(0, why="0 keeps every checkpoint"),
    "trainer.eval_every": OFF_OR_EVERY,
    "trainer.seed": Range(0),
    "trainer.guard_every": OFF_OR_EVERY,
    "trainer.max_consecutive_skips": Range(0, why="0: no limit"),
    "trainer.task_weights": Range(0, why="a task's weight in the loss; 0 leaves it out"),
}
LENGTHS = {"optim.betas": 2}  # list fields of a fixed length


def _check_ranges(cfg: DictConfig) -> None:
    from launch.targets import LAUNCHER_KEYS

    for key, allowed in RANGES.items():
        value = OmegaConf.select(cfg, key, default=None)
        if value is None:
            continue
        group, _, leaf = key.partition(".")
        if "_target_" in cfg.get(group, {}) and leaf not in LAUNCHER_KEYS.get(group, ()):
            continue  # model=custom / data=custom: the user's own argument (+data.n=...), checked by its target
        if isinstance(value, DictConfig):  # trainer.task_weights: each value
            value = ListConfig(list(value.values()))
        values = list(value) if isinstance(value, ListConfig) else [value]
        shown = f"[{','.join(map(str, values))}]" if isinstance(value, ListConfig) else value
        kind = "an integer" if all(isinstance(v, int) for v in values) else "a number"
        if key in LENGTHS and len(values) != LENGTHS[key]:
            raise ConfigError(
                f"{key}={shown} needs {LENGTHS[key]} values, each {allowed}; fix the override {key}=[...]."
            )
        if any(v not in allowed for v in values):
            what = "each value" if isinstance(value, ListConfig) else "it"
            why = f" ({allowed.why})" if allowed.why else ""
            raise ConfigError(
                f"{key}={shown} is out of range: {what} must be {kind} {allowed}{why}; fix the override {key}=..."
            )


def _validate_compile(strategy: DictConfig) -> None:
    backend = strategy.get("compile")
    if backend is None:
        return
    import torch

    known = torch.compiler.list_backends(exclude_tags=())
    if backend not in known:
        raise ConfigError(
            f"strategy.compile={backend!r} is not a torch.compile backend; use one of {', '.join(sorted(known))} "
            "(inductor is torch.compile's default), or strategy.compile=null for no compile."
        )


def validate(cfg: DictConfig, world_size: int = 1) -> None:
    """Check values and combinations of a composed config before anything is built or written.

    Every numeric field against its range (:data:`RANGES`), the choices, the combinations, the
    optional packages the config needs, and the ``ac`` group against the model itself (built on
    the meta device: no memory, no compute).

    Args:
        cfg: the composed config.
        world_size: the number of processes of the job (``WORLD_SIZE``).

    Raises:
        ConfigError: naming the override to fix and what it allows.
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
    _check_ranges(cfg)
    _check_combinations(cfg, world_size)
    check_extras(cfg)
    check_model(cfg, world_size)


def _check_combinations(cfg: DictConfig, world_size: int) -> None:
    t, s, d, m = cfg.trainer, cfg.strategy.name, cfg.data, cfg.model
    if s == "none" and world_size > 1:
        raise ConfigError(
            f"strategy=none with {world_size} processes would train {world_size} unrelated "
            "copies; use strategy=ddp (or fsdp, fsdp2), or run one process."
        )
    if d.batch_size % (world_size * t.grad_accum):
        raise ConfigError(
            f"data.batch_size={d.batch_size} must be a multiple of {world_size} ranks x "
            f"trainer.grad_accum={t.grad_accum}; change data.batch_size or trainer.grad_accum."
        )
    if m.name == "hf" and m.pretrained:
        from launch.hf import check_pretrained, check_pretrained_sizes

        check_pretrained(m.pretrained)
        if _importable("transformers"):  # else check_extras names the extra
            check_pretrained_sizes(m)
    if d.name == "multitask":
        total = sum(task.weight for task in d.tasks.values())
        for name, task in d.tasks.items():
            share = d.batch_size * task.weight / total
            if share != int(share) or share % (world_size * t.grad_accum):
                raise ConfigError(
                    f"data.tasks.{name}: weight {task.weight} gives {share:g} of data.batch_size="
                    f"{d.batch_size} samples, not a multiple of {world_size} ranks x trainer.grad_accum="
                    f"{t.grad_accum}; change data.batch_size or the task weights."
                )
    if d.name == "tokens":
        if d.dtype not in ("uint16", "uint32"):
            raise ConfigError(f"data.dtype={d.dtype!r} is not one of uint16, uint32.")
        for key in ("path", "eval_path"):
            if d[key] is not None and not Path(d[key]).is_file():
                raise ConfigError(f"data.{key}={d[key]} is not a file; write one with scripts/make_tokens.py.")
        if "seq_len" not in m:
            raise ConfigError(
                f"data=tokens cuts the file into model.seq_len windows: model={m.name} has no "
                "seq_len (add +model.seq_len=N)."
            )
    if d.name == "hf":
        from launch.hf_data import check_source

        for key in ("path", "eval_path"):
            if d[key] is not None:
                check_source(d[key])
        if "seq_len" not in m:
            raise ConfigError(
                f"data=hf packs text into model.seq_len windows: model={m.name} has no seq_len (add +model.seq_len=N)."
            )
        if not d.tokenizer and not (m.name == "hf" and m.get("pretrained")):
            raise ConfigError(
                "data=hf needs a tokenizer: data.tokenizer=DIR (a directory written by save_pretrained), or "
                "model=hf model.pretrained=DIR, whose tokenizer is the default."
            )
    if d.name == "digits" and m.name not in ("mlp", "custom"):
        raise ConfigError(f"data=digits is image features: it needs model=mlp (got model={m.name}).")
    if cfg.precision.dtype == "fp16" and not cfg.precision.grad_scaler:
        raise ConfigError(
            "precision.dtype=fp16 without a grad scaler underflows; use precision=fp16 "
            "(which sets precision.grad_scaler=true) or precision=bf16."
        )
    layout = layout_of(cfg.strategy, world_size)
    if cfg.precision.sharded and not layout.sharded:
        raise ConfigError(
            f"precision.sharded=true needs strategy=fsdp, fsdp2 or hsdp (got strategy={s}); "
            "use precision=bf16 (autocast) instead."
        )
    _validate_compile(cfg.strategy)
    try:  # the library's own rule for these settings, so --check and parallelize agree
        check_run(s, reentrant=cfg.ac.reentrant, graph=cfg.strategy.graph, accumulate=t.grad_accum > 1)
    except ConfigError as e:
        raise ConfigError(
            f"strategy={s} strategy.graph={cfg.strategy.graph} ac.reentrant={cfg.ac.reentrant} "
            f"trainer.grad_accum={t.grad_accum}: {e}"
        ) from None
    if "n_head" in m and m.d_model % m.n_head:
        raise ConfigError(f"model.d_model={m.d_model} must be divisible by model.n_head={m.n_head}.")
    if m.get("kv_heads") is not None and m.n_head % m.kv_heads:
        raise ConfigError(
            f"model.n_head={m.n_head} must be divisible by model.kv_heads={m.kv_heads} (each key/value "
            "head serves n_head / kv_heads query heads)."
        )


# Optional packages: (the override that needs it, when, the module, the pyproject extra that installs it).
EXTRAS: list[tuple[str, Callable[[DictConfig], bool], str, str]] = [
    ("model=hf", lambda c: c.model.name == "hf", "transformers", "hf"),
    ("data=hf", lambda c: c.data.name == "hf", "datasets", "hf"),
    ("data=hf", lambda c: c.data.name == "hf", "transformers", "hf"),
    ("data=digits", lambda c: c.data.name == "digits", "sklearn", "launch"),
    ("logger.tensorboard=true", lambda c: bool(c.logger.tensorboard), "tensorboard", "launch"),
    ("logger.wandb=online/offline", lambda c: c.logger.wandb in ("online", "offline"), "wandb", "launch"),
]


def check_extras(cfg: DictConfig) -> None:
    """Raise ConfigError naming the extra to install when the config needs a package that is missing."""
    for override, needed, module, extra in EXTRAS:
        if needed(cfg) and not _importable(module):
            raise ConfigError(
                f"{override} needs the {module} package, which is not installed: "
                f"pip install -e '.[{extra}]' (from the checkout)."
            )


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a module with no spec
        return False


# The models check_model builds on the meta device: the built-in ones, from their config alone.
META_BUILDABLE = ("gpt", "mlp", "hf")


def _meta_buildable(m: DictConfig) -> bool:
    return m.name in META_BUILDABLE and not m.get("pretrained")  # from_pretrained reads a checkpoint


def check_model(cfg: DictConfig, world_size: int = 1) -> None:
    """Build the ``ac`` group's arguments (:func:`launch.ac.wrap_args`, as training does); build a built-in
    model (:data:`META_BUILDABLE`) on the meta device and wrap it with them, as training will.

    Raises:
        ConfigError: a bad ``ac.policy``/``ac.size``/``ac.blocks``, or a model that cannot be built.
    """
    import torch

    import distckpt
    from distckpt.select import Budget
    from launch.ac import wrap_args
    from launch.build import build_model

    c = cfg.ac
    args = wrap_args(cfg, world_size)
    policy = args.policy
    cuda = cfg.trainer.device == "cuda" or (cfg.trainer.device == "auto" and torch.cuda.is_available())
    if isinstance(policy, Budget) and policy.bytes is None and not cuda:
        raise ConfigError(
            f"ac.policy={c.policy}: budget:auto uses the free CUDA memory, and this run has no CUDA "
            f"device (trainer.device={cfg.trainer.device}); give a size, e.g. ac.size=2GiB."
        )
    if not _meta_buildable(cfg.model):
        return  # a user's model may read files or weights in __init__: wrap checks it at start
    try:
        with torch.device("meta"):
            model = build_model(cfg.model, cfg.data)
    except ConfigError as e:  # a size this model type has no field for (model.kv_heads under gpt2)
        raise ConfigError(f"model={cfg.model.name}: {e}") from None
    except (ValueError, TypeError, KeyError, RuntimeError) as e:  # e.g. a model type transformers lacks
        text = str(e).strip().splitlines()[0] if str(e).strip() else ""
        text = text if len(text) <= 160 else text[:160].rsplit(" ", 1)[0] + " ..."  # HF lists every model type
        raise ConfigError(
            f"model={cfg.model.name} cannot be built from these model.* values: {type(e).__name__}: {text}"
        ) from None
    _check_tp_plan(cfg, model)
    blocks = list(args.blocks) if args.blocks else None
    try:  # policy None (ac=none) too: ac.blocks must match the model whatever the policy
        distckpt.wrap(model, policy, blocks=blocks, reentrant=args.reentrant, offload=args.offload)
    except ConfigError as e:
        where = f"ac.blocks=[{','.join(blocks)}]" if blocks else f"model={cfg.model.name} ac.policy={c.policy}"
        raise ConfigError(f"{where}: {e}" + ("" if blocks else " In the launcher: ac.blocks=[GLOB,...].")) from None


def _check_tp_plan(cfg: DictConfig, model: Any) -> None:
    """``strategy.tp`` > 1: the model has the tensor-parallel plan training will apply (Llama-style attention and MLP
    linears in its blocks) and the tp divides its heads and widths (the model on the meta device)."""
    tp = int(cfg.strategy.get("tp", 1))
    if tp == 1:
        return
    from distckpt.select.blocks import find_blocks
    from distckpt.select.tp_shapes import check_heads, tp_roles

    try:
        found = find_blocks(model, None)
        check_heads(model, found, tp_roles(found), tp)
    except ConfigError as e:
        raise ConfigError(f"strategy.tp={tp} with model={cfg.model.name}: {e}") from None
