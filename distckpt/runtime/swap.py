"""The class swap that makes a block checkpointed, and its undo: a checkpointed block keeps its object, its
class (as a base class) and its FQN; its class is swapped for a memoized subclass whose ``forward`` runs the
original one under ``torch.utils.checkpoint`` (:mod:`distckpt.runtime.recompute`). Module hooks (FSDP's
unshard/reshard, DDP's) stay outside the checkpointed region, which is the order FSDP needs (pytorch#82203).
The same trick is how FSDP2's ``fully_shard`` adds its own behaviour, and the two compose. Which blocks get
it is chosen above (:mod:`distckpt.apply.wrap`); the planner's sample steps use it too.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn

from distckpt.errors import ConfigError
from distckpt.runtime.recompute import (
    EAGER_RUN,
    CheckpointOptions,
    eager_reason,
    prepare_eager_run,
    run_checkpointed,
    without_cache,
)
from distckpt.runtime.routing import replays, routes
from distckpt.runtime.selective import KEEP_MODE, context_mode

__all__ = [
    "CHECKPOINT_MODES",
    "checkpoint_mode",
    "checkpointed",
    "checkpointing_disabled",
    "is_checkpointed",
    "unwrap",
]

# How a block can be checkpointed, in order of decreasing memory (a budget plan chooses one per block);
# "offload" (appended, so the earlier codes stay): not recomputed, every tensor its forward saves kept in
# host memory until its backward (on CUDA; on the CPU host memory is the step's own); "ops" (appended too):
# the outputs of the op calls a KeepOps names kept, everything else recomputed (a per-op choice).
CHECKPOINT_MODES = ("none", "pointwise", "selective", "full", "offload", KEEP_MODE)

# Prefixes that wrappers insert into FQNs; checkpointed() reports names as in the user's model.
_WRAPPER_NAMES = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")

# Keys of per-block compile (distckpt.apply.compile): the model's record of its options, a block's compiled state.
_COMPILE = "_distckpt_compile"
_COMPILED = "_distckpt_compiled"


class _CheckpointedMixin:
    """Base inserted in front of a block's class; see the module docstring."""

    _distckpt_options: CheckpointOptions
    _distckpt_norms: list[nn.Module]  # BatchNorm-like modules whose running stats the recompute must not touch
    _distckpt_cache_slots: tuple[tuple[int, str], ...] = ()  # positional cache arguments of forward
    _distckpt_disabled: int = 0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        inner = super().forward  # type: ignore[misc]
        compiled = self.__dict__.get(_COMPILED)  # set by distckpt.apply.compile.compile_blocks
        compiling = torch.compiler.is_compiling()  # inside a compiled model (or a compiled block: not here)
        if self._distckpt_disabled or not torch.is_grad_enabled():
            # Nothing is saved for backward without grad (eval, inference): run the block as is,
            # a KV cache included.
            return (
                compiled.forward(self, args, kwargs)
                if compiled is not None and not compiling
                else inner(*args, **kwargs)
            )
        args, kwargs = without_cache(self, args, kwargs)
        opts = self._distckpt_options
        if compiling:
            if eager_reason(self):
                # Checkpointing dynamo cannot trace faithfully runs eagerly (a graph break, with one warning).
                return EAGER_RUN[0](self, inner, opts, args, kwargs)
            return run_checkpointed(self, inner, opts, args, kwargs)
        if compiled is not None:
            if eager_reason(self):
                # Compiled forward only, in an eager checkpoint; eager too while routing replay may be needed.
                if replays(self):
                    _warn_eager_for_replay(self)
                    return run_checkpointed(self, inner, opts, args, kwargs)
                return run_checkpointed(self, compiled.inner(self), opts, args, kwargs)
            return compiled.traced(self, args, kwargs)  # checkpoint and forward in one graph
        return run_checkpointed(self, inner, opts, args, kwargs)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # The checkpointed class is made at run time, so pickle cannot find it by name: pickle the
        # object as the user's class and swap the class again on load (torch.save(model), deepcopy).
        cls = type(self)
        self.__class__ = self._distckpt_orig_class
        try:
            rv = self.__reduce_ex__(protocol)
        finally:
            self.__class__ = cls
        return (_rebuild_checkpointed, (rv[0], rv[1]), *rv[2:])


_WARNED_REPLAY: set[type] = set()


def _warn_eager_for_replay(block: nn.Module) -> None:
    """A compiled block whose checkpoint runs eagerly (``eager_reason``) runs its forward eagerly where routing
    replay needs it: replay's dispatch mode must see the routing ops, and torch.compile runs no compiled frame under
    such a mode. Until the block's first forward tells whether it routes; for good, with one warning, if it does."""
    if routes(block) and type(block) not in _WARNED_REPLAY:
        _WARNED_REPLAY.add(type(block))
        warnings.warn(
            f"distckpt: the checkpointed {block._distckpt_orig_class.__name__} blocks route tokens (topk, sort, "
            f"argmax) and their checkpoint runs eagerly ({eager_reason(block)}), so their forward runs eagerly too: "
            "routing replay must see the routing ops. To compile them, remove that reason (reentrant=False, no "
            "offload).",
            stacklevel=3,
        )


def _rebuild_checkpointed(constructor: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    obj = constructor(*args)
    obj.__class__ = _checkpointed_class(type(obj))
    prepare_eager_run()  # its state (BatchNorm list included) is set after this returns
    return obj


_CLASSES: dict[type, type] = {}  # memo: original class -> checkpointed subclass (FSDP2 does the same)


def _checkpointed_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Checkpointed{cls.__name__}", (_CheckpointedMixin, cls), {"_distckpt_orig_class": cls})
    return _CLASSES[cls]


def is_checkpointed(module: nn.Module) -> bool:
    """Whether distckpt checkpoints this module's forward."""
    return isinstance(module, _CheckpointedMixin)


def _clean_fqn(name: str) -> str:
    parts = [p for p in name.split(".") if p not in _WRAPPER_NAMES]
    if parts and parts[0] == "module":  # DDP's root
        parts = parts[1:]
    return ".".join(parts)


def checkpoint_mode(module: nn.Module) -> str:
    """``"full"``, ``"selective"``, ``"pointwise"`` or ``"ops"`` (op-level; see
    :func:`distckpt.runtime.selective.context_mode`), ``"offload"`` (not recomputed: its saved tensors
    kept in host memory) or ``"none"``: how distckpt checkpoints ``module``."""
    if not is_checkpointed(module):
        return "none"
    opts = module._distckpt_options
    if not opts.recompute:
        return "offload"
    return context_mode(opts.context_fn) if opts.context_fn else "full"


def checkpointed(model: nn.Module, *, modes: bool = False) -> list[str] | dict[str, str]:
    """FQNs of the modules distckpt checkpoints, in registration order.

    Names are those of the unwrapped model: DDP's ``module.`` and FSDP's
    ``_fsdp_wrapped_module.`` prefixes are removed.

    Args:
        model: the model (possibly inside DDP/FSDP).
        modes: return ``{fqn: "full" | "selective" | "pointwise" | "ops" | "offload"}`` instead: how each block
            is checkpointed (a ``budget`` plan mixes them; ``"offload"``: not recomputed, listed because
            its forward runs through distckpt's wrapper too).
    """
    if modes:
        return {_clean_fqn(n): checkpoint_mode(m) for n, m in model.named_modules() if is_checkpointed(m)}
    return [_clean_fqn(n) for n, m in model.named_modules() if is_checkpointed(m)]


@contextlib.contextmanager
def checkpointing_disabled(model: nn.Module) -> Iterator[None]:
    """Run checkpointed blocks of ``model`` without checkpointing inside this context."""
    mods = [m for m in model.modules() if is_checkpointed(m)]
    for m in mods:
        m._distckpt_disabled = m._distckpt_disabled + 1
    try:
        yield
    finally:
        for m in mods:
            m._distckpt_disabled -= 1


def unwrap(model: nn.Module, modules: list[nn.Module] | None = None) -> int:
    """Remove distckpt checkpointing from ``modules`` (default: every module of ``model``).

    Returns:
        How many modules were unwrapped.
    """
    count = 0
    for m in model.modules() if modules is None else modules:
        if is_checkpointed(m):
            orig = m._distckpt_orig_class
            if type(m) is not _CLASSES.get(orig):
                raise ConfigError(
                    f"cannot remove checkpointing from {type(m).__name__}: another wrapper (FSDP2?) "
                    "was applied after distckpt.wrap. Call wrap before parallelize."
                )
            m.__class__ = orig
            del m._distckpt_options, m._distckpt_norms
            m.__dict__.pop("_distckpt_cache_slots", None)
            count += 1
    return count
