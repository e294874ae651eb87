"""The profile's checkpointed sample steps: every block recomputed in one mode (or offloaded), for each
block's recompute peak, what it keeps over full checkpointing, and its recompute FLOPs.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.nn as nn
import torch.utils.checkpoint as tuc

from distckpt import _torch_compat as compat
from distckpt._dist import rank_world
from distckpt.errors import ConfigError
from distckpt.runtime import recompute
from distckpt.runtime.recompute import CheckpointOptions, cache_positions, stateful_norms
from distckpt.runtime.selective import OP_MODES, bind, mode_context_fn
from distckpt.runtime.swap import _checkpointed_class, unwrap
from distckpt.select.profile.flops import flop_counter
from distckpt.select.profile.recorder import _AfterOps, _Attribution, _BackwardWindows, _StepRecorder
from distckpt.select.profile.sample_step import (
    _act,
    _at,
    _preserved_state,
    _rng_state_bytes,
    _storage_bytes,
    _storage_key,
    _tensors,
    memory_tracker,
    scalar_loss,
)

logger = logging.getLogger("distckpt")


@contextlib.contextmanager
def _all_checkpointed(
    model: nn.Module,
    blocks: list[tuple[str, nn.Module]],
    context_fns: list[Callable[[], tuple[Any, Any]] | None],
    stores: list[Any] | None = None,
) -> Iterator[None]:
    """Every block checkpointed by distckpt's own wrapper (the code a plan runs; a hand-made
    checkpoint of forward missed HF's cache handling: a cache written twice, measured on Llama),
    block i under ``context_fns[i]`` (``None``: full recompute), or with ``stores`` offloaded into
    ``stores[i]`` (the ``"offload"`` mode); gradients dropped on the way out."""
    mods = [m for _, m in blocks]
    try:
        for i, (m, fn) in enumerate(zip(mods, context_fns)):
            orig = type(m)
            m.__class__ = _checkpointed_class(orig)
            m._distckpt_options = (
                CheckpointOptions(False, True, None, fn)
                if stores is None
                else CheckpointOptions(recompute=False, store=stores[i])
            )
            m._distckpt_norms = stateful_norms(m)
            m._distckpt_cache_slots = cache_positions(orig)
            m._distckpt_profiling = True  # the "runs without a KV cache" notice waits for a training forward
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # what the sample steps warn (the model's own warnings) is not the run's
            yield
    finally:
        for m in mods:
            m.__dict__.pop("_distckpt_profiling", None)
        unwrap(model, mods)
        for p in model.parameters():
            p.grad = None


class _RecomputeWindow:
    """A recompute context around ``inner`` that restarts MemTracker's running peak for the recompute
    and stores the activations and temporaries at the peak inside it in ``peaks[i]`` (``2**62`` when
    the window cannot be read: as if the block's peak lay inside it). Checkpoint stops a recompute
    early by raising through this context; ``__exit__`` hands the exception to ``inner`` unchanged;
    ``on_enter`` is called first (:meth:`_OwnBackward.recompute_begins`).
    (An earlier note said a ``contextlib.contextmanager`` here measured a lower recompute peak; that
    was the block's first recompute learning what it reads (``selective._Reach``), not the generator:
    rechecked on torch 2.13, the HF GPT-2 profile is the same field for field either way.)"""

    def __init__(
        self,
        tracker: Any,
        inner: Any,
        dev: torch.device,
        peaks: list[int],
        i: int,
        on_enter: Callable[[], None] | None = None,
    ) -> None:
        self.tracker, self.inner, self.dev, self.peaks, self.i = tracker, inner, dev, peaks, i
        self.on_enter = on_enter
        self.saved: Any = None

    def __enter__(self) -> Any:
        if self.on_enter is not None:
            self.on_enter()
        self.saved = compat.mem_tracker_restart_peak(self.tracker)
        return self.inner.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        try:
            return self.inner.__exit__(*exc)
        finally:
            if self.saved is None:
                self.peaks[self.i] = 2**62
            else:
                snap = compat.mem_tracker_peak_snapshot(self.tracker)
                self.peaks[self.i] = max(self.peaks[self.i], _act(_at(snap, self.dev)) if snap else 0)
                compat.mem_tracker_merge_peak(self.tracker, self.saved)


class _OwnBackward:
    """Each block's own backward in a sample step with every block checkpointed, and the activations,
    temporaries and gradients at its peak (the instant of the largest total, as MemTracker's per-module
    peak). MemTracker's backward of a module ends once every input has its gradient: an input shared
    with earlier blocks (an encoder-decoder's ``encoder_hidden_states``, T5's position bias made by its
    first layer) gets its whole gradient only in the first consumer's backward, so the window of every
    later block also held the earlier blocks' recomputes (BART's last decoder layer: its peak there
    was the first decoder layer's recompute, 127 KB over the measured step when that layer is kept).
    Here a block's backward also ends when another block's recompute begins (every block is
    checkpointed, so each backward starts with its recompute); what runs after that is the other
    block's, whose own window holds it. After each op :meth:`seen` is given MemTracker's snapshot."""

    def __init__(self, tracker: Any, dev: torch.device, n: int) -> None:
        self.tracker, self.dev = tracker, dev
        self.open: set[int] = set()
        self.closed: set[int] = set()
        self.watched: set[int] = set()
        self.peak: list[tuple[int, int, int] | None] = [None] * n  # (total, activations+temporaries, gradients)
        self.hooks: list[Any] = []  # removed after the step: an input may be the caller's own leaf tensor

    def _look(self, blocks: Iterable[int], d: dict[str, int] | None = None) -> None:
        d = _at(self.tracker.get_tracker_snapshot(), self.dev) if d is None else d
        total = d.get("Total", 0)
        for i in blocks:
            if self.peak[i] is None or total > self.peak[i][0]:
                self.peak[i] = (total, _act(d), d.get("Gradient", 0))

    def seen(self, d: dict[str, int]) -> None:
        """After an op, with ``d`` the device's current snapshot (read once for every window watching)."""
        if self.open:
            self._look(self.open, d)

    def watch(self, i: int, inputs: Any, out: Any) -> None:
        """Open block i's window at its outputs' first gradient, close it at its inputs' last (the
        first forward only: a recompute runs the block's forward again, on inputs backward never reaches)."""
        if i in self.watched:
            return
        self.watched.add(i)
        needing = [t for t in _tensors(inputs) if t.requires_grad]
        if needing:
            self.hooks.append(torch.autograd.graph.register_multi_grad_hook(needing, lambda _, i=i: self._close(i)))
        self.hooks.extend(t.register_hook(lambda _, i=i: self._open(i)) for t in _tensors(out) if t.requires_grad)

    def recompute_begins(self, i: int) -> None:
        for j in self.open - {i}:
            self._close(j)
        self._open(i)

    def _open(self, i: int) -> None:
        if i not in self.open and i not in self.closed:
            self.open.add(i)
            self._look((i,))

    def _close(self, i: int) -> None:
        self.open.discard(i)
        self.closed.add(i)


def _checkpointed_peaks(
    model: nn.Module,
    blocks: list[tuple[str, nn.Module]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    batch: list[torch.Tensor],
    dev: torch.device,
    context_fn: Callable[[], tuple[Any, Any]] | None = None,
    stores: list[Any] | None = None,
) -> list[tuple[int, int, int, int, int, int]] | None:
    """Activations+temporaries and gradients at each block's backward peak in a sample step with
    every block checkpointed (non-reentrant, no cache in the blocks, as distckpt runs them; under
    ``context_fn``: selective; with ``stores``: every block offloaded instead), and the bytes each block
    leaves alive after its forward.

    Returns:
        ``[(activation and temporary bytes, gradient bytes, bytes left by the forward, activation and
        temporary bytes at the peak inside the block's recompute, activation and temporary bytes at the
        block's forward peak, the activations' own peak of the block's backward whatever the gradients
        then), ...]`` per block (the fourth: the first if the window could not be read), or ``None`` when
        the step fails (then the budget bounds a recompute from the first step alone, and offers no
        selective choice).
    """
    tracker = memory_tracker(model, *batch)
    before: dict[int, int] = {}
    left = [0] * len(blocks)
    in_recompute = [-1] * len(blocks)
    windows = _BackwardWindows(tracker, dev, len(blocks))  # the activations' own peaks, recomputes included
    own_backward = _OwnBackward(tracker, dev, len(blocks))  # each block's backward peak, its own window only
    inputs: dict[int, Any] = {}

    def pre(mod: nn.Module, a: Any, i: int) -> None:
        before[i] = total()
        windows.watch_inputs(i, a)
        inputs[i] = a

    def post(mod: nn.Module, o: Any, i: int) -> None:
        left[i] = total() - before[i]
        windows.watch_outputs(i, o)
        own_backward.watch(i, inputs.pop(i, ()), o)

    def after_op() -> None:  # one snapshot (MemTracker deep-copies it) for both windows
        if windows.current is not None or own_backward.open:
            d = _at(tracker.get_tracker_snapshot(), dev)
            windows.seen(d)
            own_backward.seen(d)

    def windowed(i: int) -> Callable[[], tuple[Any, Any]]:
        # Bound here, as _recompute_flops does: the wrapper's own bind passes a function like this one as is.
        own = bind(context_fn, blocks[i][1])  # the block's reach (selective._Reach)

        def pair() -> tuple[Any, Any]:
            fwd, rec = own()
            return fwd, _RecomputeWindow(tracker, rec, dev, in_recompute, i, lambda: own_backward.recompute_begins(i))

        return pair

    def total() -> int:
        snap = tracker.get_tracker_snapshot()
        if stores is not None:  # offloaded: the host copies (pinned CPU tensors on CUDA) are not device memory
            return _at(snap, dev).get("Total", 0)
        return sum(d.get("Total", 0) for d in snap.values())

    hooks = []
    for i, (_, m) in enumerate(blocks):
        hooks.append(m.register_forward_pre_hook(lambda mod, a, i=i: pre(mod, a, i)))
        hooks.append(m.register_forward_hook(lambda mod, a, o, i=i: post(mod, o, i)))
    try:
        with _all_checkpointed(model, blocks, [windowed(i) for i in range(len(blocks))], stores), tracker:
            loss = scalar_loss(model(*args, **kwargs))
            with _AfterOps(after_op):
                loss.backward()
            del loss
    except Exception as e:  # noqa: BLE001 - a CheckpointError raises in _failed; any other only loses precision
        _failed("the checkpointed sample step", "recompute peaks estimated", e)
        return None
    finally:
        for h in hooks + windows.hooks + own_backward.hooks:
            h.remove()
    return _read_peaks(tracker, blocks, dev, left, in_recompute, windows.peak, own_backward.peak)


def _failed(step: str, instead: str, e: Exception) -> None:
    """A checkpointed sample step raised ``e``. torch's ``CheckpointError`` (a recompute that differs from its
    forward) is an error: a plan would checkpoint such blocks and train wrong or fail. Any other failure costs the
    plan its measured numbers only, and says so (a warning, and the ``distckpt`` logger on rank 0).

    Raises:
        ConfigError: ``e`` is a ``CheckpointError``.
    """
    line = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if isinstance(e, tuc.CheckpointError):
        raise ConfigError(
            f"distckpt budget: {step} with every block checkpointed failed, because a block's recompute differs "
            f"from its forward ({line}). Run distckpt.verify_recompute(model, loss_fn) to find the block and the "
            "cause, then fix it or leave that block out (wrap's blocks=)."
        ) from e
    msg = f"distckpt budget: {step} failed ({type(e).__name__}: {line}); {instead}, so the plan is less precise."
    if rank_world()[0] == 0:
        logger.warning(msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=3)


def _read_peaks(
    tracker: Any,
    blocks: list[tuple[str, nn.Module]],
    dev: torch.device,
    left: list[int],
    in_recompute: list[int],
    own_peak: list[int],
    backward: list[tuple[int, int, int] | None],
) -> list[tuple[int, int, int, int, int, int]] | None:
    """:func:`_checkpointed_peaks`' result from the step's MemTracker, per block: its backward peak and the
    gradients then (in its own window, ``backward``, where one was seen: :class:`_OwnBackward`), the bytes
    its forward left (``left``), the peak inside its recompute (``in_recompute``, ``-1``: not read), its
    forward peak and the activations' own peak (``own_peak``); ``None`` when a block has no backward
    snapshot."""
    out = []
    peak_fw, peak_bw = compat.mem_tracker_states()
    for i, (_, m) in enumerate(blocks):
        stats = tracker.memory_tracking.get(m)
        best, grads = -1, 0
        for snap in stats.snapshots.get(peak_bw, []) if stats is not None else []:
            d = snap.get(dev) or next(iter(snap.values()), {})
            act = d.get("Activation", 0) + d.get("Temp", 0)
            if act > best:
                best, grads = act, d.get("Gradient", 0)
        if best < 0:
            return None
        if backward[i] is not None:
            _, best, grads = backward[i]
        forward = max((_act(_at(snap, dev)) for snap in stats.snapshots.get(peak_fw, [])), default=0)
        out.append(
            (
                best,
                grads,
                left[i],
                min(in_recompute[i], best) if in_recompute[i] >= 0 else best,
                forward,
                max(best, own_peak[i]),
            )
        )
    return out


class _OpCosts:
    """Inside a block's full recompute: each op call that counts FLOPs, as ``(op, index, bytes, FLOPs)``
    (:attr:`BlockProfile.recompute_ops`). ``index`` counts the calls of that op from the recompute's start,
    as the ``"ops"`` mode's policy counts them in the forward (the recompute re-runs the forward's ops in
    order); ``bytes`` are the output's storages that are not an input's (what keeping it holds); the
    FLOPs are ``counter``'s, read around the call (the counter is the outer mode, this one the inner)."""

    def __init__(self, counter: Any) -> None:
        self.counter = counter
        self.calls: collections.Counter = collections.Counter()
        self.ops: list[tuple[str, int, int, int]] = []

    def mode(self) -> Any:
        """A dispatch mode recording into this object (enter it inside the counter)."""
        return _recording_mode()(self)

    def seen(self, name: str, flops: int, inputs: Any, out: Any) -> None:
        index = self.calls[name]
        self.calls[name] += 1
        if flops > 0:
            ins = {_storage_key(t) for t in _tensors(inputs)}
            kept = {_storage_key(t): _storage_bytes(t) for t in _tensors(out) if _storage_key(t) not in ins}
            self.ops.append((name, index, sum(kept.values()), int(flops)))


@functools.cache
def _recording_mode() -> type:
    """:class:`_OpCosts`' dispatch mode, a class made once (torch's ``TorchDispatchMode`` is reached through the
    compat module, so the class cannot be made at import)."""

    class Recording(compat.torch_dispatch_mode()):  # type: ignore[misc]
        def __init__(self, costs: _OpCosts) -> None:
            super().__init__()
            self.costs = costs

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            before = self.costs.counter.get_total_flops()
            out = func(*args, **(kwargs or {}))
            self.costs.seen(str(func), self.costs.counter.get_total_flops() - before, (args, kwargs), out)
            return out

    return Recording


def _recompute_flops(
    model: nn.Module,
    blocks: list[tuple[str, nn.Module]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    context_fn: Callable[[], tuple[Any, Any]] | None,
    ops: list[tuple[tuple[str, int, int, int], ...]] | None = None,
) -> list[int] | None:
    """FLOPs each block's recompute really runs, every block checkpointed (``context_fn``: selective),
    counted by ``FlopCounterMode`` around each recompute, in a step of its own (a memory peak measured
    inside ``FlopCounterMode`` is inflated under checkpointing). ``None`` when the step fails. With
    ``ops`` (a list, filled per block): the op calls each recompute ran that count FLOPs (:class:`_OpCosts`;
    the first recompute of a block when several run)."""
    counter = flop_counter()
    flops = [0] * len(blocks)
    costs = [_OpCosts(counter) for _ in blocks]

    def counting(i: int) -> Callable[[], tuple[Any, Any]]:
        own = bind(context_fn, blocks[i][1])  # the block's reach, learned here

        def pair() -> tuple[Any, Any]:
            fwd, rec = own()

            @contextlib.contextmanager
            def recompute() -> Iterator[None]:
                start = counter.get_total_flops()
                first = not costs[i].calls
                try:  # checkpoint stops a recompute early by raising through this context
                    with rec, costs[i].mode() if ops is not None and first else contextlib.nullcontext():
                        yield
                finally:
                    flops[i] += counter.get_total_flops() - start

            return fwd, recompute()

        return pair

    try:
        with _all_checkpointed(model, blocks, [counting(i) for i in range(len(blocks))]), counter:
            scalar_loss(model(*args, **kwargs)).backward()
    except Exception as e:  # noqa: BLE001 - a CheckpointError raises in _failed; any other only loses precision
        _failed("the checkpointed FLOP count step", "recompute FLOPs estimated", e)
        return None
    if ops is not None:
        ops[:] = [tuple(c.ops) for c in costs]
    return flops


def _over_prediction(
    peaks: list[tuple[int, ...]],
    rec: _StepRecorder,
    att: _Attribution,
    batch_keys: set[tuple[str, int]],
    extra: list[int],
    during: list[int],
) -> tuple[list[int], list[int], list[int]]:
    """Each block's measured backward peak in a checkpointed step over what the prediction holds
    there (the prefix of checkpointed blocks, each holding its inputs plus ``extra``), and the
    gradient bytes at that peak. Plus the part of what the recompute holds only while it runs and
    MemTracker does not see (``during``: its nodes' wrapped numbers, :attr:`BlockProfile.scalar_saved_bytes`,
    and ``fork_rng``'s copy of the RNG state) that can be alive at the CPU allocator's peak: as far as
    the peak inside the recompute plus it exceeds the block's peak (none when that peak is after it).
    Third: the same over the activations' own peak (for accumulation, see
    :attr:`BlockProfile.recompute_accumulating_overhead_bytes`)."""
    # What the checkpointed blocks before i really hold: their inputs, each storage once and not block
    # i's own (the mask and rotary tables are every block's input; input_bytes counts them per block, so
    # the prediction stays above the measure when some are kept).
    held_in: dict[tuple[str, int], int] = {}
    over, grads_at, own = [], [], []
    for i, (act, grads, _, inside, _, own_act) in enumerate(peaks):
        before = sum(b for k, b in held_in.items() if k not in rec.input_keys[i]) + sum(extra[:i])
        model = att.pre + before + att.inner[i] + att.in_bytes[i]
        over.append(act - model + max(0, min(during[i], inside + during[i] - act)))
        own.append(own_act - model + max(0, min(during[i], inside + during[i] - own_act)))
        grads_at.append(grads)
        held_in.update((k, b) for k, b in rec.input_keys[i].items() if k not in batch_keys)
    return over, grads_at, own


def _recompute_profile(
    model: nn.Module,
    rec: _StepRecorder,
    att: _Attribution,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    batch: list[torch.Tensor],
    batch_keys: set[tuple[str, int]],
    device: torch.device,
    dev: torch.device,
    modes: frozenset[str],
) -> dict[str, list[Any]]:
    """The recompute side of every block in each of ``modes`` ("full", "selective", "pointwise"; full
    is measured whenever another one is, as their reference), as :class:`BlockProfile` fields: backward
    peaks in a step with every block checkpointed (one per mode), what an op-level block holds over a
    full one (the bytes its forward leaves alive beyond full's: the op outputs it keeps, as ``distckpt
    plan`` counts them), and the recompute FLOPs (one FLOP-only step per mode)."""
    n = rec.n
    out = {
        "recompute_overhead_bytes": [0] * n,
        "recompute_grads_bytes": [-1] * n,
        "recompute_flops": [-1] * n,
        "recompute_accumulating_overhead_bytes": [-1] * n,
        "recompute_ops": [()] * n,
    }
    for mode in OP_MODES:
        out.update(
            {
                f"{mode}_held_bytes": [-1] * n,
                f"{mode}_flops": [0] * n,
                f"{mode}_recompute_overhead_bytes": [0] * n,
                f"{mode}_recompute_grads_bytes": [-1] * n,
                f"{mode}_recompute_accumulating_overhead_bytes": [-1] * n,
            }
        )
    out.update(
        offload_held_bytes=[-1] * n,
        offload_bytes=[0] * n,
        offload_overhead_bytes=[0] * n,
        offload_forward_overhead_bytes=[0] * n,
        offload_grads_bytes=[-1] * n,
    )
    if not n or not modes:
        return out
    ops: list[tuple[tuple[str, int, int, int], ...]] = []
    with _preserved_state(model, device):
        full = _checkpointed_peaks(model, rec.blocks, args, kwargs, batch, dev)
        full_flops = _recompute_flops(model, rec.blocks, args, kwargs, None, ops)
    if full is None:
        return out
    # What a recompute holds only while it runs, unseen by MemTracker: its own nodes' wrapped numbers and
    # the CPU RNG state torch.random.fork_rng keeps around it (preserve_rng_state; checkpoint.recompute_fn).
    during = [w + _rng_state_bytes(device) for w in rec.scalars]
    (out["recompute_overhead_bytes"], out["recompute_grads_bytes"], out["recompute_accumulating_overhead_bytes"]) = (
        _over_prediction(full, rec, att, batch_keys, [0] * n, during)
    )
    if full_flops is not None:
        out["recompute_flops"] = full_flops
        out["recompute_ops"] = ops
    for mode in (m for m in OP_MODES if m in modes):
        fn = mode_context_fn(mode)
        with _preserved_state(model, device):
            # FLOPs first: that step's recompute teaches each block what it reads (selective._Reach),
            # so the peaks are those of every later step (and of training, which keeps the reach).
            flops = _recompute_flops(model, rec.blocks, args, kwargs, fn)
            peaks = _checkpointed_peaks(model, rec.blocks, args, kwargs, batch, dev, fn) if flops is not None else None
        if peaks is None or flops is None:
            continue  # this mode cannot run on this model: the budget does not offer it
        extra = [max(0, s[2] - f[2]) for s, f in zip(peaks, full)]
        out[f"{mode}_held_bytes"] = [att.in_bytes[i] + extra[i] for i in range(n)]
        out[f"{mode}_flops"] = flops
        (
            out[f"{mode}_recompute_overhead_bytes"],
            out[f"{mode}_recompute_grads_bytes"],
            out[f"{mode}_recompute_accumulating_overhead_bytes"],
        ) = _over_prediction(peaks, rec, att, batch_keys, extra, during)
    if "offload" in modes:
        out.update(_offload_profile(model, rec, att, (args, kwargs, batch), batch_keys, device, dev, full))
    return out


class _CountingStore:
    """A host store that counts the bytes ``inner`` moves to the host (the offload mode's traffic, one way)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.bytes = inner, 0
        self.escapes_allocator = inner.escapes_allocator

    def to_host(self, t: torch.Tensor) -> Any:
        kept = self.inner.to_host(t)
        if kept is not t:
            self.bytes += t.numel() * t.element_size()
        return kept

    def to_device(self, packed: Any) -> torch.Tensor:
        return self.inner.to_device(packed)


def _offload_profile(
    model: nn.Module,
    rec: _StepRecorder,
    att: _Attribution,
    step: tuple[Any, Any, Any],
    batch_keys: set[tuple[str, int]],
    device: torch.device,
    dev: torch.device,
    full: list[tuple[int, ...]],
) -> dict[str, list[int]]:
    """The ``"offload"`` side of every block, as :class:`BlockProfile` fields, from a sample step with every
    block offloaded into the host store in use (``recompute.host_store()``, counted per block): what each
    forward leaves on the device beyond full checkpointing's (its output), the bytes it moves, and its
    backward peak (the saved tensors back) over the prediction's prefix there. Empty when the step fails."""
    args, kwargs, batch = step
    stores = [_CountingStore(recompute.host_store()) for _ in rec.blocks]
    with _preserved_state(model, device):
        peaks = _checkpointed_peaks(model, rec.blocks, args, kwargs, batch, dev, stores=stores)
    if peaks is None:
        return {}
    left = [max(0, p[2] - f[2]) for p, f in zip(peaks, full)]
    # A block input that another part of the model saved first (a producer that saves its output) stays on
    # the device when that part is kept: counted held, as the none mode counts it in this block's bytes.
    kept = [
        sum(b for k, b in rec.input_keys[i].items() if k not in batch_keys and rec.first_saver.get(k, (i,))[0] != i)
        for i in range(rec.n)
    ]
    # The prefix in that step: what the offloaded blocks before left on the device (their inputs are not kept).
    base = [att.pre + sum(left[:i]) + att.inner[i] + att.in_bytes[i] for i in range(rec.n)]
    return dict(
        offload_held_bytes=[a + b for a, b in zip(left, kept)],
        offload_bytes=[s.bytes for s in stores],
        offload_overhead_bytes=[p[0] - b for p, b in zip(peaks, base)],
        offload_forward_overhead_bytes=[p[4] - b for p, b in zip(peaks, base)],
        offload_grads_bytes=[p[1] for p in peaks],
    )
