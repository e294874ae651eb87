"""Activation bytes and recompute cost per candidate block, measured on one sample training step.

Used by the ``budget`` policy (and the benchmarks) to predict peak memory for any choice of blocks.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from distckpt import _torch_compat as compat
from distckpt.errors import ConfigError
from distckpt.runtime.selective import OP_MODES
from distckpt.select.profile.agree import _agree
from distckpt.select.profile.recompute_passes import _recompute_profile
from distckpt.select.profile.recorder import (
    _attribute,
    _block_overheads,
    _grads_ready,
    _head_and_tail,
    _shared_inputs,
    _StepRecorder,
)
from distckpt.select.profile.sample_step import (
    _distinct_bytes,
    _rng_state_bytes,
    _storage_bytes,
    _storage_key,
    _tensors,
    memory_tracker,
    scalar_loss,
)

__all__ = [
    "PROFILE_MODES",
    "RECOMPUTE_MODES",
    "BlockProfile",
    "ModelProfile",
    "Call",
    "adam_step_temp_bytes",
    "as_args",
    "batch_tensors",
    "memory_tracker",
    "profile_blocks",
    "profile_model",
    "scalar_loss",
]

logger = logging.getLogger("distckpt")


@dataclass(frozen=True)
class BlockProfile:
    """What one block holds for backward and what recomputing it costs.

    Attributes:
        fqn: the block's name.
        activation_bytes: bytes the block keeps for backward when it is NOT checkpointed (distinct
            storages saved by its ops, parameters excluded), its saved input included.
        forward_flops: FLOPs of one forward of the block (``FlopCounterMode`` with CPU attention,
            :func:`distckpt.select.profile.flops.flop_counter`): the most a
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
            backward's temporaries exist), relative to the prefix of checkpointed inputs; at the peak of
            the block's own backward, which ends when another block's recompute begins (an input shared
            with earlier blocks, such as an encoder-decoder's encoder output, gets its last gradient in
            theirs: :class:`distckpt.select.profile.recompute_passes._OwnBackward`).
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
        recompute_ops: the op calls of the block's full recompute that count FLOPs, in the order they ran,
            as ``(op, index, bytes, FLOPs)``: ``op`` the aten overload's name, ``index`` which of its calls
            in one forward of the block, ``bytes`` its output's storages (what keeping that output holds,
            :class:`~distckpt.runtime.selective.KeepOps`), ``FLOPs`` what recomputing it costs. Their FLOPs
            add up to ``recompute_flops`` (the calls after the recompute's early stop never run, so they are
            not listed); ``()`` when not measured (then the budget makes no per-op choice for this block).
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
    recompute_ops: tuple[tuple[str, int, int, int], ...] = ()

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
        blocks: one :class:`BlockProfile` per candidate block, in the order given (see ``run_order``).
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
        run_order: the indices of :attr:`blocks` in the order their forward ran in the sample step,
            when that differs from the order they were given in (``()``: the same). ``blocks`` stay in the
            given order (a choice per block is indexed by it); the memory model takes them in this one.
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
    run_order: tuple[int, ...] = ()

    @property
    def activation_bytes(self) -> int:
        """Activations held for backward without any checkpointing (blocks and the rest)."""
        return self.pre_bytes + self.post_bytes + sum(b.activation_bytes for b in self.blocks)


@dataclass(frozen=True)
class Call:
    """Positional and keyword arguments of one forward call, as a sample batch."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]


def as_args(example_inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A sample batch (a :class:`Call`, a dict of keyword arguments, a tuple of positional ones, or one
    value) as ``(args, kwargs)``."""
    if isinstance(example_inputs, Call):
        return tuple(example_inputs.args), dict(example_inputs.kwargs)
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def _signature(value: Any) -> Any:
    leaves, spec = compat.tree_flatten(value)
    return str(spec), tuple(
        (tuple(t.shape), t.dtype, str(t.device)) if isinstance(t, torch.Tensor) else repr(t) for t in leaves
    )


def batch_tensors(example_inputs: Any) -> list[torch.Tensor]:
    """The tensors of a sample batch (positional and keyword arguments, at any nesting), in order."""
    return _tensors(as_args(example_inputs))


# The recompute modes a profile can measure, each in sample steps of its own ("full": plain recompute;
# the op-level ones: distckpt.runtime.selective.OP_MODES). The default set: "offload" (no recompute) is
# measured only when asked (a budget that may offer it: on CUDA), so a CPU profile costs nothing more.
RECOMPUTE_MODES = ("full", *OP_MODES)
PROFILE_MODES = (*RECOMPUTE_MODES, "offload")


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
        param_bytes=_distinct_bytes(params),
        trainable_bytes=_distinct_bytes(trainable),
        trainable_tensors=len({_storage_key(p) for p in trainable}),
        buffer_bytes=_distinct_bytes(list(model.buffers())),
        block_param_bytes=max((_distinct_bytes(list(m.parameters())) for _, m in blocks), default=0),
        # Optimizer temporaries are per trainable parameter: a frozen embedding (LoRA) makes none.
        max_param_bytes=max((_storage_bytes(p) for p in trainable), default=0),
        step_temp_bytes=adam_step_temp_bytes(trainable),
    )


def _measure(
    model: nn.Module,
    blocks: list[tuple[str, nn.Module]],
    example_inputs: Any,
    modes: frozenset[str] = frozenset(RECOMPUTE_MODES),
) -> ModelProfile:
    """One sample step in passes: record (hooks + MemTracker + FLOPs), attribute saved storages to blocks,
    derive each block's and the head's overheads, measure recompute peaks in checkpointed steps (``modes``)."""
    args, kwargs = as_args(example_inputs)
    batch = _tensors((args, kwargs))
    params = list(model.parameters())
    device = step_device(model, batch)
    batch_keys = {_storage_key(t) for t in batch}
    dev = device if device.type != "cuda" else torch.device("cuda", device.index or 0)

    rec = _StepRecorder(model, blocks)
    cuda_peak = rec.run(model, args, kwargs, batch, device)
    order = rec.run_order()
    if order:
        # Every term of the memory model follows the blocks in the order they run (what each holds
        # before the next, the head after the last, backward in reverse): measured in that order,
        # reported in the given one (run_order says how they ran). HF CLIP registers its text tower
        # first and runs its vision tower first: measured in registration order, its head window opened
        # after the last text block, in the middle of the forward, and a budget went over by 0.3-0.9%.
        mp = _measure(model, [blocks[j] for j in order], example_inputs, modes)
        ran = dict(zip(order, mp.blocks))
        return dataclasses.replace(mp, blocks=tuple(ran[i] for i in range(len(blocks))), run_order=order)
    att = _attribute(rec, batch_keys)
    ov = _block_overheads(rec, att, dev)
    head = _head_and_tail(rec, model, att, ov["measured_blocks"], dev)
    redo = _recompute_profile(model, rec, att, args, kwargs, batch, batch_keys, device, dev, modes)
    ready, head_grads = _grads_ready(rec, params, dev)
    shared = _shared_inputs(rec, batch_keys)

    held = att.held
    profiles = tuple(
        BlockProfile(
            fqn=name,
            activation_bytes=held[i],
            forward_flops=int(rec.flops[i]),
            input_bytes=att.in_bytes[i],
            saved_input_bytes=att.saved_input[i],
            overhead_bytes=ov["overhead"][i],
            grads_ready_bytes=ready[i],
            forward_overhead_bytes=ov["overhead_fw"][i],
            backward_overhead_bytes=ov["overhead_bw"][i],
            grads_at_peak_bytes=ov["grads_peak"][i],
            scalar_saved_bytes=rec.scalars[i],
            accumulating_overhead_bytes=ov["accumulating"][i],
            end_overhead_bytes=ov["end"][i],
            shared_input_bytes=shared[i],
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


# Per model: {(blocks, input shapes, training, world size): (the modes measured, the profile)}.
_CACHE: weakref.WeakKeyDictionary[nn.Module, dict[Any, tuple[frozenset[str], ModelProfile]]] = (
    weakref.WeakKeyDictionary()
)


def _cache_key(model: nn.Module, blocks: list[tuple[str, nn.Module]], example_inputs: Any) -> tuple[Any, ...]:
    """What a cached profile of ``model`` (:data:`_CACHE`, and the estimator's) is valid for: the block
    list, the input shapes, train/eval, the world size (a profile measured before the process group
    existed was not agreed between the ranks: a plan redone at parallelize must not use it as is) and the
    tensor-parallel parameters."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    # Tensor parallel applied since (DTensor parameters: the profile counts their local shards) is another model.
    tp = sum(isinstance(p, DTensor) for p in model.parameters())
    return tuple(name for name, _ in blocks), _signature(as_args(example_inputs)), model.training, world, tp


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


def profile_model(
    model: nn.Module, blocks: list[tuple[str, nn.Module]], example_inputs: Any, *, modes: Any = RECOMPUTE_MODES
) -> ModelProfile:
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
        blocks: the candidate blocks ``[(fqn, module), ...]``, in forward order or not (the profile
            is measured in the order they run, and kept in this one: ``ModelProfile.run_order``).
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
            len(blocks),
            mp.activation_bytes / 2**20,
            sum(b.activation_bytes for b in mp.blocks) / 2**20,
            sum(b.forward_flops for b in mp.blocks) / 1e9,
            ", ".join(sorted(measured)) or "none",
        )
    return mp


def profile_blocks(
    model: nn.Module, blocks: list[tuple[str, nn.Module]], example_inputs: Any, *, modes: Any = RECOMPUTE_MODES
) -> list[BlockProfile]:
    """Per-block part of :func:`profile_model` (same arguments, same cache).

    Returns:
        One :class:`BlockProfile` per block, in the order of ``blocks``.
    """
    return list(profile_model(model, blocks, example_inputs, modes=modes).blocks)
