"""The run-time of one checkpointed block: ``torch.utils.checkpoint`` with what exactness needs
around it (no KV cache, BatchNorm running stats kept, the RNG state, a reentrant runner that never
drops gradients silently, offload of the saved block inputs), and of one offloaded block (the ``"offload"``
mode: not recomputed, every tensor its forward saves kept in host memory until its backward).
``distckpt.apply.wrap`` decides which blocks run through here (the class swap: ``distckpt.runtime.swap``)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.utils.checkpoint as tuc

from distckpt import _torch_compat as compat
from distckpt._log import notify
from distckpt.errors import ConfigError
from distckpt.runtime.routing import replay_wrapped, replaying
from distckpt.runtime.selective import bind

__all__ = [
    "EAGER_RUN",
    "CheckpointOptions",
    "PinnedHostStore",
    "cache_positions",
    "eager_reason",
    "host_store",
    "prepare_eager_run",
    "run_checkpointed",
    "stateful_norms",
    "without_cache",
]


@dataclass(frozen=True)
class CheckpointOptions:
    """How one block is checkpointed."""

    reentrant: bool = False
    preserve_rng_state: bool = True
    offload: str | None = None
    context_fn: Callable[[], tuple[Any, Any]] | None = None  # op-level (selective) contexts
    recompute: bool = True  # False: the "offload" mode (no checkpoint; saved tensors go to host memory)
    store: Any = None  # the host store of both offloads (None: host_store()); the profile passes a counting one


# Arguments through which a (Hugging Face) layer writes a KV cache. The recompute would write it a
# second time (wrong shapes with a padded batch, CheckpointError in encoder-decoders, extra memory),
# so a checkpointed layer runs without it, as HF's own GradientCheckpointingLayer does.
_CACHE_ARGS = ("past_key_values", "past_key_value", "cache", "layer_past")
_WARNED_CACHE: set[type] = set()


def cache_positions(cls: type) -> tuple[tuple[int, str], ...]:
    """Positional slots of ``use_cache`` and the cache arguments of ``cls.forward`` (GPT-2 passes
    its cache positionally)."""
    try:
        params = list(inspect.signature(cls.forward).parameters.values())[1:]  # without self
    except (TypeError, ValueError):  # pragma: no cover - a forward without a signature
        return ()
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    out = []
    for i, p in enumerate(params):
        if p.kind not in positional:
            break
        if p.name in (*_CACHE_ARGS, "use_cache"):
            out.append((i, p.name))
    return tuple(out)


def _cache_on(name: str, value: Any) -> bool:
    return bool(value) if name == "use_cache" else value is not None


def without_cache(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``use_cache=False`` and no cache object for a block about to be checkpointed (HF's
    ``_can_checkpoint_with_cache`` layers, which only read the cache, keep it)."""
    keep = getattr(module, "_can_checkpoint_with_cache", False)
    names = ("use_cache",) if keep else ("use_cache", *_CACHE_ARGS)
    changed = []
    slots = [(i, n) for i, n in module._distckpt_cache_slots if i < len(args) and n in names and _cache_on(n, args[i])]
    if slots:
        new_args = list(args)
        for i, name in slots:
            new_args[i] = False if name == "use_cache" else None
            changed.append(name)
        args = tuple(new_args)
    hits = [k for k in names if _cache_on(k, kwargs.get(k))]
    if hits:
        kwargs = {**kwargs, **{k: False if k == "use_cache" else None for k in hits}}
        changed += hits
    # Said on the first training forward of a block a plan checkpoints, not in a profile's sample steps (before,
    # the profile's forward took the one notice and silenced it: a budget's run never said it).
    if changed and type(module) not in _WARNED_CACHE and not module.__dict__.get("_distckpt_profiling"):
        _WARNED_CACHE.add(type(module))
        notify(
            f"distckpt: {module._distckpt_orig_class.__name__} is checkpointed, so in training it runs without a "
            f"KV cache, as with Hugging Face's gradient checkpointing ({', '.join(sorted(set(changed)))} ignored). "
            "Forwards under torch.no_grad() (generation) keep their cache.",
            stacklevel=3,
        )
    return args, kwargs


def stateful_norms(module: nn.Module) -> list[nn.Module]:
    return [m for m in module.modules() if isinstance(m, compat.norm_base_class()) and m.track_running_stats]


@contextlib.contextmanager
def _keep_running_stats(norms: list[nn.Module]) -> Iterator[None]:
    """Keep the recompute from updating BatchNorm running statistics a second time.

    The forward already updated them once; without this the recompute updates them again
    (pytorch#96136). The recompute runs on throw-away copies of the buffers: in training mode the
    normalization uses batch statistics, so outputs and gradients are unchanged, and the originals
    are never written in place (autograd may have saved them; a write would bump their version).
    """
    names = ("running_mean", "running_var", "num_batches_tracked")
    originals = [(m, {k: m._buffers[k] for k in names if m._buffers.get(k) is not None}) for m in norms]
    with torch.no_grad():
        for m, bufs in originals:
            for k, buf in bufs.items():
                m._buffers[k] = buf.clone()
    try:
        yield
    finally:
        for m, bufs in originals:
            m._buffers.update(bufs)


def _context_fn(opts: CheckpointOptions, module: nn.Module) -> Callable[[], tuple[Any, Any]]:
    own = bind(opts.context_fn, module)  # op-level: this block's own reach; full: torch's noop_context_fn
    if torch.compiler.is_compiling():
        return own  # routing replay there: bind marks the routing ops must-save
    return replay_wrapped(_with_norms(own, module), module)


def _with_norms(own: Callable[[], tuple[Any, Any]], module: nn.Module) -> Callable[[], tuple[Any, Any]]:
    norms = module._distckpt_norms
    if not norms:
        return own

    def context_fn() -> tuple[Any, Any]:
        fwd, rec = own()
        stack = contextlib.ExitStack()

        @contextlib.contextmanager
        def recompute() -> Iterator[None]:
            with stack:
                stack.enter_context(_keep_running_stats(norms))
                stack.enter_context(rec)
                yield

        return fwd, recompute()

    return context_fn


class PinnedHostStore:
    """Where both offloads (the ``"offload"`` mode, ``offload="cpu"``) keep what a block saves:
    page-locked host memory for a CUDA tensor (the copy out is ``non_blocking``: a later kernel that
    reuses the freed device block runs after it on the same stream, and the host copy is read only by
    the copy back, queued after it), and the tensor itself for one already in host memory (CPU tensors:
    a copy would double their memory). The strides are kept (``empty_like``), so a backward sees the
    layout its forward saved: the same kernels, bitwise the same gradients."""

    escapes_allocator = False  # on a CPU step host memory is the step's own memory: nothing to gain

    def to_host(self, t: torch.Tensor) -> Any:
        """What to keep for ``t``: ``t`` itself when it stays where it is."""
        if t.device.type == "cpu":
            return t
        pin = t.device.type == "cuda"
        host = torch.empty_like(t, device="cpu", pin_memory=pin)
        host.copy_(t, non_blocking=pin)
        return (t.device, host)

    def to_device(self, packed: Any) -> torch.Tensor:
        device, host = packed
        return host.to(device, non_blocking=host.is_pinned())


_PINNED = PinnedHostStore()


def host_store() -> Any:
    """The store both offloads use: :class:`PinnedHostStore`. The one seam tests replace
    (``monkeypatch.setattr(recompute, "host_store", ...)``) with a store whose host memory the CPU
    step's allocator does not see (tests/offload_store.py), to measure on the CPU what pinned memory
    is to a CUDA device: never changed by the library. A store has ``to_host(t)`` (returning ``t``
    itself to keep it), ``to_device(packed)`` and ``escapes_allocator`` (whether its host memory is
    outside the memory a step's peak counts: only then may a budget on the CPU offer offload)."""
    return _PINNED


def _static_storages(module: nn.Module) -> set[int]:
    # Under FSDP2 the block's parameters are the unsharded ones during its forward (their storage the
    # all-gather output, freed at reshard and gathered again for backward); under FSDP1 the views into
    # the unsharded flat parameter, whose storage is the registered flat parameter's.
    return {compat.storage_id(t) for t in (*module.parameters(), *module.buffers())}


class _HostCopy:
    """One host copy of a tensor an offloaded forward saved, shared by every saved tensor of that forward
    with its storage, offset, sizes, strides, dtype and version (an input used twice, a tensor two ops save:
    moved out once), and brought back once per backward as one device tensor for all of them."""

    __slots__ = ("store", "kept", "uses", "left", "back")

    def __init__(self, store: Any, kept: Any) -> None:
        self.store, self.kept = store, kept
        self.uses = self.left = 0  # saved tensors sharing it; those not yet unpacked in this backward
        self.back: torch.Tensor | None = None

    def to_device(self) -> torch.Tensor:
        back = self.back if self.back is not None else self.store.to_device(self.kept)
        self.left -= 1
        # Held for the other saved tensors until each is unpacked (as a step without offload holds the tensor
        # until its last use), then let go; a second backward of a retained graph brings it back again.
        self.back = back if self.left > 0 else None
        if self.left <= 0:
            self.left = self.uses
        return back


@contextlib.contextmanager
def _offload_hooks(module: nn.Module, store: Any) -> Iterator[None]:
    """Saved-tensor hooks that keep in ``store`` what is saved while they are on: every tensor an offloaded
    block's forward saves (the ``"offload"`` mode), or what checkpoint saves at a block's boundary (its
    inputs, ``offload="cpu"``). The one copy rule of both:

    - not copied: parameters and views of the block's parameters or buffers (a linear layer's weight, its
      transpose): they stay on the device for the optimizer anyway, so copying them each step only costs
      link time and host memory; and what the store keeps as is (a tensor already in host memory). That is
      where this differs from ``torch.autograd.graph.save_on_cpu``, which copies weights and CPU tensors too;
    - copied once per forward: a tensor saved again (same storage, offset, sizes, strides, dtype and
      version) shares the first copy, and both get the same device tensor back.

    The memo of that forward holds weak references to the device tensors only (a strong one would keep
    them on the device) and is dropped when the forward ends; the copies live as long as the graph."""
    static = _static_storages(module)
    memo: dict[tuple[Any, ...], tuple[weakref.ref[torch.Tensor], _HostCopy]] = {}

    def pack(t: torch.Tensor) -> Any:
        strided = t.layout == torch.strided  # a sparse tensor has no storage to compare: copied as it is
        if isinstance(t, nn.Parameter) or (strided and compat.storage_id(t) in static):
            return t
        key = (
            (compat.storage_id(t), t.device, t.dtype, t.storage_offset(), t.size(), t.stride(), compat.version(t))
            if strided
            else None
        )
        hit = memo.get(key) if key is not None else None
        # The first tensor still alive: its storage is, so no other storage has taken its address since.
        if hit is not None and hit[0]() is not None:
            held = hit[1]
        else:
            kept = store.to_host(t)
            if kept is t:
                return t
            held = _HostCopy(store, kept)
            if key is not None:
                memo[key] = (weakref.ref(t), held)
        held.uses += 1
        held.left += 1
        return held

    def unpack(packed: Any) -> torch.Tensor:
        return packed if isinstance(packed, torch.Tensor) else packed.to_device()

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
    finally:
        memo.clear()


def _has_nested_tensor(value: Any, grad_only: bool = False) -> bool:
    """Whether ``value`` holds a tensor (with ``grad_only``, one that requires grad)."""
    if isinstance(value, torch.Tensor):
        return value.requires_grad or not grad_only
    if isinstance(value, (list, tuple, set)):
        return any(_has_nested_tensor(v, grad_only) for v in value)
    if isinstance(value, dict):
        return any(_has_nested_tensor(v, grad_only) for v in value.values())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return any(_has_nested_tensor(getattr(value, f.name), grad_only) for f in dataclasses.fields(value))
    return False


def _run_reentrant(
    module: nn.Module, inner: Callable[..., Any], opts: CheckpointOptions, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    name = type(module).__name__
    # Reentrant checkpoint (an autograd.Function) only sees top-level tensor arguments: gradients
    # of tensors passed by keyword or inside containers would be silently dropped. Tensors that need
    # no gradient (position_ids, an attention mask, rotary cos/sin made from buffers) lose nothing.
    bad = [k for k, v in kwargs.items() if _has_nested_tensor(v, grad_only=True)]
    bad += [
        f"argument {i}"
        for i, a in enumerate(args)
        if not isinstance(a, torch.Tensor) and _has_nested_tensor(a, grad_only=True)
    ]
    if bad:
        raise ConfigError(
            f"reentrant checkpointing of {name} would drop the gradients of tensors passed as "
            f"{', '.join(bad)} (keyword or nested arguments that require grad). "
            "Use distckpt.wrap(..., reentrant=False)."
        )
    fn = replaying(functools.partial(inner, **kwargs) if kwargs else inner, module)
    norms = module._distckpt_norms
    if norms:
        plain = fn

        def fn(*a: Any) -> Any:
            # The reentrant forward runs under no_grad; the recompute, inside backward, with grad.
            if not torch.is_grad_enabled():
                return plain(*a)
            with _keep_running_stats(norms):
                return plain(*a)

    needs_grad = any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
    if not needs_grad and any(p.requires_grad for p in module.parameters()):
        # No input requires grad (frozen embedding, LoRA): reentrant checkpoint would return an
        # output that does not require grad and the block's parameters would get no gradient.
        # A dummy input that requires grad makes autograd call the checkpoint's backward.
        # On the block's device: checkpoint infers the device (RNG state, autocast) from the first
        # tensor argument.
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), next(module.parameters()).device)
        dummy = torch.empty(0, device=device, requires_grad=True)
        run = fn
        fn = lambda _dummy, *a: run(*a)  # noqa: E731
        args = (dummy, *args)
    out = tuc.checkpoint(fn, *args, use_reentrant=True, preserve_rng_state=opts.preserve_rng_state)
    flat = out if isinstance(out, tuple) else (out,)
    if any(not isinstance(o, torch.Tensor) and _has_nested_tensor(o) for o in flat):
        raise ConfigError(
            f"reentrant checkpointing of {name} returns tensors inside a {type(out).__name__}; "
            "they would get no gradient. Use distckpt.wrap(..., reentrant=False)."
        )
    return out


def run_checkpointed(
    module: nn.Module, inner: Callable[..., Any], opts: CheckpointOptions, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    if not opts.recompute:  # the "offload" mode: nothing is recomputed, so the values are bitwise the same
        with _offload_hooks(module, host_store() if opts.store is None else opts.store):
            return inner(*args, **kwargs)
    # offload="cpu": the same hooks and store around the checkpoint, which saves the block's inputs outside
    # its own hooks. Its former copy of its own differed in what no step's values can tell: it made inputs
    # contiguous (now strides are kept, as the forward had them), pinned whenever CUDA was available (now
    # for CUDA tensors, the only ones copied) and copied a parameter passed as an input (now kept: it stays
    # on the device anyway, as it would without offload).
    offload = (
        _offload_hooks(module, host_store() if opts.store is None else opts.store)
        if opts.offload
        else contextlib.nullcontext()
    )
    with offload:
        if opts.reentrant:
            return _run_reentrant(module, inner, opts, args, kwargs)
        # Tensors passed by keyword become positional, so that checkpoint saves them with the other
        # inputs (where offload can see them) instead of holding them in a closure.
        tensor_keys = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
        fn = inner
        if tensor_keys:
            rest = {k: v for k, v in kwargs.items() if k not in tensor_keys}
            n = len(args)

            def fn(*a: Any) -> Any:
                return inner(*a[:n], **rest, **dict(zip(tensor_keys, a[n:])))

            args = (*args, *(kwargs[k] for k in tensor_keys))
            kwargs = {}
        context_fn = _context_fn(opts, module)
        if context_fn is not tuc.noop_context_fn:
            # Passed only when needed: torch.compile traces checkpoint without a context_fn argument.
            kwargs = {**kwargs, "context_fn": context_fn}
        return tuc.checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=opts.preserve_rng_state, **kwargs)


def eager_reason(module: nn.Module) -> str | None:
    """Why torch.compile cannot trace the checkpointing of this checkpointed block faithfully (``None``: it can).

    Measured on torch 2.13: a compiled recompute updates BatchNorm running statistics a second time and dynamo
    cannot trace the context that prevents it; dynamo traces a reentrant checkpoint as a non-reentrant one (no
    nested backward: the gradient timing ``reentrant=True`` asks for, and DDP's settings for it, are gone);
    offload's saved-tensor hooks break the graph on every storage lookup. Such a block's checkpoint runs
    eagerly: under a whole-model ``torch.compile`` with its forward (a graph break, :data:`EAGER_RUN`), under
    ``distckpt.apply.compile.compile_blocks`` around its compiled forward.
    """
    opts = module._distckpt_options
    if not opts.recompute:
        return "the offload mode: its saved-tensor hooks must see the eager forward's tensors"
    if module._distckpt_norms:
        return "BatchNorm running statistics: a compiled recompute would update them a second time"
    if opts.reentrant:
        return "reentrant=True: dynamo would trace it as a non-reentrant checkpoint"
    if opts.offload:
        return "offload='cpu': its saved-tensor hooks break the graph"
    return None


_WARNED_EAGER: set[tuple[type, str | None]] = set()


def _eager_run(
    module: nn.Module, inner: Callable[..., Any], opts: CheckpointOptions, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """:func:`run_checkpointed`, run eagerly inside a compiled model, with one warning per block class."""
    reason = eager_reason(module)
    if (type(module), reason) not in _WARNED_EAGER:
        _WARNED_EAGER.add((type(module), reason))
        warnings.warn(
            f"distckpt: torch.compile runs the checkpointed {module._distckpt_orig_class.__name__} blocks eagerly "
            f"(a graph break each; {reason}). To compile their forward too, compile per block: "
            "distckpt.apply.compile.compile_blocks(model), or parallelize(..., compile=True).",
            stacklevel=2,
        )
    return run_checkpointed(module, inner, opts, args, kwargs)


# torch.compiler.disable(_eager_run), made eagerly by wrap (or unpickling) when a block's checkpointing cannot
# be traced (eager_reason): not at import, since it imports torch._dynamo (a second), and not while dynamo
# traces, which would trace its creation.
EAGER_RUN: list[Callable[..., Any]] = []


def prepare_eager_run() -> None:
    if not EAGER_RUN:
        EAGER_RUN.append(torch.compiler.disable(_eager_run))
