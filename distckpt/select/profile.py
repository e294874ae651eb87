"""Activation bytes and recompute cost per candidate block, measured on one sample training step.

Used by the ``budget`` policy (and the benchmarks) to predict peak memory for any choice of blocks.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from distckpt import _torch_compat as compat
from distckpt.errors import ConfigError
from distckpt.select.flops import flop_counter
from distckpt.select.selective import OP_MODES, bind, mode_context_fn

__all__ = ["PROFILE_MODES", "RECOMPUTE_MODES", "BlockProfile", "ModelProfile", "adam_step_temp_bytes", "memory_tracker",
           "profile_blocks", "profile_model", "scalar_loss"]

logger = logging.getLogger("distckpt")


@dataclass(frozen=True)
class BlockProfile:
    """What one block holds for backward and what recomputing it costs.

    Attributes:
        fqn: the block's name.
        activation_bytes: bytes the block keeps for backward when it is NOT checkpointed (distinct
            storages saved by its ops, parameters excluded), its saved input included.
        forward_flops: FLOPs of one forward of the block (``FlopCounterMode`` with CPU attention,
            :func:`distckpt.select.flops.flop_counter`): the most a
            recompute costs (non-reentrant checkpoint may stop earlier).
        input_bytes: bytes of the block's tensor inputs, which a checkpointed block keeps.
        saved_input_bytes: the part of ``activation_bytes`` that is the block's input.
        overhead_bytes: memory above the held activations at the block's forward/backward peak
            (gradients of activations, temporaries), measured in the sample step.
        grads_ready_bytes: gradient bytes that exist when this block's backward ends (MemTracker),
            the most that exist while it runs: without gradient accumulation, backward creates
            gradients block by block from the last, so those of earlier blocks (and of the
            embeddings) do not exist yet.
        forward_overhead_bytes: the part of ``overhead_bytes`` measured at the block's forward peak,
            when (without gradient accumulation) no gradient exists yet.
        backward_overhead_bytes: measured activations and temporaries at the block's backward peak
            minus what the memory model counts there (held so far + this block's footprint); may be
            negative: backward frees the block's saved tensors as it consumes them, so the model's
            footprint is an upper bound there.
        grads_at_peak_bytes: gradient bytes that exist at the block's backward peak (fewer than
            ``grads_ready_bytes``: the block's own gradients are mostly created after it); ``-1``
            when not measured (then the budget uses ``grads_ready_bytes`` with ``overhead_bytes``).
        recompute_overhead_bytes: like ``backward_overhead_bytes``, measured in a second sample step
            with every block checkpointed (the recompute runs the block's forward while the
            backward's temporaries exist), relative to the prefix of checkpointed inputs.
        recompute_grads_bytes: gradient bytes at that peak; ``-1`` when that step could not run.
        recompute_flops: FLOPs the recompute of a fully checkpointed block really runs (measured in a
            FLOP-only step; non-reentrant checkpoint stops once backward has what it needs); ``-1``
            when not measured (then ``forward_flops``).
        selective_held_bytes: bytes held from forward to backward under ``selective`` (op-level)
            checkpointing: the block's input plus the op outputs the policy keeps, as the extra bytes
            a selective block leaves alive after its forward over a fully checkpointed one; ``-1``
            when not measured (then the budget does not offer ``selective`` for this block).
        selective_flops: FLOPs the selective recompute runs (the pointwise ops and every other matmul).
        selective_recompute_overhead_bytes, selective_recompute_grads_bytes: like
            ``recompute_overhead_bytes`` and ``recompute_grads_bytes``, in a sample step with every
            block selective (the prefix: the selective blocks' held bytes).
        pointwise_held_bytes, pointwise_flops, pointwise_recompute_overhead_bytes,
            pointwise_recompute_grads_bytes: the same for ``pointwise`` (every matmul/attention/conv
            output kept, only FLOP-free ops recomputed), in sample steps with every block pointwise.
        scalar_saved_bytes: bytes of the Python numbers the block's autograd nodes save as 0-dim CPU
            tensors ("wrapped numbers": ``0.5 * x`` in HF's ``NewGELUActivation``, three of 8 bytes
            per GPT-2 block), on a CPU step. Saved-tensor hooks skip them and MemTracker never sees
            them (the argument parser makes them, outside any dispatch mode), so no other field counts
            them; the CPU allocator does. The forward's nodes keep them until the block's backward,
            checkpointed or not (a checkpoint's hooks replace the other saved tensors, not these); a
            recompute's own nodes hold a second copy while it runs, and ``fork_rng`` a copy of the RNG
            state: the ``*_recompute_overhead_bytes`` include those where the measured recompute peak
            lies inside the recompute (as far as they could lift the allocator's peak above it).
        accumulating_overhead_bytes: like ``overhead_bytes``, the largest activations and temporaries
            of the block's forward and backward alone (not paired with the gradients of that instant):
            the overhead when every gradient already exists (gradient accumulation), where a new
            gradient is a temporary until its in-place add into the accumulated one. The peak of the
            sample step pairs the activations with the gradients made so far: on HF GPT-2 it lies
            after the block's MLP output projection's gradient became ``.grad``; with the gradients
            accumulated the peak is the instant before (that gradient still a temporary, 41 KB more
            activations and temporaries). ``-1``: not measured.
        end_overhead_bytes: the activations and temporaries when the block's backward has made the
            gradients of its inputs, over what the blocks before it (and the embeddings) hold: what
            FSDP1 has beside the block's parameter gradients when it concatenates them into its flat
            parameter's gradient. ``-1``: not measured.
        recompute_accumulating_overhead_bytes, selective_recompute_accumulating_overhead_bytes,
            pointwise_recompute_accumulating_overhead_bytes: like the ``*_recompute_overhead_bytes``, the
            activations' own peak of the block's backward (its recompute included) in that mode's
            checkpointed step, as ``accumulating_overhead_bytes`` is for a kept block. ``-1``: not measured.
        shared_input_bytes: the part of ``input_bytes`` that every earlier block takes as input too (one
            storage: HF GPT-2's ``cache_position``, Llama's mask and rotary tables), held once however
            many checkpointed blocks keep it (0 for the first block).
        offload_held_bytes: bytes an ``"offload"`` block leaves on the device from its forward to its
            backward, measured in a sample step with every block offloaded (what its forward leaves
            alive beyond a fully checkpointed block's, i.e. beyond its output: the saved tensors it
            cannot move), plus its inputs that another part of the model saves (kept there whatever
            this block does when that part is not offloaded); ``-1`` when not measured (then the
            budget does not offer offload for this block).
        offload_bytes: bytes the block's forward moves to host memory (and its backward back), per step,
            counted in the host store during that step.
        offload_overhead_bytes, offload_grads_bytes: like ``recompute_overhead_bytes`` and
            ``recompute_grads_bytes``, at the block's backward peak in that step (the saved tensors
            back on the device), relative to the bytes the offloaded blocks before it left there.
        offload_forward_overhead_bytes: the same at the block's forward peak in that step (its saved
            tensors leave as they are saved; what its forward still holds in locals stays).
    """

    fqn: str
    activation_bytes: int
    forward_flops: int
    input_bytes: int = 0
    saved_input_bytes: int = 0
    overhead_bytes: int = 0
    grads_ready_bytes: int = 0
    forward_overhead_bytes: int = 0
    backward_overhead_bytes: int = 0
    grads_at_peak_bytes: int = -1
    recompute_overhead_bytes: int = 0
    recompute_grads_bytes: int = -1
    recompute_flops: int = -1
    selective_held_bytes: int = -1
    selective_flops: int = 0
    selective_recompute_overhead_bytes: int = 0
    selective_recompute_grads_bytes: int = -1
    pointwise_held_bytes: int = -1
    pointwise_flops: int = 0
    pointwise_recompute_overhead_bytes: int = 0
    pointwise_recompute_grads_bytes: int = -1
    scalar_saved_bytes: int = 0
    accumulating_overhead_bytes: int = -1
    end_overhead_bytes: int = -1
    recompute_accumulating_overhead_bytes: int = -1
    selective_recompute_accumulating_overhead_bytes: int = -1
    pointwise_recompute_accumulating_overhead_bytes: int = -1
    shared_input_bytes: int = 0
    offload_held_bytes: int = -1
    offload_bytes: int = 0
    offload_overhead_bytes: int = 0
    offload_forward_overhead_bytes: int = 0
    offload_grads_bytes: int = -1

    def mode_held_flops(self, mode: str) -> tuple[int, int]:
        """``(bytes held from forward to backward, recompute FLOPs)`` of a checkpointed ``mode``
        (``"selective"``, ``"pointwise"``, ``"full"``; ``"offload"``: no recompute, 0 FLOPs: its cost is
        the transfer of ``offload_bytes``); held ``-1``: the profile did not measure it."""
        if mode == "offload":
            return self.offload_held_bytes, 0
        if mode == "selective":
            return self.selective_held_bytes, self.selective_flops
        if mode == "pointwise":
            return self.pointwise_held_bytes, self.pointwise_flops
        return self.input_bytes, self.full_flops

    def recompute_peak(self, mode: str) -> tuple[int, int]:
        """``(gradient bytes, overhead bytes)`` at the block's measured recompute peak in a step with
        every block checkpointed in ``mode``; gradient bytes ``-1``: not measured."""
        if mode == "offload":
            return self.offload_grads_bytes, self.offload_overhead_bytes
        if mode == "selective":
            return self.selective_recompute_grads_bytes, self.selective_recompute_overhead_bytes
        if mode == "pointwise":
            return self.pointwise_recompute_grads_bytes, self.pointwise_recompute_overhead_bytes
        return self.recompute_grads_bytes, self.recompute_overhead_bytes

    def recompute_accumulating(self, mode: str) -> int:
        """The activations' own peak over the prediction in a backward of the block checkpointed in
        ``mode`` (``-1``: not measured, as for ``"offload"``): its bound when every gradient exists
        (accumulation)."""
        if mode in OP_MODES:
            return getattr(self, f"{mode}_recompute_accumulating_overhead_bytes")
        return self.recompute_accumulating_overhead_bytes if mode == "full" else -1

    @property
    def full_flops(self) -> int:
        """Recompute FLOPs of full checkpointing: measured when known, else one forward."""
        return self.recompute_flops if self.recompute_flops >= 0 else self.forward_flops

    @property
    def held_bytes(self) -> int:
        """Bytes held from forward to backward when the block is not checkpointed."""
        return self.activation_bytes

    @property
    def footprint_bytes(self) -> int:
        """Bytes alive while the block runs its backward (its activations plus its input)."""
        return self.activation_bytes - self.saved_input_bytes + self.input_bytes


@dataclass(frozen=True)
class ModelProfile:
    """The per-block profiles plus what the rest of the model holds in a training step.

    Attributes:
        blocks: one :class:`BlockProfile` per candidate block, in forward order.
        param_bytes: all parameters (distinct storages).
        trainable_bytes: parameters that require grad (their gradients have this size).
        trainable_tensors: how many parameters require grad (Adam keeps a 4-byte ``step`` per each).
        buffer_bytes: module buffers.
        block_param_bytes: the largest parameter bytes of one block (FSDP unshards one at a time).
        max_param_bytes: the largest single trainable parameter (per-tensor optimizer temporaries).
        step_temp_bytes: the largest temporaries of Adam/AdamW's per-tensor step (CPU): see
            :func:`adam_step_temp_bytes`; ``-1`` when unknown (then twice ``max_param_bytes``).
        batch_bytes: the example inputs.
        pre_bytes: activations saved outside the blocks before the last block ends (embeddings).
        post_bytes: activations saved after the last block (final norm, head, a loss in the model).
        head_overhead_bytes: memory above the held activations at the peak outside the blocks.
        head_grads_bytes: gradient bytes that exist when the last block's backward begins.
        head_peak_overhead_bytes: measured activations and temporaries at the peak between the end
            of the last block's forward and the start of its backward (the head's forward and
            backward, the loss) minus ``pre + held by the blocks + post``; may be negative.
        head_peak_grads_bytes: gradient bytes that exist at that peak; ``-1`` when not measured
            (then the budget uses ``head_overhead_bytes`` with ``head_grads_bytes``).
        tail_peak_bytes: activations and temporaries at the peak of the tail: what backward runs after
            every block's (the embeddings' backward), measured in a window of its own, or the step's
            peak when that lies in no block and not in the head: no choice of blocks changes it.
        tail_grads_bytes: gradient bytes at that peak; ``-1`` when not measured.
        measured_peak_bytes: peak of the sample step without checkpointing (MemTracker on CPU,
            ``torch.cuda.max_memory_allocated`` on CUDA), without optimizer state.
        rng_state_bytes: what a checkpointed block keeps of the RNG state from its forward to its
            backward (``preserve_rng_state``), in the memory the peak is measured in: the CPU
            generator's state (5056 bytes on torch 2.13) for a step on the CPU, which the allocator (and
            the profiler) sees but MemTracker does not; 0 on CUDA, whose RNG state (seed and offset)
            is kept in host memory, not in the device memory ``max_memory_allocated`` counts.
        scalar_saved_bytes: like :attr:`BlockProfile.scalar_saved_bytes`, for the autograd nodes made
            outside the blocks (embeddings, head, loss): alive from the forward to the end of backward.
        device: the device type the sample step ran on.
    """

    blocks: tuple[BlockProfile, ...]
    param_bytes: int = 0
    trainable_bytes: int = 0
    trainable_tensors: int = 0
    buffer_bytes: int = 0
    block_param_bytes: int = 0
    max_param_bytes: int = 0
    step_temp_bytes: int = -1
    batch_bytes: int = 0
    pre_bytes: int = 0
    post_bytes: int = 0
    head_overhead_bytes: int = 0
    head_grads_bytes: int = 0
    head_peak_overhead_bytes: int = 0
    head_peak_grads_bytes: int = -1
    tail_peak_bytes: int = 0
    tail_grads_bytes: int = -1
    measured_peak_bytes: int = 0
    rng_state_bytes: int = 0
    scalar_saved_bytes: int = 0
    device: str = "cpu"

    @property
    def activation_bytes(self) -> int:
        """Activations held for backward without any checkpointing (blocks and the rest)."""
        return self.pre_bytes + self.post_bytes + sum(b.activation_bytes for b in self.blocks)


def scalar_loss(out: Any) -> torch.Tensor:
    """A scalar to call ``backward`` on, from what a model returns.

    A ``loss`` attribute or key (Hugging Face models given labels) is used as is; otherwise the sum
    of every floating tensor output that requires grad. A sum saves nothing for backward, so the
    profile sees only what the model itself holds.

    Raises:
        ValueError: when the output holds no tensor that requires grad.
    """
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        return loss
    leaves, _ = tree_flatten(out)
    if not leaves and hasattr(out, "to_tuple"):  # Hugging Face ModelOutput
        leaves, _ = tree_flatten(out.to_tuple())
    parts = [t.float().sum() for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
    if not parts:
        raise ValueError(
            "the model's output holds no tensor that requires grad, so no backward can be profiled; "
            "pass example_inputs that make the model return its loss (or logits) in training mode."
        )
    return torch.stack(parts).sum()


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    # The storage's identity, not its data_ptr(): the same on real tensors, and it also tells fake
    # tensors apart (distckpt plan profiles under FakeTensorMode, where every data_ptr() is 0).
    return (str(t.device), compat.storage_id(t))


def _storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def _tensors(value: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(value)
    return [t for t in leaves if isinstance(t, torch.Tensor)]


@dataclass(frozen=True)
class Call:
    """Positional and keyword arguments of one forward call, as a sample batch."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]


def _as_args(example_inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(example_inputs, Call):
        return tuple(example_inputs.args), dict(example_inputs.kwargs)
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def _signature(value: Any) -> Any:
    leaves, spec = tree_flatten(value)
    return str(spec), tuple(
        (tuple(t.shape), t.dtype, str(t.device)) if isinstance(t, torch.Tensor) else repr(t) for t in leaves
    )


def _distinct_bytes(tensors: list[torch.Tensor]) -> int:
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        seen[_storage_key(t)] = _storage_bytes(t)
    return sum(seen.values())


@contextlib.contextmanager
def _preserved_state(model: nn.Module, device: torch.device) -> Iterator[None]:
    """Leave the model as it was: gradients, buffers (BatchNorm statistics) and the RNG streams."""
    grads = {p: p.grad for p in model.parameters()}
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        try:
            for p in grads:
                p.grad = None
            yield
        finally:
            for p, g in grads.items():
                p.grad = g
            with torch.no_grad():
                for b, v in buffers:
                    b.copy_(v)


def memory_tracker(*external: Any) -> Any:
    """A ``MemTracker`` tracking ``external`` (modules, optimizers, tensors) that also works on
    models with frozen parameters (LoRA), for one ``with`` block.

    MemTracker registers a gradient hook on every parameter of each module it sees run, and
    ``register_hook`` raises on a tensor that does not require grad. A frozen parameter never gets a
    gradient, so it needs no hook: each one is marked as already hooked (a no-op handle).

    Returns:
        A ``torch.distributed._tools.mem_tracker.MemTracker``, not yet entered.
    """
    leaves, _ = tree_flatten(external)
    frozen = [p for m in leaves if isinstance(m, nn.Module) for p in m.parameters() if not p.requires_grad]
    tracker = compat.mem_tracker(frozen)
    tracker.track_external(*external)
    return tracker


# The recompute modes a profile can measure, each in sample steps of its own ("full": plain recompute;
# the op-level ones: distckpt.select.selective.OP_MODES). The default set: "offload" (no recompute) is
# measured only when asked (a budget that may offer it: on CUDA), so a CPU profile costs nothing more.
RECOMPUTE_MODES = ("full", *OP_MODES)
PROFILE_MODES = (*RECOMPUTE_MODES, "offload")

_CACHE_OFF = {"use_cache": False, "past_key_values": None, "past_key_value": None, "layer_past": None}


@contextlib.contextmanager
def _all_checkpointed(model: nn.Module, blocks: list[tuple[str, nn.Module]],
                      context_fns: list[Callable[[], tuple[Any, Any]] | None],
                      stores: list[Any] | None = None) -> Iterator[None]:
    """Every block checkpointed by distckpt's own wrapper (the code a plan runs; a hand-made
    checkpoint of forward missed HF's cache handling: a cache written twice, measured on Llama),
    block i under ``context_fns[i]`` (``None``: full recompute), or with ``stores`` offloaded into
    ``stores[i]`` (the ``"offload"`` mode); gradients dropped on the way out."""
    from distckpt.apply.recompute import CheckpointOptions, cache_positions, stateful_norms
    from distckpt.apply.wrap import _checkpointed_class, unwrap

    mods = [m for _, m in blocks]
    try:
        for i, (m, fn) in enumerate(zip(mods, context_fns)):
            orig = type(m)
            m.__class__ = _checkpointed_class(orig)
            m._distckpt_options = (CheckpointOptions(False, True, None, fn) if stores is None else
                                   CheckpointOptions(recompute=False, store=stores[i]))
            m._distckpt_norms = stateful_norms(m)
            m._distckpt_cache_slots = cache_positions(orig)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the wrapper's one-time "runs without a KV cache" notice
            yield
    finally:
        unwrap(model, mods)
        for p in model.parameters():
            p.grad = None


class _RecomputeWindow:
    """A recompute context around ``inner`` that restarts MemTracker's running peak for the recompute
    and stores the activations and temporaries at the peak inside it in ``peaks[i]`` (``2**62`` when
    the window cannot be read: as if the block's peak lay inside it). Checkpoint stops a recompute
    early by raising through this context; ``__exit__`` hands the exception to ``inner`` unchanged.
    (An earlier note said a ``contextlib.contextmanager`` here measured a lower recompute peak; that
    was the block's first recompute learning what it reads (``selective._Reach``), not the generator:
    rechecked on torch 2.13, the HF GPT-2 profile is the same field for field either way.)"""

    def __init__(self, tracker: Any, inner: Any, dev: torch.device, peaks: list[int], i: int) -> None:
        self.tracker, self.inner, self.dev, self.peaks, self.i = tracker, inner, dev, peaks, i
        self.saved: Any = None

    def __enter__(self) -> Any:
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


def _checkpointed_peaks(model: nn.Module, blocks: list[tuple[str, nn.Module]], args: tuple[Any, ...],
                        kwargs: dict[str, Any], batch: list[torch.Tensor], dev: torch.device,
                        context_fn: Callable[[], tuple[Any, Any]] | None = None, stores: list[Any] | None = None
                        ) -> list[tuple[int, int, int, int, int]] | None:
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

    def pre(mod: nn.Module, a: Any, i: int) -> None:
        before[i] = total()
        windows.watch_inputs(i, a)

    def post(mod: nn.Module, o: Any, i: int) -> None:
        left[i] = total() - before[i]
        windows.watch_outputs(i, o)

    def windowed(i: int) -> Callable[[], tuple[Any, Any]]:
        # Bound here, as _recompute_flops does: the wrapper's own bind passes a function like this one as is.
        own = bind(context_fn, blocks[i][1])  # the block's reach (selective._Reach)

        def pair() -> tuple[Any, Any]:
            fwd, rec = own()
            return fwd, _RecomputeWindow(tracker, rec, dev, in_recompute, i)

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
            with _AfterOps(windows.after_op):
                loss.backward()
            del loss
    except Exception as e:  # noqa: BLE001 - any failure only loses precision, never correctness
        logger.info("distckpt.select.profile: the checkpointed sample step failed (%s); recompute peaks estimated", e)
        return None
    finally:
        for h in hooks + windows.hooks:
            h.remove()
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
        forward = max((_act(_at(snap, dev)) for snap in stats.snapshots.get(peak_fw, [])), default=0)
        out.append((best, grads, left[i], min(in_recompute[i], best) if in_recompute[i] >= 0 else best, forward,
                    max(best, windows.peak[i])))
    return out


def _recompute_flops(model: nn.Module, blocks: list[tuple[str, nn.Module]], args: tuple[Any, ...],
                     kwargs: dict[str, Any], context_fn: Callable[[], tuple[Any, Any]] | None) -> list[int] | None:
    """FLOPs each block's recompute really runs, every block checkpointed (``context_fn``: selective),
    counted by ``FlopCounterMode`` around each recompute, in a step of its own (a memory peak measured
    inside ``FlopCounterMode`` is inflated under checkpointing). ``None`` when the step fails."""
    counter = flop_counter()
    flops = [0] * len(blocks)

    def counting(i: int) -> Callable[[], tuple[Any, Any]]:
        own = bind(context_fn, blocks[i][1])  # the block's reach, learned here

        def pair() -> tuple[Any, Any]:
            fwd, rec = own()

            @contextlib.contextmanager
            def recompute() -> Iterator[None]:
                start = counter.get_total_flops()
                try:  # checkpoint stops a recompute early by raising through this context
                    with rec:
                        yield
                finally:
                    flops[i] += counter.get_total_flops() - start

            return fwd, recompute()

        return pair

    try:
        with _all_checkpointed(model, blocks, [counting(i) for i in range(len(blocks))]), counter:
            scalar_loss(model(*args, **kwargs)).backward()
    except Exception as e:  # noqa: BLE001 - any failure only loses precision, never correctness
        logger.info("distckpt.select.profile: the recompute FLOP count failed (%s)", e)
        return None
    return flops


def _at(snap: dict[Any, dict[str, int]], dev: torch.device) -> dict[str, int]:
    """One device's entry of a MemTracker snapshot (the only device on a CPU-only step)."""
    return snap.get(dev) or next(iter(snap.values()), {})


def _act(d: dict[str, int]) -> int:
    return d.get("Activation", 0) + d.get("Temp", 0)


def _unhooked_saved_bytes(roots: list[Any], stop: set[Any], seen: set[Any],
                          packed: Callable[[tuple[str, int]], bool], device: torch.device) -> int:
    """Bytes in ``device``'s memory of the tensors that the autograd nodes reachable from ``roots`` saved
    without the saved-tensor hooks packing them (``packed(key)`` false): the wrapped numbers of
    :attr:`BlockProfile.scalar_saved_bytes`. The walk stops at the nodes in ``stop`` (a block's
    inputs') and in ``seen`` (walked for an earlier block), and adds the nodes it walks to ``seen``."""
    found: dict[tuple[str, int], int] = {}
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node is None or node in seen or node in stop:
            continue
        seen.add(node)
        for t in compat.saved_tensors_of(node):
            key = _storage_key(t)
            if t.device == device and not packed(key):
                found[key] = _storage_bytes(t)
        stack.extend(n for n, _ in node.next_functions)
    return sum(found.values())


class _AfterOps(compat.torch_dispatch_mode()):
    """Calls ``fn`` after every op, inside MemTracker's mode (entered after it): MemTracker's per-module
    snapshots are taken at the largest total, which pairs activations with the gradients of that
    instant; the activations' own peak needs a look after each op."""

    def __init__(self, fn: Callable[[], None]) -> None:
        super().__init__()
        self.fn = fn

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.fn()
        return out


class _BackwardWindows:
    """Each block's backward as a window (from its output's gradient to its inputs' gradients) and the
    activations' own peak in it (:class:`_AfterOps` calls :meth:`after_op`), and the activations when
    its inputs' gradients are made. A block's input is the previous block's output: that block's
    output hook, registered first, runs first, so only the block's own window closes at its input."""

    def __init__(self, tracker: Any, dev: torch.device, n: int) -> None:
        self.tracker, self.dev = tracker, dev
        self.current: int | None = None
        self.peak = [-1] * n
        self.end = [-1] * n
        self.hooks: list[Any] = []  # removed after the step: an input may be the caller's own leaf tensor

    def now(self) -> int:
        return _act(_at(self.tracker.get_tracker_snapshot(), self.dev))

    def after_op(self) -> None:
        if self.current is not None:
            self.peak[self.current] = max(self.peak[self.current], self.now())

    def watch_outputs(self, i: int, out: Any) -> None:
        self.hooks.extend(t.register_hook(lambda g, i=i: self._open(i)) for t in _tensors(out) if t.requires_grad)

    def watch_inputs(self, i: int, inputs: Any) -> None:
        self.hooks.extend(t.register_hook(lambda g, i=i: self._close(i)) for t in _tensors(inputs) if t.requires_grad)

    def _open(self, i: int) -> None:
        self.current = i

    def _close(self, i: int) -> None:
        self.end[i] = max(self.end[i], self.now())
        if self.current == i:
            self.current = None


class _StepRecorder:
    """The hooks of the profiled sample step: which block saves each storage for backward, each
    block's inputs and forward FLOPs, and MemTracker's peak of the head (after the last block's
    forward, before its backward)."""

    def __init__(self, model: nn.Module, blocks: list[tuple[str, nn.Module]]) -> None:
        self.n = n = len(blocks)
        self.blocks = blocks
        self.static_keys = {_storage_key(t) for t in [*model.parameters(), *model.buffers()]}
        self.index = {id(m): i for i, (_, m) in enumerate(blocks)}
        self.active: list[int] = []  # stack of candidate blocks running their forward
        self.done = 0  # blocks whose forward has finished; == n means "after the last block"
        self.first_saver: dict[tuple[str, int], tuple[int, int]] = {}  # storage -> (owner, bytes); -1 pre, n post
        self.input_keys: list[dict[tuple[str, int], int]] = [{} for _ in range(n)]
        # Storages are told apart by address, so block inputs stay referenced until the end of forward:
        # a freed input's address reused by a later saved tensor would otherwise be taken for that input.
        self.keep: list[torch.Tensor] = []
        self.flops = [0] * n
        self.counter = flop_counter()  # counts CPU attention too (torch 2.13 has no formula for it)
        self.flop_start: dict[int, int] = {}
        self.tracker: Any = None
        self.head: dict[str, Any] = {}
        self.tail: dict[str, Any] = {}
        self.pending_inputs = 0  # block inputs whose gradient backward has not made yet
        self.input_nodes: list[set[Any]] = [set() for _ in range(n)]  # the grad_fns of each block's inputs
        self.walked: set[Any] = set()  # autograd nodes already searched for unhooked saved tensors
        self.scalars = [0] * n  # BlockProfile.scalar_saved_bytes
        self.outside_scalars = 0  # ModelProfile.scalar_saved_bytes
        self.device = torch.device("cpu")
        self.grad_hooks: list[Any] = []  # removed after the step: an input may be the caller's own leaf tensor
        self.windows: _BackwardWindows | None = None  # each block's backward (made with the tracker)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in self.static_keys and key not in self.first_saver:
            owner = self.active[-1] if self.active else (self.n if self.done >= self.n else -1)
            self.first_saver[key] = (owner, _storage_bytes(t))
        return t

    def pre_hook(self, module: nn.Module, a: Any, kw: Any) -> None:
        i = self.index[id(module)]
        self.active.append(i)
        for t in _tensors((a, kw)):
            key = _storage_key(t)
            if key not in self.static_keys:
                self.input_keys[i][key] = _storage_bytes(t)
                self.keep.append(t)
            if t.grad_fn is not None:
                self.input_nodes[i].add(t.grad_fn)
            if t.requires_grad:
                self.pending_inputs += 1
                self.grad_hooks.append(t.register_hook(self._input_grad))
        self.windows.watch_inputs(i, (a, kw))
        self.flop_start[i] = self.counter.get_total_flops()

    def _input_grad(self, _: torch.Tensor) -> None:
        # Once backward has made the gradient of every block input, every block's backward is over: what
        # runs from here (the embeddings' backward, a tied embedding's dense gradient) is the tail, whose
        # peak no choice of blocks changes. Its own window, as the head's: the step's overall peak lies
        # elsewhere when no block is checkpointed, and the tail can still be the peak of a checkpointed
        # step (BART: the shared embedding's backward, 9984 B above every checkpointed block's).
        self.pending_inputs -= 1
        if self.pending_inputs == 0 and "saved" not in self.head and not self.tail:
            saved = compat.mem_tracker_restart_peak(self.tracker)
            if saved is not None:
                self.tail["saved"] = saved

    def _close_tail(self) -> None:
        if "saved" in self.tail:
            self.tail["snap"] = copy.deepcopy(compat.mem_tracker_peak_snapshot(self.tracker))
            compat.mem_tracker_merge_peak(self.tracker, self.tail.pop("saved"))

    def post_hook(self, module: nn.Module, a: Any, kw: Any, out: Any) -> None:
        i = self.index[id(module)]
        self.active.pop()
        self.flops[i] += self.counter.get_total_flops() - self.flop_start.pop(i)
        self.done = max(self.done, i + 1)
        roots = [t.grad_fn for t in _tensors(out) if t.grad_fn is not None]
        self.scalars[i] += _unhooked_saved_bytes(roots, self.input_nodes[i], self.walked, self._packed, self.device)
        self.windows.watch_outputs(i, out)
        if i == self.n - 1:
            self._head_window(out)

    def _packed(self, key: tuple[str, int]) -> bool:
        return key in self.first_saver or key in self.static_keys

    def _head_window(self, out: Any) -> None:
        # MemTracker's running peak restarts when the last block returns and is read when the gradient
        # of its output arrives; then the two windows are merged back (see _torch_compat).
        outs = [t for t in _tensors(out) if t.requires_grad]
        saved = compat.mem_tracker_restart_peak(self.tracker) if outs else None
        if saved is None:
            return
        self.head["saved"] = saved

        def on_grad(_: torch.Tensor) -> None:
            if "snap" in self.head or "saved" not in self.head:
                return
            self.head["snap"] = copy.deepcopy(compat.mem_tracker_peak_snapshot(self.tracker))
            compat.mem_tracker_merge_peak(self.tracker, self.head.pop("saved"))

        for t in outs:
            t.register_hook(on_grad)

    def run(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], batch: list[torch.Tensor],
            device: torch.device) -> int:
        """One forward+backward under the hooks and MemTracker; returns the CUDA peak (0 on CPU)."""
        handles = []
        for _, m in self.blocks:
            handles.append(m.register_forward_pre_hook(self.pre_hook, with_kwargs=True))
            handles.append(m.register_forward_hook(self.post_hook, with_kwargs=True))
        self.tracker = memory_tracker(model, *batch)
        self.device = device
        self.windows = _BackwardWindows(self.tracker, device if device.type != "cuda" else
                                        torch.device("cuda", device.index or 0), self.n)
        cuda = device.type == "cuda"
        try:
            with _preserved_state(model, device):
                if cuda:
                    torch.cuda.synchronize(device)
                    torch.cuda.reset_peak_memory_stats(device)
                    cuda_base = torch.cuda.memory_allocated(device)
                with self.tracker:
                    with self.counter, torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t):
                        loss = scalar_loss(model(*args, **kwargs))
                    self.outside_scalars = _unhooked_saved_bytes([loss.grad_fn], set(), self.walked, self._packed,
                                                                 device)
                    # The inputs were kept only to tell storages apart in forward; kept in backward they
                    # would inflate every backward snapshot by the later blocks' inputs.
                    self.keep.clear()
                    with _AfterOps(self.windows.after_op):
                        loss.backward()
                    del loss
                    self._close_tail()
                return torch.cuda.max_memory_allocated(device) - cuda_base if cuda else 0
        finally:
            for h in handles:
                h.remove()
            for h in self.grad_hooks + self.windows.hooks:
                h.remove()
            self.grad_hooks.clear()
            self.keep.clear()


@dataclass
class _Attribution:
    """Saved bytes per block (each storage once) and the activations outside the blocks."""

    inner: list[int]  # saved inside block i (its own activations)
    saved_input: list[int]  # block i's inputs that some block saves (the consumer keeps them)
    in_bytes: list[int]  # block i's inputs, batch excluded
    pre: int  # saved before the first block
    post: int  # saved after the last block (the head)

    @property
    def held(self) -> list[int]:
        return [a + b for a, b in zip(self.inner, self.saved_input)]


def _attribute(rec: _StepRecorder, batch_keys: set[tuple[str, int]]) -> _Attribution:
    # A storage that is some block's input belongs to that block's input (the consumer keeps it
    # whether or not the producer is checkpointed).
    n = rec.n
    input_owner: dict[tuple[str, int], int] = {}
    for i in range(n):
        for key in rec.input_keys[i]:
            input_owner.setdefault(key, i)
    att = _Attribution([0] * n, [0] * n, [0] * n, 0, 0)
    for key, (owner, nbytes) in rec.first_saver.items():
        if key in batch_keys:
            continue  # counted in batch_bytes
        if key in input_owner:
            att.saved_input[input_owner[key]] += nbytes
        elif owner == -1:
            att.pre += nbytes
        elif owner == n:
            att.post += nbytes
        else:
            att.inner[owner] += nbytes
    att.in_bytes = [sum(b for k, b in rec.input_keys[i].items() if k not in batch_keys) for i in range(n)]
    return att


def _shared_inputs(rec: _StepRecorder, batch_keys: set[tuple[str, int]]) -> list[int]:
    """Per block, the bytes of its inputs (batch excluded) that every earlier block takes too."""
    out, common = [], None
    for keys in rec.input_keys:
        own = {k: b for k, b in keys.items() if k not in batch_keys}
        out.append(0 if common is None else sum(b for k, b in own.items() if k in common))
        common = set(own) if common is None else common & set(own)
    return out


def _block_overheads(rec: _StepRecorder, att: _Attribution, dev: torch.device) -> dict[str, list[int]]:
    """How far the measured activation+temporary memory at each block's forward and backward peak
    exceeds the model "held so far + this block's footprint": makes the prediction exact on this step."""
    peak_fw, peak_bw = compat.mem_tracker_states()
    n = rec.n
    out: dict[str, list[int]] = {k: [0] * n for k in ("overhead", "overhead_fw", "overhead_bw")}
    out["grads_peak"] = [-1] * n
    out["accumulating"] = [-1] * n
    out["end"] = [-1] * n
    out["measured_blocks"] = []
    prefix = 0
    held = att.held
    for i, (_, m) in enumerate(rec.blocks):
        stats = rec.tracker.memory_tracking.get(m)
        base = att.pre + prefix + att.inner[i] + att.in_bytes[i]
        if stats is not None:
            fw_snaps, bw_snaps = stats.snapshots.get(peak_fw, []), stats.snapshots.get(peak_bw, [])
            measured_fw = max((_act(_at(s, dev)) for s in fw_snaps), default=0)
            measured_bw = max((_act(_at(s, dev)) for s in bw_snaps), default=0)
            out["measured_blocks"].append(max(measured_fw, measured_bw))
            out["overhead"][i] = max(0, max(measured_fw, measured_bw) - base)
            out["overhead_fw"][i] = max(0, measured_fw - base)
            if bw_snaps:
                out["overhead_bw"][i] = measured_bw - base
                # Gradient bytes in the snapshot where activations and temporaries peak (the same instant).
                out["grads_peak"][i] = _at(max(bw_snaps, key=lambda s: _act(_at(s, dev))), dev).get("Gradient", 0)
            if rec.windows.peak[i] >= 0:  # the activations' own peak, whatever gradients existed then
                out["accumulating"][i] = max(0, max(measured_fw, measured_bw, rec.windows.peak[i]) - base)
        if rec.windows.end[i] >= 0:
            out["end"][i] = max(0, rec.windows.end[i] - att.pre - prefix)
        prefix += held[i]
    return out


def _head_and_tail(rec: _StepRecorder, model: nn.Module, att: _Attribution, measured_blocks: list[int],
                   dev: torch.device) -> dict[str, int]:
    """The head's overheads (after the last block), and the step's peak when it lies outside every
    block and the head's window (the tail: e.g. the optimizer-free end of backward)."""
    peak_fw, peak_bw = compat.mem_tracker_states()
    tracker = rec.tracker
    held_all = att.pre + sum(att.held) + att.post
    s = _at(tracker.get_tracker_snapshot("peak"), dev)
    global_act = _act(s)
    root = tracker.memory_tracking.get(model)
    end_act = max((_act(_at(snap, dev)) for snap in root.snapshots.get(peak_fw, [])), default=0) if root else 0
    if global_act > max(measured_blocks, default=0):
        end_act = max(end_act, global_act)
    head_snap = rec.head.get("snap") or {}
    hs = head_snap.get(dev) or next(iter(head_snap.values()), None)
    inside = [_at(snap, dev).get("Total", 0) for _, m in rec.blocks
              if (st := tracker.memory_tracking.get(m)) is not None
              for state in (peak_fw, peak_bw) for snap in st.snapshots.get(state, [])]
    tail = bool(hs) and s.get("Total", 0) > max(max(inside, default=0), hs.get("Total", 0))
    tail_act, tail_grads = (global_act, s.get("Gradient", 0)) if tail else (0, -1)
    if "snap" in rec.tail:  # the tail's own window (see _StepRecorder._input_grad): its peak whatever the global one
        ts = _at(rec.tail["snap"], dev)
        if not tail or _act(ts) + ts.get("Gradient", 0) >= tail_act + tail_grads:
            tail_act, tail_grads = _act(ts), ts.get("Gradient", 0)
    return dict(
        head_overhead_bytes=max(0, end_act - held_all),
        head_peak_overhead_bytes=_act(hs) - held_all if hs else 0,
        head_peak_grads_bytes=hs.get("Gradient", 0) if hs else -1,
        tail_peak_bytes=tail_act,
        tail_grads_bytes=tail_grads,
        measured_total=s.get("Total", 0),
    )


def _over_prediction(peaks: list[tuple[int, ...]], rec: _StepRecorder, att: _Attribution,
                     batch_keys: set[tuple[str, int]], extra: list[int], during: list[int]
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


def _recompute_profile(model: nn.Module, rec: _StepRecorder, att: _Attribution, args: tuple[Any, ...],
                       kwargs: dict[str, Any], batch: list[torch.Tensor], batch_keys: set[tuple[str, int]],
                       device: torch.device, dev: torch.device, modes: frozenset[str]) -> dict[str, list[int]]:
    """The recompute side of every block in each of ``modes`` ("full", "selective", "pointwise"; full
    is measured whenever another one is, as their reference), as :class:`BlockProfile` fields: backward
    peaks in a step with every block checkpointed (one per mode), what an op-level block holds over a
    full one (the bytes its forward leaves alive beyond full's: the op outputs it keeps, as ``distckpt
    plan`` counts them), and the recompute FLOPs (one FLOP-only step per mode)."""
    n = rec.n
    out = {"recompute_overhead_bytes": [0] * n, "recompute_grads_bytes": [-1] * n, "recompute_flops": [-1] * n,
           "recompute_accumulating_overhead_bytes": [-1] * n}
    for mode in OP_MODES:
        out.update({f"{mode}_held_bytes": [-1] * n, f"{mode}_flops": [0] * n,
                    f"{mode}_recompute_overhead_bytes": [0] * n, f"{mode}_recompute_grads_bytes": [-1] * n,
                    f"{mode}_recompute_accumulating_overhead_bytes": [-1] * n})
    out.update(offload_held_bytes=[-1] * n, offload_bytes=[0] * n, offload_overhead_bytes=[0] * n,
               offload_forward_overhead_bytes=[0] * n, offload_grads_bytes=[-1] * n)
    if not n or not modes:
        return out
    with _preserved_state(model, device):
        full = _checkpointed_peaks(model, rec.blocks, args, kwargs, batch, dev)
        full_flops = _recompute_flops(model, rec.blocks, args, kwargs, None)
    if full is None:
        return out
    # What a recompute holds only while it runs, unseen by MemTracker: its own nodes' wrapped numbers and
    # the CPU RNG state torch.random.fork_rng keeps around it (preserve_rng_state; checkpoint.recompute_fn).
    during = [w + _rng_state_bytes(device) for w in rec.scalars]
    (out["recompute_overhead_bytes"], out["recompute_grads_bytes"],
     out["recompute_accumulating_overhead_bytes"]) = _over_prediction(full, rec, att, batch_keys, [0] * n, during)
    if full_flops is not None:
        out["recompute_flops"] = full_flops
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
        (out[f"{mode}_recompute_overhead_bytes"], out[f"{mode}_recompute_grads_bytes"],
         out[f"{mode}_recompute_accumulating_overhead_bytes"]) = _over_prediction(peaks, rec, att, batch_keys,
                                                                                 extra, during)
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


def _offload_profile(model: nn.Module, rec: _StepRecorder, att: _Attribution, step: tuple[Any, Any, Any],
                     batch_keys: set[tuple[str, int]], device: torch.device, dev: torch.device,
                     full: list[tuple[int, ...]]) -> dict[str, list[int]]:
    """The ``"offload"`` side of every block, as :class:`BlockProfile` fields, from a sample step with every
    block offloaded into the host store in use (``recompute.host_store()``, counted per block): what each
    forward leaves on the device beyond full checkpointing's (its output), the bytes it moves, and its
    backward peak (the saved tensors back) over the prediction's prefix there. Empty when the step fails."""
    from distckpt.apply import recompute

    args, kwargs, batch = step
    stores = [_CountingStore(recompute.host_store()) for _ in rec.blocks]
    with _preserved_state(model, device):
        peaks = _checkpointed_peaks(model, rec.blocks, args, kwargs, batch, dev, stores=stores)
    if peaks is None:
        return {}
    left = [max(0, p[2] - f[2]) for p, f in zip(peaks, full)]
    # A block input that another part of the model saved first (a producer that saves its output) stays on
    # the device when that part is kept: counted held, as the none mode counts it in this block's bytes.
    kept = [sum(b for k, b in rec.input_keys[i].items() if k not in batch_keys and rec.first_saver.get(k, (i,))[0] != i)
            for i in range(rec.n)]
    # The prefix in that step: what the offloaded blocks before left on the device (their inputs are not kept).
    base = [att.pre + sum(left[:i]) + att.inner[i] + att.in_bytes[i] for i in range(rec.n)]
    return dict(offload_held_bytes=[a + b for a, b in zip(left, kept)], offload_bytes=[s.bytes for s in stores],
                offload_overhead_bytes=[p[0] - b for p, b in zip(peaks, base)],
                offload_forward_overhead_bytes=[p[4] - b for p, b in zip(peaks, base)],
                offload_grads_bytes=[p[1] for p in peaks])


def _grads_ready(rec: _StepRecorder, params: list[torch.Tensor], dev: torch.device) -> tuple[list[int], int]:
    """Gradient bytes present when each block's backward ends, and when the last block's begins (the
    head's backward is over by then): they grow monotonically during backward."""
    post_bw = compat.mem_tracker_states(post=True)

    def grads_at(stats: Any, state: Any) -> int:
        snaps = stats.snapshots.get(state, []) if stats is not None else []
        return max(((snap.get(dev) or {}).get("Gradient", 0) for snap in snaps), default=0)

    trainable = [p for p in params if p.requires_grad]
    all_grads = _distinct_bytes(trainable) if trainable else 0
    stats_of = [rec.tracker.memory_tracking.get(m) for _, m in rec.blocks]
    # Block i's backward is over once block i-1's begins; that snapshot also catches a parameter
    # gradient accumulated just after the hook at the end of block i's backward.
    ready = [
        max(grads_at(stats_of[i], post_bw[0]), grads_at(stats_of[i - 1], post_bw[1]) if i else 0) or all_grads
        for i in range(rec.n)
    ]
    head = grads_at(stats_of[-1], post_bw[1]) if rec.blocks else all_grads
    return ready, head


def step_device(model: nn.Module, batch: list[torch.Tensor]) -> torch.device:
    """Where a sample step of ``model`` on ``batch`` runs: its first parameter's device, else the batch's
    (else the CPU)."""
    first = next(iter(model.parameters()), None)
    if first is None and batch:
        first = batch[0]
    return first.device if first is not None else torch.device("cpu")


def parameter_fields(model: nn.Module, blocks: list[tuple[str, nn.Module]]) -> dict[str, int]:
    """The :class:`ModelProfile` fields counted from ``model``'s parameters and buffers, each storage once
    (tied weights once): the sample step's profile and ``distckpt plan``'s whole (uncut) model both use it."""
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    return dict(
        param_bytes=_distinct_bytes(params), trainable_bytes=_distinct_bytes(trainable),
        trainable_tensors=len({_storage_key(p) for p in trainable}),
        buffer_bytes=_distinct_bytes(list(model.buffers())),
        block_param_bytes=max((_distinct_bytes(list(m.parameters())) for _, m in blocks), default=0),
        # Optimizer temporaries are per trainable parameter: a frozen embedding (LoRA) makes none.
        max_param_bytes=max((_storage_bytes(p) for p in trainable), default=0),
        step_temp_bytes=adam_step_temp_bytes(trainable),
    )


def _measure(model: nn.Module, blocks: list[tuple[str, nn.Module]], example_inputs: Any,
             modes: frozenset[str] = frozenset(RECOMPUTE_MODES)) -> ModelProfile:
    """One sample step in passes: record (hooks + MemTracker + FLOPs), attribute saved storages to blocks,
    derive each block's and the head's overheads, measure recompute peaks in checkpointed steps (``modes``)."""
    args, kwargs = _as_args(example_inputs)
    batch = _tensors((args, kwargs))
    params = list(model.parameters())
    device = step_device(model, batch)
    batch_keys = {_storage_key(t) for t in batch}
    dev = device if device.type != "cuda" else torch.device("cuda", device.index or 0)

    rec = _StepRecorder(model, blocks)
    cuda_peak = rec.run(model, args, kwargs, batch, device)
    att = _attribute(rec, batch_keys)
    ov = _block_overheads(rec, att, dev)
    head = _head_and_tail(rec, model, att, ov["measured_blocks"], dev)
    redo = _recompute_profile(model, rec, att, args, kwargs, batch, batch_keys, device, dev, modes)
    ready, head_grads = _grads_ready(rec, params, dev)
    shared = _shared_inputs(rec, batch_keys)

    held = att.held
    profiles = tuple(
        BlockProfile(
            fqn=name, activation_bytes=held[i], forward_flops=int(rec.flops[i]), input_bytes=att.in_bytes[i],
            saved_input_bytes=att.saved_input[i], overhead_bytes=ov["overhead"][i],
            grads_ready_bytes=ready[i], forward_overhead_bytes=ov["overhead_fw"][i],
            backward_overhead_bytes=ov["overhead_bw"][i], grads_at_peak_bytes=ov["grads_peak"][i],
            scalar_saved_bytes=rec.scalars[i], accumulating_overhead_bytes=ov["accumulating"][i],
            end_overhead_bytes=ov["end"][i], shared_input_bytes=shared[i],
            **{k: v[i] for k, v in redo.items()},
        )
        for i, (name, _) in enumerate(blocks)
    )
    measured_total = head.pop("measured_total")
    return ModelProfile(
        blocks=profiles,
        **parameter_fields(model, blocks),
        batch_bytes=_distinct_bytes(batch),
        pre_bytes=att.pre,
        post_bytes=att.post,
        head_grads_bytes=head_grads,
        measured_peak_bytes=int(cuda_peak if device.type == "cuda" else measured_total),
        rng_state_bytes=_rng_state_bytes(device),
        scalar_saved_bytes=rec.outside_scalars,
        device=device.type,
        **head,
    )


def _rng_state_bytes(device: torch.device) -> int:
    """Bytes of RNG state that non-reentrant checkpoint saves per block in ``device``'s memory (see
    :attr:`ModelProfile.rng_state_bytes`): ``torch.get_rng_state()`` on the CPU; none on an accelerator
    (``torch.cuda.get_rng_state()`` is a 16-byte CPU tensor, the device memory holds nothing of it)."""
    if device.type != "cpu":
        return 0
    state = torch.get_rng_state()
    return state.numel() * state.element_size()


def adam_step_temp_bytes(params: list[torch.Tensor]) -> int:
    """The most memory Adam/AdamW's per-tensor step (``foreach=False``, CPU's default) holds in
    temporaries, for ``params`` in the optimizer's order (``model.parameters()``).

    For each parameter it computes ``denom = exp_avg_sq.sqrt() / c`` (two parameter-sized tensors
    at once), and the previous parameter's ``denom`` stays referenced by the loop variable until
    that assignment replaces it: ``max_k 2 * bytes_k + bytes_{k-1}``. Counting only twice the
    largest parameter fell 3% short of MemTracker's step peak on HF Llama, whose MLP weights
    (gate, up, down) are three equal largest parameters in a row.

    Returns:
        Bytes (0 without parameters).
    """
    sizes = list({_storage_key(p): _storage_bytes(p) for p in params}.values())
    return max((2 * b + (sizes[k - 1] if k else 0) for k, b in enumerate(sizes)), default=0)


def _agree(profile: ModelProfile) -> ModelProfile:
    """Make every rank use the same numbers (the largest any rank measured), so that every rank
    checkpoints the same blocks; a rank that chose differently would desynchronize DDP/FSDP."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return profile
    block_fields = [f.name for f in fields(BlockProfile) if f.name != "fqn"]
    model_fields = [f.name for f in fields(ModelProfile) if f.name not in ("blocks", "device")]
    values = [getattr(b, f) for b in profile.blocks for f in block_fields]
    values += [getattr(profile, f) for f in model_fields]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    agreed = t.tolist()
    k = len(block_fields)
    blocks = tuple(
        BlockProfile(b.fqn, **dict(zip(block_fields, agreed[i * k:(i + 1) * k]))) for i, b in enumerate(profile.blocks)
    )
    rest = dict(zip(model_fields, agreed[len(blocks) * k:]))
    return ModelProfile(blocks=blocks, device=profile.device, **rest)


# Per model: {(blocks, input shapes, training, world size): (the modes measured, the profile)}.
_CACHE: weakref.WeakKeyDictionary[nn.Module, dict[Any, tuple[frozenset[str], ModelProfile]]] = (
    weakref.WeakKeyDictionary())


def _cache_key(model: nn.Module, blocks: list[tuple[str, nn.Module]], example_inputs: Any) -> tuple[Any, ...]:
    """What a cached profile of ``model`` (:data:`_CACHE`, and the estimator's) is valid for: the block
    list, the input shapes, train/eval and the world size (a profile measured before the process group
    existed was not agreed between the ranks: a plan redone at parallelize must not use it as is)."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return tuple(name for name, _ in blocks), _signature(_as_args(example_inputs)), model.training, world


def _recompute_modes(modes: Any) -> frozenset[str]:
    """``modes`` as a set, with ``"full"`` added when an op-level mode is asked (its reference step).

    Raises:
        ConfigError: a mode not in :data:`PROFILE_MODES`.
    """
    wanted = frozenset(modes)
    bad = sorted(wanted - set(PROFILE_MODES))
    if bad:
        raise ConfigError(f"profile modes must be among {PROFILE_MODES}, got {bad}.")
    return wanted | {"full"} if wanted else wanted


def profile_model(model: nn.Module, blocks: list[tuple[str, nn.Module]], example_inputs: Any, *,
                  modes: Any = RECOMPUTE_MODES) -> ModelProfile:
    """Measure one training step (forward and backward, no checkpointing) of ``model`` on
    ``example_inputs`` and return what each block holds for backward and costs to recompute.

    Saved tensors are counted with ``torch.autograd.graph.saved_tensors_hooks`` by storage (shared
    storages once, parameters and buffers excluded); FLOPs with ``FlopCounterMode``; temporaries and
    the measured peak with ``MemTracker`` (and ``torch.cuda.max_memory_allocated`` on CUDA); for each
    recompute mode in ``modes``, two steps with every block checkpointed in that mode (one for memory,
    one for FLOPs) measure each block's recompute peak, what it holds and its recompute FLOPs. The
    model's gradients, buffers and RNG state are left as they were. Results are cached per model,
    block list and input shapes (a profile that measured more modes serves a request for fewer);
    under ``torch.distributed`` every rank gets the same numbers (the maximum over ranks, one
    ``all_reduce``: every rank must call it).

    Args:
        model: the model, with none of ``blocks`` checkpointed.
        blocks: the candidate blocks ``[(fqn, module), ...]`` in forward order.
        example_inputs: a tuple of positional arguments, a dict of keyword arguments, one tensor, or
            a :class:`Call` holding both.
        modes: the modes to measure, among :data:`PROFILE_MODES` (``"offload"`` only when asked; ``"full"`` is measured
            with any of them); only those a budget can choose (``Budget(selective=False)`` and
            reentrant checkpointing: ``("full",)``); ``()``: none (activations and FLOPs only).

    Returns:
        A :class:`ModelProfile` (a mode not measured has ``-1`` held bytes / gradient counts).

    Raises:
        ValueError: when the model's output holds nothing to call backward on.
        ConfigError: an unknown mode.
    """
    wanted = _recompute_modes(modes)
    key = _cache_key(model, blocks, example_inputs)
    cache = _CACHE.setdefault(model, {})
    measured, mp = cache.get(key, (frozenset(), None))
    if mp is None or not wanted <= measured:
        # Measure what was asked and what the cached profile had, so a later request for either is served.
        measured = wanted | measured
        mp = _agree(_measure(model, blocks, example_inputs, measured))
        cache[key] = (measured, mp)
        logger.info(
            "distckpt profile: %d blocks, %.1f MiB activations (%.1f MiB in blocks), %.3g GFLOP forward in blocks"
            " (recompute measured: %s)",
            len(blocks), mp.activation_bytes / 2**20, sum(b.activation_bytes for b in mp.blocks) / 2**20,
            sum(b.forward_flops for b in mp.blocks) / 1e9, ", ".join(sorted(measured)) or "none",
        )
    return mp


def profile_blocks(model: nn.Module, blocks: list[tuple[str, nn.Module]], example_inputs: Any, *,
                   modes: Any = RECOMPUTE_MODES) -> list[BlockProfile]:
    """Per-block part of :func:`profile_model` (same arguments, same cache).

    Returns:
        One :class:`BlockProfile` per block, in forward order.
    """
    return list(profile_model(model, blocks, example_inputs, modes=modes).blocks)
