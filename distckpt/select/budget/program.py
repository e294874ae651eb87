"""Choose the blocks to checkpoint so that peak training memory fits a byte budget, at the least
recompute: a peak-memory model built on the profile, and an exact Pareto dynamic program over blocks.

The memory model (all terms measured by :mod:`distckpt.select.profile` or counted from the parameters)::

    static   = params + grads + optimizer state (as the strategy places them) + buffers + batch
               (minus the gradients backward has not produced yet at that point)
    held_i   = activation_bytes_i (none), pointwise_held_bytes_i / selective_held_bytes_i (its input
               plus the op outputs it keeps), input_bytes_i plus the outputs of the op calls it keeps
               (ops: op_sets), input_bytes_i (full) or offload_held_bytes_i (offload: what it could
               not move to the host): one of six kinds of choice per block, a checkpointed
               one plus the RNG state it saves (rng_state_bytes: on the CPU); every one plus the
               Python numbers its autograd nodes saved (scalar_saved_bytes: on the CPU)
    P_i      = held_0 + ... + held_i                      (what the blocks keep, in the order they run)
    peak     = max( static + pre + P_{i-1} + footprint_i + overhead_i   for every block i,
                    static + pre + P_{n-1} + post + head_overhead,
                    static + the embeddings' backward (after every block's),
                    static + optimizer-step temporaries )

Under FSDP/FSDP2 ``static`` holds the shards, and each term adds what is unsharded in its phase (a
block's parameters, the prefetched block's, FSDP2's collective buffers, the gradients made so far:
:class:`~distckpt.select.budget.memory_terms._Sharded`). Those terms, ``static`` and the per-block bounds live in
:mod:`distckpt.select.budget.memory_terms`; this module chooses among the blocks' modes.

With gradient accumulation every gradient exists from the first micro-batch on, so a block's term
takes the activations' own peak of its backward (a new gradient is a temporary until its in-place add
into the accumulated one; measured per op in the sample step), FSDP/FSDP2 count the gradients
unsharded except those the last micro-batch has reduce-scattered already
(:func:`~distckpt.select.budget.memory_terms._settled`), and FSDP1 adds the concatenation of a unit's parameter
gradients into its flat gradient at the end of its backward
(:func:`~distckpt.select.budget.memory_terms._flat_gradients`, with or without accumulation). Inputs every
block takes (a mask, ``cache_position``) are held once however many checkpointed blocks keep them
(:func:`_shared`).

Each term pairs the activations measured at one instant with the gradients that existed then:
a block's forward peak (no gradient yet), its backward peak (``overhead_i`` is the measured one for
a kept block, the larger of its forward and backward ones for a checkpointed block, which
recomputes its forward there; a selective block's is measured in a step with every block selective),
and the head's peak (its forward and backward, between the last
block's forward and its backward). On the sample step with no block checkpointed the model is exact.

Every term takes the blocks in the order their forwards ran in the sample step
(:attr:`~distckpt.select.profile.ModelProfile.run_order`), which need not be the order they were
registered and are given in: HF CLIP registers its text tower first and runs its vision tower first.

The block being run (or recomputed) holds its footprint whatever the choice, so each block puts an
upper bound on the prefix ``P_{i-1}`` (one for each choice of that block); the program keeps, block
after block, every non-dominated (bytes held, recompute FLOPs) pair that meets those bounds. The
recompute FLOPs of a choice are measured (``FlopCounterMode`` around each recompute): ``full`` re-runs
the block's forward (up to where backward has what it needs), ``selective`` only its pointwise ops and
every other matmul, ``pointwise`` only the ops that count no FLOPs (it keeps every matmul, attention
and convolution output: 0 FLOPs measured on GPT-2, at less memory than no checkpointing), so between
the modes for every block there are placements that hold less than one mode everywhere at less
recompute than the next one everywhere. ``offload`` recomputes nothing; its cost on the same scale is
the bytes it moves to the host and back times ``offload_flops_per_byte`` (:func:`_transfer_cost`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from distckpt.errors import ConfigError
from distckpt.runtime.selective import KEEP_MODE, OP_MODES, KeepOps
from distckpt.runtime.swap import CHECKPOINT_MODES
from distckpt.select.budget.memory_terms import mode_bounds, static_bytes, tail_peak
from distckpt.select.budget.op_sets import keep_sets
from distckpt.select.profile import ModelProfile

__all__ = ["MODES", "BudgetPlan", "human_bytes", "plan_budget", "predicted_peak"]

# What the planner chooses from for each block, by code, in order of decreasing memory (but "offload" and
# "ops", appended): "pointwise" keeps every matmul/attention/conv output and recomputes only
# the FLOP-free ops, "selective" recomputes every other matmul too, "full" the whole block.
MODES = CHECKPOINT_MODES  # ("none", "pointwise", "selective", "full", "offload", "ops")
_FULL = MODES.index("full")
_OFFLOAD = MODES.index("offload")  # not recomputed: its saved tensors go to host memory (CUDA)
_OPS = MODES.index(KEEP_MODE)  # the outputs of the op calls a KeepOps names kept (op_sets), the rest recomputed
# The recomputed modes keep the block's inputs on the device (a checkpoint holds them): see _shared.
_KEEPS_INPUTS = frozenset(MODES.index(m) for m in ("pointwise", "selective", "full", KEEP_MODE))

# Above this many (bytes, FLOPs) states per block, states closer than budget/_MAX_STATES bytes are
# merged (the one with fewer FLOPs is kept, its bytes exact): the budget is still never exceeded,
# and the FLOPs lost are bounded by that grid (well under 1% in the tests against brute force).
_MAX_STATES = 4096


def human_bytes(n: float) -> str:
    """``n`` bytes in GiB (3 decimals) from 1 GiB up, else in MiB (2 decimals)."""
    return f"{n / 2**30:.3f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.2f} MiB"


@dataclass(frozen=True)
class BudgetPlan:
    """The outcome of :func:`plan_budget`.

    Attributes:
        selected: indices of the blocks to checkpoint (in any mode but none).
        peak_bytes: predicted peak training memory with that choice.
        recompute_flops: the chosen blocks' measured recompute FLOPs.
        min_budget_bytes: the smallest budget any choice fits in.
        modes: per block, one of :data:`MODES` (``"none"``, ``"pointwise"``, ``"selective"``, ``"full"``,
            ``"offload"``, ``"ops"``).
        moved_bytes: bytes the offloaded blocks move over the host link per step (device to host in
            forward plus host to device in backward).
        transfer_flops: the transfers' FLOP-equivalent (``moved_bytes`` times ``offload_flops_per_byte``).
        offload_flops_per_byte: the ratio the transfers were costed at (``None``: offload not offered).
        keep: per block, the :class:`~distckpt.runtime.selective.KeepOps` of an ``"ops"`` block (the op
            calls whose outputs it keeps), ``None`` for every other mode.
    """

    selected: tuple[int, ...]
    peak_bytes: int
    recompute_flops: int
    min_budget_bytes: int
    modes: tuple[str, ...] = ()
    moved_bytes: int = 0
    transfer_flops: int = 0
    offload_flops_per_byte: float | None = None
    keep: tuple[KeepOps | None, ...] = ()

    def mode_of(self, i: int) -> str | KeepOps:
        """Block ``i``'s mode as ``wrap`` applies it: its :class:`KeepOps` for ``"ops"``, else the mode's name."""
        return self.keep[i] if self.keep and self.keep[i] is not None else self.modes[i]

    @property
    def placement(self) -> tuple[str | KeepOps, ...]:
        """One mode per block as ``wrap`` applies it (:meth:`mode_of`): for ``Placement``, :func:`predicted_peak`."""
        return tuple(self.mode_of(i) for i in range(len(self.modes)))

    @property
    def offloaded(self) -> tuple[int, ...]:
        """Indices of the blocks in the ``"offload"`` mode."""
        return tuple(i for i, m in enumerate(self.modes) if m == "offload")

    @property
    def cost_flops(self) -> int:
        """What the plan minimised: recompute FLOPs plus the transfers' FLOP-equivalent."""
        return self.recompute_flops + self.transfer_flops


class Choice(NamedTuple):
    """One block's choice: the bytes it holds, the bound it puts on the bytes held before it, its recompute
    FLOPs (the program's cost), its code in :data:`MODES`, its ``floor`` (the part of the bound that inputs
    an earlier checkpointed block holds do not lower: see :func:`_shared`), and for ``"ops"`` the kept calls."""

    held: int
    bound: int
    cost: int
    code: int
    floor: int
    keep: tuple[tuple[str, int], ...] = ()


def _transfer_cost(nbytes: int, flops_per_byte: float | None) -> int:
    """The ``"offload"`` mode's cost on the program's FLOP scale: ``nbytes`` go to the host in forward and
    come back in backward, each byte worth ``flops_per_byte`` FLOPs of link time (the device's matmul
    FLOP/s over the link's bytes/s: :mod:`distckpt.select.profile.transfer`)."""
    return round(2 * nbytes * flops_per_byte) if flops_per_byte else 0


def _offload_choice(b: Any, bound: int, w: int, outside: int, flops_per_byte: float | None, floor: int) -> Choice:
    """An offloaded block: it holds on the device only what it could not move (measured), and in its
    backward its saved tensors come back (its measured peak, ``bound``); no RNG state (no checkpoint)."""
    return Choice(
        b.offload_held_bytes + w,
        bound + w + outside,
        _transfer_cost(b.offload_bytes, flops_per_byte),
        _OFFLOAD,
        floor + w + outside,
    )


def _keep_bound(b: Any, i: int, bounds: dict[str, list[int]], op_modes: tuple[str, ...]) -> int | None:
    """The bound of an ``"ops"`` block ``i``: the largest of full's and the measured op-level modes' (its
    recompute materialises what a full one does: the outputs it kept plus everything it re-runs; each mode's
    bound is a measured backward peak with every block in that mode). ``None``: no op-level mode was measured
    on this block (its op-level step failed, or the budget offers none), so no per-op choice."""
    measured = [m for m in op_modes if b.mode_held_flops(m)[0] >= 0]
    return max(bounds[m][i] for m in ("full", *measured)) if measured and b.recompute_ops else None


def _keep_choice(b: Any, calls: tuple[tuple[str, int], ...], bound: int, extra: int, floor: int) -> Choice:
    """Block ``b`` keeping the outputs of ``calls`` (each in its :attr:`recompute_ops`): its input and those
    outputs held, full's recompute less their FLOPs. ``extra``: what every checkpointed choice adds (the RNG
    state, the wrapped numbers).

    Raises:
        ConfigError: a call the profile did not see in the block's recompute.
    """
    cost = {(name, index): (nbytes, flops) for name, index, nbytes, flops in b.recompute_ops}
    missing = [c for c in calls if c not in cost]
    if missing:
        raise ConfigError(
            f"{b.fqn}: KeepOps names {missing}, which its recompute does not run as FLOP-counting calls (known: "
            f"{sorted(cost)}); keep only those (or use another mode for this block)."
        )
    nbytes = sum(cost[c][0] for c in calls)
    return Choice(
        b.input_bytes + nbytes + extra,
        bound + extra,
        max(0, b.full_flops - sum(cost[c][1] for c in calls)),
        _OPS,
        floor + extra,
        tuple(sorted(calls)),
    )


def _choices(
    mp: ModelProfile,
    static: int,
    *,
    selective: bool = True,
    offload_flops_per_byte: float | None = None,
    per_op: bool = True,
    given: list[tuple[tuple[str, int], ...] | None] | None = None,
    **kw: Any,
) -> tuple[list[list[Choice]], int]:
    """Per block, what each choice holds, the bound it puts on the bytes held before it and its
    recompute FLOPs (the op-level modes where the profile measured them and ``selective`` allows
    them); and the end offset (see :func:`~distckpt.select.budget.memory_terms._bounds`). A checkpointed
    block also holds the RNG state its checkpoint saved (``preserve_rng_state``:
    ``wrap(preserve_rng_state=False)`` plans on a profile with ``rng_state_bytes=0``,
    :meth:`Candidates.model_profile`). Per block, not once: every block's state lives from its
    forward to its backward (``full`` on HF GPT-2 peaks in the first block's backward, once the later
    blocks' states are freed: one state counted there, as measured; ``selective`` peaks where every
    block's state is alive: 8 measured).

    Every block, in every mode, also holds its wrapped numbers (``scalar_saved_bytes``: Python numbers
    autograd saved as 8-byte CPU tensors, 24 B per HF GPT-2 block) from its forward to its backward,
    as does the rest of the model (``ModelProfile.scalar_saved_bytes``, in every term of backward):
    the CPU allocator holds them, MemTracker (which measured every other term) does not see them. Without
    them the smallest budget accepted on HF GPT-2 (full's allocator peak less 24 B) was exceeded by 24 B.

    ``"offload"`` is a choice wherever the profile measured it, its cost the transfer's FLOP-equivalent
    at ``offload_flops_per_byte`` (``None``: 0, for a prediction; :func:`plan_budget` offers it only with
    a ratio).

    ``"ops"`` (where the profile listed the block's recompute ops and measured an op-level mode, with
    ``selective``): with ``per_op``, one choice per point of the block's front of kept calls
    (:func:`~distckpt.select.budget.op_sets.keep_sets`), plus ``given[i]``'s kept calls (a prediction of a
    hand-placed :class:`KeepOps`); its bound :func:`_keep_bound`.

    Each choice's ``floor``: FSDP1's flat-gradient bound (``memory_terms._flat_gradients``, the end of the
    block's backward), which the shared inputs do not lower (:func:`_shared`): it does not count them
    (they are counted once, in the earlier checkpointed block's held input), so subtracting them there
    counted them zero times. Lowered by them too, HF GPT-2 under FSDP1 (2 ranks, every other or every
    block checkpointed, peak at a checkpointed block's gradient concatenation) was predicted 184-276 B
    under the measured peak (640 B short: its mask and ``cache_position``); now 364-412 B over, as with
    no block checkpointed."""
    op_modes = OP_MODES if selective else ()
    offload = ("offload",) if any(b.offload_held_bytes >= 0 for b in mp.blocks) else ()
    plain, bounds, end, flat = mode_bounds(mp, static, ("full", *op_modes, *offload), **kw)
    rng, outside = mp.rng_state_bytes, mp.scalar_saved_bytes
    out = []
    for i, b in enumerate(mp.blocks):
        w = b.scalar_saved_bytes
        options = [Choice(b.activation_bytes + w, plain[i] + w + outside, 0, 0, flat[i] + w + outside)]
        for mode in op_modes:
            held, flops = b.mode_held_flops(mode)
            if held >= 0:
                options.append(
                    Choice(
                        held + rng + w,
                        bounds[mode][i] + rng + w + outside,
                        flops,
                        MODES.index(mode),
                        flat[i] + rng + w + outside,
                    )
                )
        options.append(
            Choice(
                b.input_bytes + rng + w,
                bounds["full"][i] + rng + w + outside,
                b.full_flops,
                _FULL,
                flat[i] + rng + w + outside,
            )
        )
        if offload and b.offload_held_bytes >= 0:
            options.append(_offload_choice(b, bounds["offload"][i], w, outside, offload_flops_per_byte, flat[i]))
        bound = _keep_bound(b, i, bounds, op_modes)
        if bound is not None:
            sets = [calls for calls, *_ in keep_sets(b.recompute_ops)] if per_op else []
            for calls in [*sets, *([given[i]] if given and given[i] is not None else [])]:
                options.append(_keep_choice(b, calls, bound + outside, rng + w, flat[i] + outside))
        out.append(options)
    return out, end + outside


def _codes(mp: ModelProfile, choice: Any) -> list[tuple[int, tuple[tuple[str, int], ...] | None]]:
    """A per-block choice as ``(code into MODES, kept calls)`` pairs (calls only for ``"ops"``): a mapping
    ``{index: mode}`` (absent: none), a sequence of one mode per block, or (the original form) the indices of
    the fully checkpointed blocks. A mode is a name of :data:`MODES` or a :class:`KeepOps`.

    Raises:
        ConfigError: an unknown mode, or an op-level mode on a block whose profile did not measure it.
    """
    n = len(mp.blocks)
    if isinstance(choice, Mapping):
        modes = [choice.get(i, "none") for i in range(n)]
    elif isinstance(choice, (list, tuple)) and len(choice) == n and all(isinstance(m, (str, KeepOps)) for m in choice):
        modes = list(choice)
    else:
        full = set(choice)
        modes = ["full" if i in full else "none" for i in range(n)]
    out: list[tuple[int, tuple[tuple[str, int], ...] | None]] = []
    for i, m in enumerate(modes):
        if isinstance(m, KeepOps):
            if not mp.blocks[i].recompute_ops or all(mp.blocks[i].mode_held_flops(o)[0] < 0 for o in OP_MODES):
                raise ConfigError(
                    f"block {i} ({mp.blocks[i].fqn}): the profile has no per-op measurement (its recompute's ops "
                    "or an op-level sample step); choose none or full for it, or profile with the op-level modes."
                )
            out.append((_OPS, m.calls))
            continue
        if m not in MODES or m == KEEP_MODE:
            raise ConfigError(
                f"block {i}: checkpoint mode must be one of {MODES[:-1]} or a KeepOps (the ops mode: which op calls "
                f"it keeps), got {m!r}; a plan's modes with their KeepOps are BudgetPlan.placement."
            )
        if m in (*OP_MODES, "offload") and mp.blocks[i].mode_held_flops(m)[0] < 0:
            raise ConfigError(
                f"block {i} ({mp.blocks[i].fqn}): the profile has no {m} measurement (its {m} "
                "sample step failed, or the profile was made without that mode); choose none or "
                "full for it, or profile with that mode (profile_model(..., modes=...))."
            )
        out.append((MODES.index(m), None))
    return out


def predicted_peak(
    mp: ModelProfile,
    selected: Any,
    *,
    strategy: str = "ddp",
    world_size: int = 1,
    optimizer: str = "adamw",
    grad_accumulation: bool = False,
    shard_size: int | None = None,
) -> int:
    """Peak training memory (bytes) that the memory model predicts for a per-block choice (see the
    module docstring); ``shard_size``: the ranks that shard under ``"hsdp"``.

    Args:
        mp: the profile.
        selected: the indices of the fully checkpointed blocks (a list, set or range), or a mapping
            ``{index: mode}`` (a mode of :data:`MODES` or a :class:`KeepOps`; blocks not in it: none), or one
            mode per block.

    Returns:
        The predicted peak in bytes.
    """
    kw = dict(strategy=strategy, world_size=world_size, shard_size=shard_size)
    given = _codes(mp, selected)
    mp, order = _run_ordered(mp)
    given = [given[j] for j in order]
    static, step = static_bytes(mp, optimizer=optimizer, **kw)
    options, end = _choices(
        mp, static, grad_accumulation=grad_accumulation, per_op=False, given=[k for _, k in given], **kw
    )
    step = tail_peak(mp, static, step, grad_accumulation=grad_accumulation, **kw)
    prefix, peak, holds = 0, step, False
    for opts, (code, calls), shared in zip(options, given, _shared(mp)):
        o = next(o for o in opts if o.code == code and (calls is None or o.keep == calls))
        d = shared if holds else 0  # an earlier checkpointed block holds these inputs already
        peak = max(peak, prefix + max(o.bound - d, o.floor))
        prefix += o.held - (d if code in _KEEPS_INPUTS else 0)
        holds = holds or code in _KEEPS_INPUTS
    return max(peak, prefix + end)


def _run_ordered(mp: ModelProfile) -> tuple[ModelProfile, tuple[int, ...]]:
    """``mp`` with its blocks in the order they ran (:attr:`ModelProfile.run_order`), the order every
    term of the memory model follows, and that order: block ``k`` of the result is block ``order[k]`` of
    ``mp``, whose order a choice per block is given and returned in."""
    if not mp.run_order:
        return mp, tuple(range(len(mp.blocks)))
    return dataclasses.replace(mp, blocks=tuple(mp.blocks[j] for j in mp.run_order), run_order=()), mp.run_order


def _shared(mp: ModelProfile) -> list[int]:
    """Per block, the input bytes every earlier block takes too (``BlockProfile.shared_input_bytes``:
    HF GPT-2's ``cache_position``, Llama's mask and rotary tables): once a block recomputed in any
    mode (:data:`_KEEPS_INPUTS`; not ``offload``) holds them, a later block's bound and a later
    recomputed block's held bytes count them again unless they subtract these. Counted per block,
    all-``pointwise``/``selective`` on HF GPT-2 (8 blocks, peak in the last one's backward) was
    predicted 7 x 1024 B above the measured peak."""
    return [b.shared_input_bytes for b in mp.blocks]


def _fits(options: list[list[Choice]], end: int, step: int, budget: int, shared: list[int]) -> bool:
    """Whether some choice fits ``budget``: every bound caps the bytes held before it, so the
    fewest bytes held that meet the bounds so far is the only state that matters, once for the
    prefixes where no block is checkpointed yet and once for those with one (:func:`_shared`)."""
    if step > budget:
        return False
    best = {False: 0}  # does some block hold the shared inputs -> the fewest bytes held
    for opts, d in zip(options, shared):
        nxt: dict[bool, int] = {}
        for holds, p in best.items():
            dd = d if holds else 0
            for h, bound, _, code, floor, _ in opts:
                if p <= budget - max(bound - dd, floor):
                    keeps = code in _KEEPS_INPUTS
                    key, q = holds or keeps, p + h - (dd if keeps else 0)
                    nxt[key] = min(nxt.get(key, q), q)
        if not nxt:
            return False
        best = nxt
    return min(best.values()) <= budget - end


def _min_peak(options: list[list[Choice]], end: int, step: int, shared: list[int]) -> int:
    """The smallest predicted peak over every choice of blocks (a search over the budget)."""
    full = [next(o for o in opts if o.code == _FULL) for opts in options]
    hi = max(
        step,
        *(full[i].bound + sum(o.held for o in full[:i]) for i in range(len(full))),
        sum(o.held for o in full) + end,
    )  # checkpointing every block fits this
    lo = step
    if _fits(options, end, step, lo, shared):
        return lo
    while hi - lo > 1:  # invariant: lo does not fit, hi fits
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if _fits(options, end, step, mid, shared) else (mid, hi)
    return hi


def _pareto(p: torch.Tensor, f: torch.Tensor, quantum: int) -> torch.Tensor:
    """Indices of the (bytes, FLOPs) states on the Pareto front, sorted by bytes: a state stays only
    if it needs fewer FLOPs than every state holding fewer bytes; above ``_MAX_STATES`` states, one
    per ``quantum`` bytes (the one with the fewest FLOPs) and the fewest-bytes state stay."""
    if not len(p):
        return torch.zeros(0, dtype=torch.int64)
    order = torch.argsort(f, stable=True)
    order = order[torch.argsort(p[order], stable=True)]
    p, f = p[order], f[order]
    best_before = torch.cat([torch.tensor([torch.iinfo(torch.int64).max]), torch.cummin(f, 0).values[:-1]])
    front = f < best_before
    if int(front.sum()) > _MAX_STATES:
        # Within a grid cell the front's last state has the fewest FLOPs: keep that one.
        idx = front.nonzero().flatten()
        cells = p[idx] // quantum
        last = torch.ones(len(idx), dtype=torch.bool)
        last[:-1] = cells[1:] != cells[:-1]
        front = torch.zeros_like(front)
        front[idx[last]] = True
        front[idx[0]] = True  # the fewest-bytes state always stays, so a feasible path survives
    return order[front.nonzero().flatten()]


def _costs(options: list[list[Choice]]) -> list[list[Choice]]:
    """The choices with the program's cost in place of their FLOPs: recompute FLOPs first and, at equal
    FLOPs, fewer checkpointed blocks. A ``pointwise`` recompute counts 0 FLOPs but still takes time
    (it re-runs the pointwise ops): without the tie-break a budget that fits no checkpointing would
    get every block ``pointwise`` (fewer bytes at the same FLOPs). Both fit one int64 (FLOPs times
    ``blocks + 1`` plus the count) unless the FLOPs are near 2**62 / blocks; then FLOPs alone."""
    scale = len(options) + 1
    if (sum(max(o.cost for o in opts) for opts in options) + 1) * scale >= 2**62:
        return options
    return [[o._replace(cost=o.cost * scale + (o.code != 0)) for o in opts] for opts in options]


def _cheapest(options: list[list[Choice]], end: int, budget: int, shared: list[int]) -> list[int]:
    """The Pareto dynamic program of :func:`plan_budget`: per block, the index in its ``options`` of the
    cheapest choice (see :func:`_costs`) that fits ``budget``, which some choice must (:func:`_min_peak`)."""
    p = torch.zeros(1, dtype=torch.int64)  # bytes held by the blocks so far
    f = torch.zeros(1, dtype=torch.int64)  # cost so far: recompute FLOPs, then checkpointed blocks (_costs)
    g = torch.zeros(1, dtype=torch.bool)  # some block checkpointed so far: it holds the shared inputs (_shared)
    trail: list[tuple[torch.Tensor, torch.Tensor]] = []  # per block: (parent index, index of the choice)
    quantum = max(1, budget // _MAX_STATES)
    for opts, d in zip(_costs(options), shared):
        # Each choice of block i bounds the bytes held before it; the states that meet it go on with it.
        dd = g.long() * d
        parts = [
            ((p <= budget - (o.bound - dd).clamp(min=o.floor)).nonzero().flatten(), k, o) for k, o in enumerate(opts)
        ]
        parent = torch.cat([ok for ok, *_ in parts])
        which = torch.cat([torch.full((len(ok),), k, dtype=torch.int32) for ok, k, _ in parts])
        p = torch.cat([p[ok] + o.held - (dd[ok] if o.code in _KEEPS_INPUTS else 0) for ok, _, o in parts])
        f = torch.cat([f[ok] + o.cost for ok, _, o in parts])
        g = torch.cat([g[ok] | (o.code in _KEEPS_INPUTS) for ok, _, o in parts])
        # A state holding the shared inputs owes less later: the fronts of the two kinds are kept apart.
        kinds = ((~g).nonzero().flatten(), g.nonzero().flatten())
        sel = torch.cat([idx[_pareto(p[idx], f[idx], quantum)] for idx in kinds])
        sel = sel[torch.argsort(p[sel], stable=True)]
        p, f, g = p[sel], f[sel], g[sel]
        trail.append((parent[sel], which[sel]))
    ok = (p <= budget - end).nonzero().flatten()
    assert len(ok), "the cheapest choice fits, so some state must"  # internal invariant
    best = int(ok[torch.argmin(f[ok])])  # the front is sorted by bytes: argmin keeps the fewest bytes on ties
    chosen = [0] * len(options)
    for i in range(len(options) - 1, -1, -1):
        parent, which = trail[i]
        chosen[i] = int(which[best])
        best = int(parent[best])
    return chosen


def plan_budget(
    mp: ModelProfile,
    budget: int,
    *,
    strategy: str = "ddp",
    world_size: int = 1,
    optimizer: str = "adamw",
    grad_accumulation: bool = False,
    shard_size: int | None = None,
    selective: bool = True,
    offload_flops_per_byte: float | None = None,
    per_op: bool = True,
) -> BudgetPlan:
    """The per-block choice (none, pointwise, selective, ops, full or offload) with the least recompute FLOPs
    (plus transfers' FLOP-equivalent) whose predicted peak is <= ``budget``.

    Exact (a Pareto dynamic program over (bytes held, FLOPs) per block prefix; at equal FLOPs the
    fewest checkpointed blocks) up to the merging of
    states closer than ``budget / 4096`` bytes when more than 4096 remain. ``selective=False``
    chooses between none and full only (as for reentrant checkpointing, which takes no op policy);
    otherwise the op-level modes (``pointwise``, ``selective``) too, where the profile measured them, and
    with ``per_op`` the per-op choice (``"ops"``: which FLOP-counting op calls' outputs a block keeps,
    :mod:`~distckpt.select.budget.op_sets`) where it also listed the block's recompute ops.
    ``offload_flops_per_byte`` (a positive float) offers ``offload`` where the profile measured it, each
    byte moved (device to host and back) costing that many FLOPs; ``None`` or ``math.inf``: not offered.

    Returns:
        A :class:`BudgetPlan`.

    Raises:
        ConfigError: when no choice fits, naming the smallest budget that does.
    """
    where = dict(strategy=strategy, world_size=world_size, shard_size=shard_size)
    given, (mp, order) = mp, _run_ordered(mp)  # the program runs over the blocks in run order
    static, step = static_bytes(mp, optimizer=optimizer, **where)
    if offload_flops_per_byte is not None and not offload_flops_per_byte > 0:
        raise ConfigError(
            f"offload_flops_per_byte must be a positive number (FLOPs per byte moved), got "
            f"{offload_flops_per_byte!r}; None: offload not offered."
        )
    if offload_flops_per_byte is not None and math.isinf(offload_flops_per_byte):
        offload_flops_per_byte = None  # priced out: not offered
    options, end = _choices(
        mp,
        static,
        selective=selective,
        grad_accumulation=grad_accumulation,
        offload_flops_per_byte=offload_flops_per_byte,
        per_op=per_op,
        **where,
    )
    if offload_flops_per_byte is None:
        options = [[o for o in opts if o.code != _OFFLOAD] for opts in options]
    step = tail_peak(mp, static, step, grad_accumulation=grad_accumulation, **where)
    shared = _shared(mp)
    min_budget = _min_peak(options, end, step, shared)
    if budget < min_budget:
        raise ConfigError(
            f"no choice of checkpointed blocks fits budget {human_bytes(budget)} ({budget} bytes): the smallest "
            f"peak is {human_bytes(min_budget)} ({min_budget} bytes; parameters, gradients and {optimizer} state "
            f"under {strategy} with world size {world_size} take {human_bytes(static)}). Use budget:{min_budget} or "
            "more, shard with FSDP, or use a smaller batch."
        )
    ran = [opts[k] for opts, k in zip(options, _cheapest(options, end, budget, shared))]
    chosen: list[Choice] = [ran[0]] * len(ran)
    for k, j in enumerate(order):
        chosen[j] = ran[k]
    modes = tuple(MODES[o.code] for o in chosen)
    kept = tuple(KeepOps(o.keep) if o.code == _OPS else None for o in chosen)  # KeepOps sorts: the same calls
    placed = [k or m for m, k in zip(modes, kept)]
    peak = predicted_peak(given, placed, optimizer=optimizer, grad_accumulation=grad_accumulation, **where)
    assert peak <= budget, (peak, budget)
    moved = 2 * sum(b.offload_bytes for b, o in zip(mp.blocks, ran) if o.code == _OFFLOAD)
    return BudgetPlan(
        tuple(i for i, o in enumerate(chosen) if o.code),
        peak,
        sum(o.cost for o in ran if o.code != _OFFLOAD),
        min_budget,
        modes,
        moved_bytes=moved,
        transfer_flops=sum(o.cost for o in ran if o.code == _OFFLOAD),
        offload_flops_per_byte=offload_flops_per_byte,
        keep=kept,
    )
