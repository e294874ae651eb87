"""The profile's first sample step (no block checkpointed): the hooks that record who saves what, each
block's inputs, FLOPs and backward window, and the per-block attribution and overheads read from it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from distckpt import _torch_compat as compat
from distckpt.select.profile.flops import flop_counter
from distckpt.select.profile.sample_step import (
    _act,
    _at,
    _distinct_bytes,
    _preserved_state,
    _storage_bytes,
    _storage_key,
    _tensors,
    memory_tracker,
    scalar_loss,
)


def _unhooked_saved_bytes(
    roots: list[Any], stop: set[Any], seen: set[Any], packed: Callable[[tuple[str, int]], bool], device: torch.device
) -> int:
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
            self.seen(_at(self.tracker.get_tracker_snapshot(), self.dev))

    def seen(self, d: dict[str, int]) -> None:
        """After an op, with ``d`` the device's current snapshot (read once for every window watching)."""
        if self.current is not None:
            self.peak[self.current] = max(self.peak[self.current], _act(d))

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
        self.order: list[int] = []  # the blocks in the order their forward first ran (the run order)
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
        if i not in self.order:
            self.order.append(i)
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

    def run_order(self) -> tuple[int, ...]:
        """The blocks' indices in the order their forward ran in the step, ``()`` when that is their
        given order, or when some block did not run (nothing to reorder by)."""
        if len(self.order) != self.n or self.order == sorted(self.order):
            return ()
        return tuple(self.order)

    def run(
        self,
        model: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        batch: list[torch.Tensor],
        device: torch.device,
    ) -> int:
        """One forward+backward under the hooks and MemTracker; returns the CUDA peak (0 on CPU)."""
        handles = []
        for _, m in self.blocks:
            handles.append(m.register_forward_pre_hook(self.pre_hook, with_kwargs=True))
            handles.append(m.register_forward_hook(self.post_hook, with_kwargs=True))
        self.tracker = memory_tracker(model, *batch)
        self.device = device
        self.windows = _BackwardWindows(
            self.tracker, device if device.type != "cuda" else torch.device("cuda", device.index or 0), self.n
        )
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
                    self.outside_scalars = _unhooked_saved_bytes(
                        [loss.grad_fn], set(), self.walked, self._packed, device
                    )
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


def _head_and_tail(
    rec: _StepRecorder, model: nn.Module, att: _Attribution, measured_blocks: list[int], dev: torch.device
) -> dict[str, int]:
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
    inside = [
        _at(snap, dev).get("Total", 0)
        for _, m in rec.blocks
        if (st := tracker.memory_tracking.get(m)) is not None
        for state in (peak_fw, peak_bw)
        for snap in st.snapshots.get(state, [])
    ]
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
