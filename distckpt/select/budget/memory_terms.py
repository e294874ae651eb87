"""The budget's memory terms that no checkpointing choice changes, or that each phase of the step adds:
``static`` (parameters, gradients, optimizer state as the strategy places them), FSDP's per-phase
unsharded working set, gradient accumulation, and the per-block bounds the planner's choices start from.

The memory model they belong to is described in :mod:`distckpt.select.budget.program`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from distckpt.errors import ConfigError
from distckpt.options import SHARDED, STRATEGIES, check_shard_size
from distckpt.select.profile import BlockProfile, ModelProfile

__all__ = ["OPTIMIZER_STATES", "optimizer_terms", "shards", "static_bytes"]


# Optimizer state per parameter byte (AdamW: exp_avg and exp_avg_sq in the parameter's dtype).
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 0, "sgd_momentum": 1, "none": 0}


def shards(strategy: str, world_size: int, shard_size: int | None = None) -> int:
    """Into how many pieces ``strategy`` splits parameters, gradients and optimizer state: the world
    under FSDP/FSDP2, the ``"shard"`` dimension only under HSDP (replicated across the other), 1 else.

    Raises:
        ConfigError: ``"hsdp"`` without a ``shard_size`` that divides ``world_size``.
    """
    if strategy == "hsdp":
        if shard_size is None:
            raise ConfigError(
                "budget with strategy='hsdp' needs shard_size=N (the ranks that shard the parameters, "
                "usually one node's): Budget(size, strategy='hsdp', shard_size=N)."
            )
        check_shard_size(shard_size, max(1, world_size))
        return shard_size
    return max(1, world_size) if strategy in SHARDED else 1


def optimizer_terms(mp: ModelProfile, optimizer: str) -> tuple[int, int]:
    """``(states per trainable byte, bytes of per-parameter step scalars)`` that ``optimizer`` keeps.

    Raises:
        ConfigError: an optimizer not in :data:`OPTIMIZER_STATES`.
    """
    if optimizer not in OPTIMIZER_STATES:
        raise ConfigError(f"budget optimizer must be one of {sorted(OPTIMIZER_STATES)}, got {optimizer!r}.")
    # Adam/AdamW also keep one float32 ``step`` scalar per parameter (on CPU unless fused/capturable).
    return OPTIMIZER_STATES[optimizer], 4 * mp.trainable_tensors if optimizer in ("adam", "adamw") else 0


def static_bytes(
    mp: ModelProfile,
    *,
    strategy: str = "ddp",
    world_size: int = 1,
    optimizer: str = "adamw",
    shard_size: int | None = None,
) -> tuple[int, int]:
    """Memory that does not depend on the checkpointing choice.

    DDP keeps full replicas of parameters, gradients and optimizer state, plus its gradient buckets
    (one more gradient-sized buffer when ``world_size > 1``). FSDP/FSDP2 keep a ``1/world_size``
    shard of each (HSDP: ``1/shard_size``), plus the unsharded parameters outside the blocks (the
    root unit's, unsharded from its forward to its reduce-scatter); the blocks' unsharded parameters,
    gradients and collective buffers depend on the phase of the step (:func:`_sharded_terms`, added
    by :func:`_bounds`).

    Returns:
        ``(during forward/backward, during optimizer.step)`` in bytes, batch included.

    Raises:
        ConfigError: an unknown strategy or optimizer, or ``"hsdp"`` without a valid ``shard_size``.
    """
    if strategy not in STRATEGIES:
        raise ConfigError(f"budget strategy must be one of {STRATEGIES}, got {strategy!r}.")
    k, steps = optimizer_terms(mp, optimizer)
    ws = shards(strategy, world_size, shard_size) if strategy in SHARDED else max(1, world_size)
    params, grads = mp.param_bytes, mp.trainable_bytes
    if strategy in SHARDED:
        outside = max(0, params - mp.block_param_bytes * len(mp.blocks))
        local = (params + grads + k * grads) // ws + outside
        local_grads = grads // ws
    else:
        local = params + grads + k * grads + (grads if strategy == "ddp" and ws > 1 else 0)
        local_grads = grads
    # parallelize's SyncState (distckpt.parallel.param_sync) keeps two per-parameter tensors for the whole
    # run: the window's used bits (bool) and the gradients fired (int32), 5 B per trainable parameter.
    # MemTracker sees them only once an op touches them (the end of a backward): under accumulation that
    # is before the peak (the second micro-batch), where MultiTaskGPT under FSDP1 was 111-175 B under.
    sync = 5 * mp.trainable_tensors if strategy != "none" else 0
    base = local + steps + sync + mp.buffer_bytes + mp.batch_bytes
    # Optimizer step temporaries: foreach kernels on CUDA make a copy of the state list (sqrt of
    # exp_avg_sq); the per-tensor CPU path makes two of a parameter's size while the previous
    # parameter's denominator is still alive (profile.adam_step_temp_bytes).
    per_tensor = 2 * mp.max_param_bytes
    if optimizer in ("adam", "adamw") and mp.step_temp_bytes >= 0:
        per_tensor = mp.step_temp_bytes
    step_tmp = (local_grads if mp.device == "cuda" else per_tensor) if k else 0
    return base, base + step_tmp


@dataclass(frozen=True)
class _Sharded:
    """What FSDP (FSDP1) and FSDP2/HSDP hold beside the shards of :func:`static_bytes`, per phase of the
    step, with every candidate block its own unit and the root unit holding the rest (``parallelize``).

    Measured per module and phase with MemTracker on 2 gloo ranks (torch 2.13, the MultiTaskMLP,
    MultiTaskGPT and HF GPT-2 of ``benchmarks/budget_accuracy.py``) and read off the code
    (``torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py``: ``wait_for_unshard``,
    ``_backward_prefetch``, ``post_backward``; ``_fsdp_state.py``: ``_post_forward``,
    ``_root_post_backward_final_callback``):

    - a block's forward: its unsharded parameters (FSDP2: plus its all-gather output, kept as
      ``comm_ctx.all_gather_state`` until the next unit's copy-out, to overlap the two when
      ``world_size > 1``);
    - its backward: its unsharded parameters, the previous block's prefetched (the next in
      backward: none for the first block), FSDP2 the reduce-scatter input of the block whose
      backward came before (``reduce_scatter_states``, freed at the next unit's post-backward;
      none for the last block), and the gradients made so far unsharded: the block's own (partial)
      and the root unit's, which are reduce-scattered only at the end of backward;
    - the head (the root's forward after the last block, and its backward before the last
      block's): the last block's parameters, prefetched by the root's pre-backward (FSDP2: its
      all-gather output in the head's forward too);
    - the embeddings' backward (after every block's): FSDP2 the first block's reduce-scatter
      input, and the root's gradients unsharded; then the root's reduce-scatter, with its input.

    The Python path is the same on CUDA (the streams and events order the same frees); whether
    the caching allocator's cross-stream reuse keeps more alive there is unverified (no GPU here).
    """

    div: int
    forward: int
    backward: tuple[int, ...]
    head: int
    tail: int
    reduce: int

    def grads(self, unsharded: int) -> int:
        """Bytes to add for ``unsharded`` gradient bytes that :func:`static_bytes` counted as shards."""
        return unsharded - unsharded // self.div


def _own_grads(mp: ModelProfile) -> tuple[list[int], list[int]]:
    """Per block: the gradient bytes that existed when its backward began (the head's and the later
    blocks'), and its own gradient bytes (with ``grads_ready_bytes`` of the block after it)."""
    before = [b.grads_ready_bytes for b in mp.blocks[1:]] + [mp.head_grads_bytes]
    return before, [max(0, b.grads_ready_bytes - g) for b, g in zip(mp.blocks, before)]


def _sharded_terms(mp: ModelProfile, strategy: str, world_size: int, div: int) -> _Sharded | None:
    """FSDP's per-phase working set (see :class:`_Sharded`); ``None`` for DDP and one process."""
    if strategy not in SHARDED:
        return None
    two = strategy != "fsdp" and world_size > 1  # FSDP2 keeps the all-gather output and reduce-scatter inputs
    unit, n = mp.block_param_bytes, len(mp.blocks)
    _, own = _own_grads(mp)
    backward = tuple(unit + (unit if i else 0) + (own[i + 1] if two and i + 1 < n else 0) for i in range(n))
    root = max(0, mp.trainable_bytes - sum(own))  # the root unit's gradients
    return _Sharded(
        div=div,
        forward=(2 if two else 1) * unit,
        backward=backward,
        head=unit if n else 0,
        tail=own[0] if two and n else 0,
        reduce=root if two else 0,
    )


def _accumulated(
    mp: ModelProfile, static: int, fs: _Sharded | None, grad_accumulation: bool
) -> tuple[int, _Sharded | None]:
    """``static`` and the per-phase terms under gradient accumulation. Inside ``accumulate`` (FSDP1
    ``no_sync``, FSDP2 ``set_requires_gradient_sync(False)``) every block's gradients stay unsharded
    until the last micro-batch reduce-scatters them block by block: counted unsharded throughout (the
    peak, measured on 2 gloo ranks: the second micro-batch's forward end, every gradient unsharded
    and its activations held); the phases' unsharded parameters and collective buffers stay, their
    gradient terms go (``div=1``: nothing counted twice). DDP and one process: unchanged (``static``
    counts every gradient already)."""
    if fs is None or not grad_accumulation:
        return static, fs
    return static + fs.grads(mp.trainable_bytes), replace(fs, div=1)


def _unsplit_overhead(b: BlockProfile, mode: str | None, grad_accumulation: bool) -> int:
    """A block's overhead over its footprint when its backward peak is not split from its gradients:
    with gradient accumulation (every gradient exists throughout) the activations' own peak, where a
    new gradient is a temporary until its in-place add into the accumulated one (kept: measured in the
    sample step; checkpointed in ``mode``: in that mode's checkpointed step, the recompute included);
    else, or where not measured, the kept block's larger forward/backward overhead (its footprint
    bounds a checkpointed block's too)."""
    if grad_accumulation:
        own = b.accumulating_overhead_bytes if mode is None else b.recompute_accumulating(mode)
        if own >= 0:
            return own
    return b.overhead_bytes


def _settled(mp: ModelProfile, fs: _Sharded | None, div: int) -> list[int]:
    """Under FSDP/FSDP2 with gradient accumulation, per block: gradient bytes that ``static`` counts
    unsharded but that do not exist then, in either micro-batch that can peak there. In the last
    one (gradient sync on), the blocks after it in forward order have already been reduce-scattered
    (their shards stay, their unsharded gradients are freed); in an accumulating one, the blocks
    before it have no gradient yet (at least: the root's may have more missing). The peak is the
    larger of the two: the smaller of the two missing. Measured on HF GPT-2 (FSDP2, 2 ranks, every
    block checkpointed): the peak in the third block's backward, one block's gradients sharded."""
    if fs is None:
        return [0] * len(mp.blocks)
    _, own = _own_grads(mp)
    out = []
    for i in range(len(own)):
        later = sum(own[i + 1 :])
        out.append(min(sum(own[:i]), later - later // div))
    return out


def _flat_gradients(mp: ModelProfile, static: int, fs: _Sharded | None, absent: Any, settled: list[int]) -> list[int]:
    """FSDP1, per block: the end of its backward, when the block's parameter gradients (one autograd
    output per parameter view) are concatenated into its flat parameter's gradient
    (``SplitWithSizesBackward``: a ``cat``), both alive at once beside its and the prefetched block's
    unsharded parameters; with gradients accumulated (``no_sync``) the accumulated flat gradient too,
    until the in-place add. Measured on HF GPT-2 (FSDP1, 2 ranks, 2 micro-batches): the step's peak, at
    the last block's ``cat``, 72.6 KB above the block's backward peak counted otherwise. The activations
    then: ``end_overhead_bytes`` over what the blocks before hold (0 when not measured: no bound)."""
    if fs is None:
        return [0] * len(mp.blocks)
    before, own = _own_grads(mp)
    return [
        0
        if b.end_overhead_bytes < 0
        else static
        - settled[i]
        - absent(before[i])
        + mp.pre_bytes
        + b.end_overhead_bytes
        + 2 * own[i]
        + fs.backward[i]
        + fs.grads(mp.head_grads_bytes)
        for i, b in enumerate(mp.blocks)
    ]


def _phase_terms(
    mp: ModelProfile, static: int, strategy: str, world_size: int, shard_size: int | None, grad_accumulation: bool
) -> tuple[int, int, _Sharded | None]:
    """What every bound starts from: the shard count, ``static`` and the per-phase FSDP terms, both
    under gradient accumulation as :func:`_accumulated` counts them."""
    div = shards(strategy, world_size, shard_size)
    static, fs = _accumulated(mp, static, _sharded_terms(mp, strategy, world_size, div), grad_accumulation)
    return div, static, fs


def _bounds(mp: ModelProfile, static: int, *, recompute: str = "full", **kw: Any) -> tuple[list[int], list[int], int]:
    """:func:`mode_bounds` for one recompute mode: ``(plain, ckpt, end)``."""
    plain, ckpt, end, _ = mode_bounds(mp, static, (recompute,), **kw)
    return plain, ckpt[recompute], end


def mode_bounds(
    mp: ModelProfile,
    static: int,
    recompute: tuple[str, ...],
    *,
    strategy: str = "ddp",
    world_size: int = 1,
    grad_accumulation: bool = False,
    shard_size: int | None = None,
) -> tuple[list[int], dict[str, list[int]], int, list[int]]:
    """Per-block offsets with ``peak >= static + P_{i-1} + c_i`` when block i is kept (``plain``)
    and when it is checkpointed in each mode of ``recompute`` (``ckpt[mode]``; ``"selective"`` or
    ``"pointwise"``: that op-level recompute's measured peaks), the end offset
    (``peak >= static + P_{n-1} + end``), and per block FSDP1's flat-gradient bound
    (:func:`_flat_gradients`, 0 under other strategies), which every mode's bound includes; the terms
    every mode shares are computed once.

    ``static`` counts every gradient. Without gradient accumulation (``zero_grad(set_to_none=True)``,
    PyTorch's default), backward creates them block by block from the last: while block i runs its
    backward, the gradients of the blocks before it (and of the embeddings) do not exist yet: the
    profile measured which gradients exist at each block's backward peak and at the head's peak.
    Under FSDP/FSDP2 each phase adds what is unsharded then (:class:`_Sharded`).
    """
    div, static, fs = _phase_terms(mp, static, strategy, world_size, shard_size, grad_accumulation)
    before, _ = _own_grads(mp)

    def absent(grads: int) -> int:
        return 0 if grad_accumulation else max(0, mp.trainable_bytes - grads) // div

    def working(i: int, grads: int) -> int:  # FSDP's unsharded parameters, buffers and gradients at a backward peak
        return 0 if fs is None else fs.backward[i] + fs.grads(mp.head_grads_bytes + max(0, grads - before[i]))

    split = not grad_accumulation and all(b.grads_at_peak_bytes >= 0 for b in mp.blocks)
    settled = _settled(mp, fs, div) if grad_accumulation else [0] * len(mp.blocks)
    # FSDP1 accumulating: the root unit's new gradients made by the head (one autograd output per parameter
    # view, concatenated only at the end of the root's backward, after every block's) stay temporaries beside
    # the accumulated flat gradient through every block's backward (measured on MultiTaskGPT: 18.2 KB).
    views = mp.head_grads_bytes if strategy == "fsdp" and grad_accumulation else 0
    flat = _flat_gradients(mp, static + views, fs, absent, settled) if strategy == "fsdp" else [0] * len(mp.blocks)
    plain: list[int] = []
    ckpt: dict[str, list[int]] = {m: [] for m in recompute}
    for i, b in enumerate(mp.blocks):
        base = mp.pre_bytes + b.footprint_bytes
        fw = 0 if fs is None else fs.forward
        if not split:
            phases = (
                static
                + views
                - settled[i]
                - absent(b.grads_ready_bytes)
                + base
                + max(fw, working(i, b.grads_ready_bytes))
            )
            plain.append(max(flat[i], phases + _unsplit_overhead(b, None, grad_accumulation)))
            for m in recompute:
                ckpt[m].append(max(flat[i], phases + _unsplit_overhead(b, m, grad_accumulation)))
            continue
        # Measured split: the forward peak has no gradient yet; the backward peak has the gradients
        # that existed at that instant (pairing the largest activations with the gradients at the
        # end of the block's backward counts one block's gradients twice). A kept block's backward
        # peak is what was measured (its overhead may be negative: backward frees saved tensors as
        # it goes). A checkpointed block recomputes its forward at the start of its backward, while
        # the backward's own temporaries (the output's gradient) exist: its peak is measured in a
        # step with every block checkpointed (estimated from the first step's forward and backward
        # overheads when that step fails; the larger alone fell 512-10000 B short on HF models).
        at_peak = static - absent(b.grads_at_peak_bytes) + base + working(i, b.grads_at_peak_bytes)
        forward = static - absent(0) + base + b.forward_overhead_bytes + fw
        plain.append(max(forward, at_peak + b.backward_overhead_bytes, flat[i]))
        for m in recompute:
            grads, over = b.recompute_peak(m)
            if grads >= 0:
                # Measured in a sample step with every block checkpointed (its prefix: what they hold).
                redo = static - absent(grads) + base + over + working(i, grads)
            else:
                redo = at_peak + max(0, b.backward_overhead_bytes) + max(0, b.forward_overhead_bytes)
            # An offloaded block's forward moves its saved tensors out as it goes: its own measured peak.
            own = forward if m != "offload" else static - absent(0) + base + b.offload_forward_overhead_bytes + fw
            ckpt[m].append(max(own, redo, flat[i]))
    return plain, ckpt, _head_bound(mp, static, fs, absent, grad_accumulation), flat


def _head_bound(mp: ModelProfile, static: int, fs: _Sharded | None, absent: Any, grad_accumulation: bool) -> int:
    """:func:`mode_bounds`' end offset: the head's peak (between the last block's forward and its
    backward), ``static`` and ``fs`` as :func:`_phase_terms` made them, ``absent(grads)`` the gradient bytes
    ``static`` counts that do not exist yet."""
    head = mp.pre_bytes + mp.post_bytes
    grads, over = (
        (mp.head_grads_bytes, mp.head_overhead_bytes)
        if grad_accumulation or mp.head_peak_grads_bytes < 0
        # The head's forward (no gradient yet) and its backward up to the last block's: one
        # measured peak with the gradients that existed at that instant, instead of the
        # forward's largest activations paired with the gradients when the last block's
        # backward begins.
        else (mp.head_peak_grads_bytes, mp.head_peak_overhead_bytes)
    )
    end = static - absent(grads) + head + over + (0 if fs is None else fs.head + fs.grads(grads))
    return end


def tail_peak(
    mp: ModelProfile,
    static: int,
    step: int,
    *,
    strategy: str,
    world_size: int,
    grad_accumulation: bool,
    shard_size: int | None = None,
) -> int:
    """``step`` raised to the measured peak after every block's backward (the embeddings'), if any,
    and under FSDP2 to the root unit's reduce-scatter at the end of backward."""
    div, static, fs = _phase_terms(mp, static, strategy, world_size, shard_size, grad_accumulation)
    if fs is not None and fs.reduce:
        # Every block's gradients sharded, the root's unsharded and copied into the reduce-scatter input.
        step = max(step, static + fs.grads(fs.reduce) + fs.reduce)
    if mp.tail_grads_bytes < 0:
        return step
    absent = 0 if grad_accumulation else max(0, mp.trainable_bytes - mp.tail_grads_bytes) // div
    extra = 0
    if fs is not None:
        blocks = max(0, mp.blocks[0].grads_ready_bytes - mp.head_grads_bytes) if mp.blocks else 0
        extra = fs.tail + fs.grads(max(0, mp.tail_grads_bytes - blocks))
    # The wrapped numbers saved outside the blocks (the embeddings': see budget._choices) are alive until theirs runs.
    return max(step, static - absent + mp.tail_peak_bytes + extra + mp.scalar_saved_bytes)
