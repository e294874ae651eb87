"""Builders: turn each config group into the flat arguments of a library call (torchtune style)."""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import Dataset, IterableDataset

from distckpt.errors import ConfigError
from distckpt.layout import Layout, default_shard_size
from distckpt.options import Engine, check_tp
from distckpt.parallel import fsdp1
from distckpt.train.data import (
    DIGITS_FEATURES,
    ShardedLoader,
    TaskMixLoader,
    TokenWindows,
    digits,
    synthetic_mlp,
    synthetic_tokens,
)
from distckpt.train.models import MultiTaskGPT, MultiTaskMLP
from launch.targets import instantiate_target

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build_model(m: DictConfig, d: DictConfig) -> nn.Module:
    """The model of ``model=...`` (its input size follows ``data=digits`` when chosen).

    Raises:
        ConfigError: ``model=custom`` with a ``_target_`` that cannot be built (see ``launch/targets.py``).
    """
    if m.name == "custom":
        return instantiate_target(
            m, "model", (nn.Module,), "an nn.Module whose forward(batch) returns a dict of named scalar losses"
        )
    if m.name == "gpt":
        return MultiTaskGPT(
            vocab_size=m.vocab_size,
            seq_len=m.seq_len,
            d_model=m.d_model,
            n_layer=m.n_layer,
            n_head=m.n_head,
            n_classes=m.n_classes,
            dropout=m.dropout,
        )
    if m.name == "mlp":
        in_features = DIGITS_FEATURES if d.name == "digits" else m.in_features
        return MultiTaskMLP(
            in_features=in_features, hidden=m.hidden, n_layer=m.n_layer, n_classes_a=m.n_classes_a, dropout=m.dropout
        )
    from launch.hf import build_hf  # transformers/peft: the "hf" extra

    return build_hf(m)


def layout_of(strategy: DictConfig, world_size: int) -> Layout:
    """The run's parallel layout from the ``strategy`` group, checked: the one place the launcher reads
    ``strategy.name``, ``strategy.shard_size`` (``hsdp``; null: ``LOCAL_WORLD_SIZE``, the ranks of one node, and
    before torchrun sets it the whole job: one node) and ``strategy.compile`` (each block compiled with that
    backend). Validation, training, the doctor and ``plan`` all build it here.

    Raises:
        ConfigError: naming the override to fix.
    """
    shard = strategy.shard_size
    if strategy.name == "hsdp" and shard is None:
        shard = default_shard_size(fallback=world_size)
    backend = strategy.get("compile")
    tp = int(strategy.get("tp", 1))
    try:
        check_tp(tp, strategy.name, world_size)
    except ConfigError as e:
        raise ConfigError(f"strategy={strategy.name} strategy.tp={tp}: {e} Fix the override strategy.tp=N.") from None
    try:
        return Layout.of(
            strategy.name,
            world_size=world_size // tp if strategy.name != "none" else 1,
            shard_size=None if shard is None else int(shard),
            compile=None if backend is None else {"backend": backend},
            tp=tp,
        )
    except ConfigError as e:
        raise ConfigError(
            f"strategy={strategy.name} strategy.shard_size={strategy.shard_size}: {e} Fix the override "
            "strategy.shard_size=N (the ranks per node), or remove it."
        ) from None


def build_datasets(d: DictConfig, m: DictConfig) -> tuple[Any, Any]:
    """The train and eval data sets of ``data=...`` (eval ``None`` when there is none), shaped for ``model=...``.

    Raises:
        ConfigError: ``data=custom`` with a ``_target_`` that cannot be built (see ``launch/targets.py``).
    """
    if d.name == "custom":
        what = "a torch.utils.data.Dataset of dicts of tensors or an IterableDataset"
        train_set = instantiate_target(d, "data", (Dataset, IterableDataset), what)
        eval_over = OmegaConf.to_container(d.eval, resolve=True) if d.get("eval") else None
        return train_set, instantiate_target(
            d, "data", (Dataset, IterableDataset), what, **eval_over
        ) if eval_over else None
    if d.name == "tokens":
        vocab = m.get("vocab_size")  # with model.pretrained: the pretrained vocabulary (conf/model/hf.yaml)
        fixed = f"model.pretrained={m.pretrained}" if m.get("pretrained") else None

        def windows(path: str) -> TokenWindows:
            return TokenWindows(path, m.seq_len, d.dtype, vocab_size=vocab, vocab_of=fixed)

        return windows(d.path), windows(d.eval_path) if d.eval_path else None
    if d.name == "hf":
        from launch.hf_data import build_hf_data  # datasets/transformers: the "hf" extra

        return build_hf_data(d, m)
    if d.name == "digits":
        return digits("train", d.n_eval), digits("eval", d.n_eval) if d.n_eval else None
    if m.name == "mlp":

        def make(n: int, seed: int) -> Any:
            return synthetic_mlp(n, m.in_features, m.n_classes_a, seed=seed)
    else:

        def make(n: int, seed: int) -> Any:
            return synthetic_tokens(n, m.seq_len, m.vocab_size, m.n_classes, seed=seed, noise=d.noise)

    # The eval split: other samples of the same task (another seed).
    return make(d.n, d.seed), make(d.n_eval, d.seed + 7919) if d.n_eval else None


def task_data(node: DictConfig) -> DictConfig:
    """A task's ``data`` node of ``data=multitask``, completed with its data group's defaults."""
    from launch.schema import DataConfig, HFDataConfig, TokensDataConfig

    schema = {"tokens": TokensDataConfig, "hf": HFDataConfig, "custom": None}.get(node.name, DataConfig)
    return node if schema is None else OmegaConf.merge(OmegaConf.structured(schema), node)


def build_data(
    d: DictConfig,
    m: DictConfig,
    device: torch.device | None = None,
    *,
    allow_reshuffle: bool = False,
    ranks: tuple[int, int] | None = None,
) -> ShardedLoader | TaskMixLoader:
    """This rank's loader for ``data=...``: sharded over the ranks, shuffled per epoch, resumable
    (``allow_reshuffle``: ``trainer.allow_reshuffle``, see :class:`~distckpt.train.data.ShardedLoader`).
    ``ranks``: ``(this rank's index, ranks)`` among those that read different data (the data-parallel ranks under
    tensor parallel: the tp ranks of one replica read the same batch); default: every rank."""
    where = {} if ranks is None else {"rank": ranks[0], "world_size": ranks[1]}
    pin = bool(d.pin_memory) and device is not None and device.type == "cuda"
    if d.name == "multitask":
        datasets = {t: build_datasets(task_data(task.data), m) for t, task in d.tasks.items()}
        return TaskMixLoader(
            datasets,
            {t: float(task.weight) for t, task in d.tasks.items()},
            d.batch_size,
            shuffle=d.shuffle,
            seed=d.seed,
            num_workers=d.num_workers,
            pin_memory=pin,
            drop_last=d.drop_last,
            allow_reshuffle=allow_reshuffle,
            **where,
        )
    train_set, eval_set = build_datasets(d, m)
    return ShardedLoader(
        train_set,
        d.batch_size,
        shuffle=d.shuffle,
        seed=d.seed,
        num_workers=d.num_workers,
        pin_memory=pin,
        drop_last=d.drop_last,
        eval_dataset=eval_set,
        allow_reshuffle=allow_reshuffle,
        **where,
    )


class WarmupDecay:
    """LR multiplier: linear warmup, then constant, cosine or linear decay to ``min_ratio``.

    A callable object (not a lambda) so that ``LambdaLR.state_dict`` saves it and checkpoints resume it.
    """

    def __init__(self, kind: str, warmup: int, total: int, min_ratio: float) -> None:
        self.kind, self.warmup, self.total, self.min_ratio = kind, warmup, total, min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        if self.kind == "constant":
            return 1.0
        frac = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        decay = 0.5 * (1 + math.cos(math.pi * frac)) if self.kind == "cosine" else 1 - frac
        return self.min_ratio + (1 - self.min_ratio) * decay


def build_optimizer(o: DictConfig, model: nn.Module, max_steps: int) -> tuple[torch.optim.Optimizer, Any]:
    """The optimizer and LR scheduler of ``optim=...``."""
    params = [p for p in model.parameters() if p.requires_grad]
    if o.name == "adamw":
        opt: torch.optim.Optimizer = torch.optim.AdamW(
            params, lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay
        )
    else:
        opt = torch.optim.SGD(params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, WarmupDecay(o.scheduler, o.warmup_steps, max_steps, o.min_lr_ratio))
    return opt, sched


def tensor_parallel_mesh(layout: Layout, device: torch.device) -> Any:
    """The ``("dp", "tp")`` mesh of ``strategy.tp`` > 1, or None."""
    if layout.tp == 1:
        return None
    from distckpt.parallel.mesh import build_mesh

    return build_mesh(layout, device.type)


def apply_tensor_parallel(model: nn.Module, mesh: Any) -> None:
    """Tensor parallel on the model's blocks over ``mesh["tp"]`` (the first step of the order: before
    checkpointing), with the torchtitan-style plan of :func:`distckpt.parallel.tp.transformer_plan`."""
    if mesh is None:
        return
    from distckpt.parallel.tp import apply_tp
    from distckpt.select.blocks import find_blocks

    apply_tp(model, mesh["tp"], find_blocks(model, None))


def parallel_kwargs(p: DictConfig, layout: Layout) -> dict[str, Any]:
    """Extra arguments for ``distckpt.parallelize``: FSDP's own mixed precision when ``precision.sharded``."""
    if not p.sharded or p.dtype == "fp32":
        return {}
    dtype = _DTYPES[p.dtype]
    if layout.engine is Engine.FSDP1:
        return fsdp1.mixed_precision_kwargs(dtype)
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return {"mp_policy": MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)}


def autocast_factory(p: DictConfig, device: torch.device) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """A context factory for the forward: autocast for bf16/fp16 (unless FSDP casts the params itself)."""
    if p.dtype == "fp32" or p.sharded:
        return contextlib.nullcontext
    return functools.partial(torch.autocast, device_type=device.type, dtype=_DTYPES[p.dtype])


def build_scaler(p: DictConfig, layout: Layout, device: torch.device) -> Any:
    """A grad scaler for fp16 (the sharded one under FSDP/FSDP2), else ``None``."""
    if not p.grad_scaler:
        return None
    if layout.sharded:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device=device.type)
    return torch.amp.GradScaler(device.type)


def clip_fn(model: nn.Module, layout: Layout) -> Callable[[float], torch.Tensor]:
    """``clip(max_norm) -> total norm`` over all ranks: FSDP1 shards flat params and needs its own method; under
    tensor parallel the gradients live on two meshes (FSDP2's "dp" for the replicated parameters, ("dp", "tp") for
    the tensor-parallel ones), which one ``clip_grad_norm_`` cannot stack: each mesh's norm is taken apart."""
    if layout.engine is Engine.FSDP1:
        return functools.partial(fsdp1.clip_grad_norm, model)
    if layout.tp > 1:
        return functools.partial(_clip_by_mesh, model)

    def clip(max_norm: float) -> torch.Tensor:
        norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], max_norm)
        # FSDP2 returns a DTensor; the loop wants a plain number that is the same on every rank.
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    return clip


def _clip_by_mesh(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip gradients held as DTensors on several meshes: the total norm from each mesh's own (a collective over it,
    in parameter order on every rank), then every gradient scaled by one factor."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for p in model.parameters():
        if p.grad is not None:
            groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p.grad)
    norms = []
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads)
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    total = torch.stack([n.float() for n in norms]).norm() if norms else torch.zeros(())
    coef = min(1.0, max_norm / (float(total) + 1e-6))
    if coef < 1.0:
        for grads in groups.values():
            for g in grads:
                g.mul_(coef)
    return total
