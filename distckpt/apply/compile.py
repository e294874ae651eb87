"""Per-block ``torch.compile``, as torchtitan compiles each transformer block: after checkpointing, before
sharding, every block ``wrap`` chose among (checkpointed or not), with names, hooks and ``state_dict`` keys unchanged.

Why not ``torch.compile(block)`` registered in place of the block (torchtitan's way): that inserts ``_orig_mod.``
into every name below it. Why not ``block.compile()``: it compiles the module's ``__call__``, so the forward hooks of
FSDP2 and of distckpt's zero-weight join would be traced too. Here only what runs *inside* the block is compiled:

- a checkpointed block whose checkpointing dynamo traces faithfully (full, selective, pointwise): the checkpoint
  and the forward, as one graph (the compiler sees what it recomputes);
- a checkpointed block whose checkpointing it cannot trace (``distckpt.runtime.recompute.eager_reason``:
  BatchNorm statistics, ``reentrant=True``, offload): its forward, inside an eager checkpoint;
- a block that is not checkpointed: its forward (an instance ``forward`` that calls the compiled one).

The compiled functions take the block as an argument and are shared by every block (one graph per block class
and input shapes, not one per block), so a deep copy of the model calls them with its own blocks.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn

from distckpt import _torch_compat as compat
from distckpt.apply.state import candidate_blocks, pending_plan
from distckpt.apply.wrap import parallel_kind
from distckpt.errors import ConfigError
from distckpt.layout import CompileOptions, compile_options
from distckpt.runtime.recompute import run_checkpointed
from distckpt.runtime.swap import _COMPILE, _COMPILED, _clean_fqn, is_checkpointed

__all__ = ["CompileOptions", "apply_compile", "compile_blocks", "compile_options", "compiled_blocks", "uncompiled"]


def _forward(block: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The block's own forward (its class's, under distckpt's and FSDP2's class swaps)."""
    cls = type(block)
    return getattr(cls, "_distckpt_orig_class", cls).forward(block, *args, **kwargs)


def _traced(block: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The block's checkpoint and its forward, for dynamo to trace as one graph."""
    return run_checkpointed(block, functools.partial(_forward, block), block._distckpt_options, args, kwargs)


@functools.cache
def _compiled(options: CompileOptions) -> tuple[Callable[..., Any], Callable[..., Any]]:
    kw = options.kwargs()
    return torch.compile(_traced, **kw), torch.compile(_forward, **kw)


class CompiledBlock:
    """What a compiled block holds (``block.__dict__``): its options; the compiled functions are looked up from
    them, so the block pickles and deep-copies (the copy's calls pass the copy)."""

    __slots__ = ("options",)

    def __init__(self, options: CompileOptions) -> None:
        self.options = options

    def __reduce__(self) -> Any:
        return (CompiledBlock, (self.options,))

    def traced(self, block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Checkpoint and forward, compiled together. A Python side effect in the forward (a counter; transformers'
        kernel context variable) runs once per forward, as without checkpointing: the recompute does not replay it."""
        with compat.forward_side_effects_once():
            return self._call(_compiled(self.options)[0], block, args, kwargs)

    def forward(self, block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The block's forward, compiled."""
        return self._call(_compiled(self.options)[1], block, args, kwargs)

    def inner(self, block: nn.Module) -> Callable[..., Any]:
        """The compiled forward as the function an eager checkpoint runs."""
        return lambda *args, **kwargs: self.forward(block, args, kwargs)

    def _call(self, fn: Callable[..., Any], block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        try:
            return fn(block, *args, **kwargs)
        except compat.dynamo_trace_errors() as e:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(
                f"torch.compile(fullgraph={self.options.fullgraph}) cannot trace {_class_name(block)} in one graph "
                f"({reason}). Make its forward traceable, or pass compile={{'fullgraph': False}} (or "
                "compile_blocks(..., fullgraph=False)) to let dynamo run the untraceable parts eagerly between graphs."
            ) from e


def _class_name(block: nn.Module) -> str:
    """The user's class of ``block``, under distckpt's and FSDP2's class swaps."""
    from torch.distributed.fsdp import FSDPModule

    cls = getattr(type(block), "_distckpt_orig_class", type(block))
    return next(c for c in cls.__mro__ if not issubclass(c, FSDPModule)).__name__


def _plain_forward(compiled: CompiledBlock, block: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The instance ``forward`` of a compiled block that is not checkpointed."""
    return compiled.forward(block, args, kwargs)


class _ModelCompile:
    """The model's record (``model.__dict__``): which options its blocks are compiled with, applied again when
    ``wrap`` or a budget's plan changes how the blocks are checkpointed."""

    def __init__(self, options: CompileOptions) -> None:
        self.options = options
        self.block = CompiledBlock(options)

    def apply(self, model: nn.Module) -> None:
        self.remove(model)
        if pending_plan(model):
            return  # a budget still to be planned at the first forward: its plan compiles the blocks it chose
        for name, block in candidate_blocks(model):
            if "forward" in vars(block):
                raise ConfigError(
                    f"{name} has a forward set on the instance (by accelerate hooks or a monkey patch); distckpt "
                    "cannot compile it without bypassing that forward. Remove the patch first."
                )
            block.__dict__[_COMPILED] = self.block
            if not is_checkpointed(block):
                block.__dict__["forward"] = functools.partial(_plain_forward, self.block, block)

    def remove(self, model: nn.Module) -> None:
        for m in model.modules():
            m.__dict__.pop(_COMPILED, None)
            fwd = m.__dict__.get("forward")
            if isinstance(fwd, functools.partial) and fwd.func is _plain_forward:
                del m.__dict__["forward"]


def compile_blocks(
    model: nn.Module,
    *,
    backend: str = "inductor",
    fullgraph: bool = True,
    dynamic: bool | None = None,
    mode: str | None = None,
    options: dict[str, Any] | None = None,
) -> nn.Module:
    """Compile each block of ``model`` with ``torch.compile``, in place: the blocks ``distckpt.wrap`` chose among,
    checkpointed or not (or, without ``wrap``, the repeated blocks it would find).

    Call it after ``wrap`` and before DDP/FSDP, as ``parallelize(..., compile=...)`` does. Parameter names, hooks
    and ``state_dict`` keys do not change. A later ``wrap`` (or a budget planned at the first forward) compiles the
    blocks again in their new checkpoint modes. The module docstring says what is compiled for each kind of block.

    Args:
        model: the model (not wrapped in DDP/FSDP yet).
        backend, fullgraph, dynamic, mode, options: as ``torch.compile``'s, for every block. ``fullgraph=True``
            (default): a block that cannot be traced in one graph raises ConfigError at its first forward.

    Returns:
        ``model``.

    Raises:
        ConfigError: a model already in DDP/FSDP, no blocks found, or a block with a forward set on the instance.
    """
    opts = compile_options(
        {"backend": backend, "fullgraph": fullgraph, "dynamic": dynamic, "mode": mode, "options": options}
    )
    return apply_compile(model, opts)


def apply_compile(model: nn.Module, options: CompileOptions) -> nn.Module:
    """:func:`compile_blocks` with its arguments as one :class:`CompileOptions` (what ``parallelize`` calls).

    Raises:
        ConfigError: as :func:`compile_blocks`.
    """
    kind = parallel_kind(model)
    if kind:
        raise ConfigError(
            f"distckpt compile_blocks got a model already wrapped in {kind}. Compile the blocks before sharding: "
            "pass compile=True (or a dict of torch.compile arguments) to distckpt.parallelize."
        )
    if not candidate_blocks(model):
        raise ConfigError(
            f"found no blocks to compile in {type(model).__name__}: call distckpt.wrap(model, policy, blocks=...) "
            "first (policy 'none' compiles them without checkpointing), or torch.compile the whole model."
        )
    try:
        _compiled(options)  # torch.compile checks its arguments here, not at the first forward
    except (RuntimeError, TypeError, ValueError) as e:
        raise ConfigError(f"compile options {options.kwargs()} are not valid for torch.compile: {e}") from e
    record = _ModelCompile(options)
    model.__dict__[_COMPILE] = record
    record.apply(model)
    return model


@contextlib.contextmanager
def uncompiled(model: nn.Module) -> Iterator[None]:
    """Inside, the blocks of ``model`` run uncompiled (``verify_recompute`` records each op of a block's forward and
    of its recompute through hooks that dynamo cannot trace, and what it checks is the checkpointing)."""
    # The model compile_blocks saw: ``model`` itself, or the module inside a DDP/FSDP wrapper.
    owner = next((m for m in model.modules() if _COMPILE in m.__dict__), None)
    if owner is None:
        yield
        return
    record = owner.__dict__[_COMPILE]
    record.remove(owner)
    try:
        yield
    finally:
        record.apply(owner)


def compiled_blocks(model: nn.Module) -> list[str]:
    """FQNs of the blocks ``compile_blocks`` compiled, in registration order (as in the user's model)."""
    return [_clean_fqn(n) for n, m in model.named_modules() if _COMPILED in m.__dict__]
