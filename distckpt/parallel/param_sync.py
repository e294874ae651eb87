"""Gradient-sync bookkeeping behind ``parallelize``: every trainable parameter takes part in each
forward (a zero-weight edge into the autograd graph), and a parameter that no rank used keeps
``.grad`` None.

Why hand-written: DDP's ``find_unused_parameters`` and ``static_graph`` each break some multi-task
pattern under checkpointing (docs/parallel.md), and FSDP/FSDP2 have no setting for parameters
that only some ranks use (pytorch#158719). What makes every pattern right is a forward in which
every parameter is in the autograd graph; PyTorch has no such switch, so a small autograd Function
(``_Participate``) adds it.

How one step goes:

1. Forward: each forward of the model gets a :class:`_Record`. A hook on each *unit* (the DDP root;
   each FSDP unit, where its parameters are unsharded) walks the new autograd graph from the unit's
   outputs and records, for each parameter, the graph nodes that consume it. ``_Participate`` then
   wraps the unit's outputs and takes the unit's parameters as extra inputs.
2. Backward: the first ``_Participate.backward`` of an autograd pass runs before any parameter's
   gradient is accumulated. It asks the engine which consumer nodes this pass will execute
   (``_torch_compat.will_execute``), over every forward still alive (so any order of forwards and
   backwards works: two forwards then one backward, micro-batches interleaved, a gradient penalty's
   ``autograd.grad`` before ``backward``, a forward never backwarded). A parameter none of whose
   consumers runs is unused in this pass and gets a zero gradient (an expanded scalar: no
   allocation, NaN-proof); a used one gets nothing extra. Every rank thus marks every parameter
   ready exactly once and DDP/FSDP reduce the same buckets everywhere.
3. End of a pass that reduces gradients (after DDP/FSDP did): the used bits are all-reduced (one
   small collective per optimizer step, with the FSDP units' forward counts), and the parameters no
   rank used get ``.grad = None`` back, as in a single-process run.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd.graph import get_gradient_edge

from distckpt import _torch_compat as compat
from distckpt._dist import grad_meta, zero_grad
from distckpt.errors import ConfigError, GradDesyncError
from distckpt.layout import Layout
from distckpt.options import Engine
from distckpt.parallel.deferred import deferred

__all__ = ["SyncState"]

_Key = tuple[Any, int]  # (autograd node, output_nr): where a parameter's gradient flows in


class _Unit:
    """One module whose parameters join in its own forward (unsharded there under FSDP)."""

    def __init__(self, module: nn.Module, params: list[tuple[int, nn.Module, str]], name: str = ""):
        self.module = module
        self.name = name  # FQN, for error messages ("" for the root)
        self.params = params  # (index in SyncState.names, owning submodule, attribute name)
        self.keys: list[_Key | None] = []  # set by the pre-forward hook
        self.tensors: list[torch.Tensor] = []


class _Record:
    """What one forward of the model recorded, kept while its graph can still be backwarded.

    The root unit's ``_Participate`` nodes hold it (``ctx.record``) and it holds weak references to
    them: a record is alive while any of those nodes is, i.e. while the user holds the outputs.
    """

    __slots__ = ("born", "consumers", "param_keys", "roots", "visited", "window", "__weakref__")

    def __init__(self, window: int, born: int):
        self.param_keys: dict[_Key, int] = {}
        self.consumers: dict[int, list[Any]] = {}
        self.visited: set[Any] = set()  # only during the forward's graph walks
        self.window = window  # the DDP reduction window the forward ran in
        self.born = born  # how many autograd passes ran before the forward
        self.roots: list[weakref.ref] = []

    def alive(self) -> bool:
        return any(r() is not None for r in self.roots)

    def in_pass(self) -> bool:
        """Whether the running autograd pass executes this forward's outputs."""
        return any(node is not None and compat.will_execute(node) for node in (r() for r in self.roots))

    def clear(self) -> None:
        # Consumer nodes can reach other units' _Participate nodes, which hold this record: a cycle
        # through C++ autograd nodes that Python's GC cannot see. Dropping the lists breaks it.
        self.param_keys, self.consumers, self.visited = {}, {}, set()


class SyncState:
    """Per parallel model: units, per-forward records, used bits and the reset of unused grads.

    Args:
        names: clean FQNs of the trainable parameters (same order on every rank).
        registered: the parameters as the optimizer sees them (sharded under FSDP), same order.
        mode: ``"join"`` (unused params join with zero gradients) or ``"static"`` (DDP static graph:
            no join).
        group: process group for the used-bits all-reduce.
        layout: how the model runs (its engine: DDP, FSDP1 or FSDP2; its strategy name in messages).
        reentrant: indices of the params inside reentrant-checkpointed blocks.
        static_check: graph='static': raise ConfigError at the first step whose used set differs.
        ddp: the DDP wrapper (its ``require_backward_grad_sync`` says whether a forward arms a
            reduction), under DDP.
    """

    def __init__(
        self,
        names: list[str],
        registered: list[nn.Parameter],
        mode: str,
        group: Any,
        layout: Layout,
        reentrant: set[int],
        static_check: bool = False,
        ddp: nn.Module | None = None,
    ):
        self.names = names
        self.registered = registered
        self.mode = mode
        self.static_check = static_check
        self.group = group
        self.layout = layout
        self.engine = layout.engine
        self.strategy = layout.strategy  # the name the user chose, for messages
        self.reentrant = reentrant
        self.compiled: set[int] = set()  # indices of the params inside blocks compiled per block (set by parallelize)
        # FSDP2 accumulates a param's gradient over any number of autograd passes, so params inside
        # reentrant blocks join too (their nested backward adds the real gradient). DDP's static graph
        # counts each firing, so there they do not.
        self.join_reentrant = self.engine is Engine.FSDP2
        self._ddp = weakref.ref(ddp) if ddp is not None else None
        self._hooked: set[int] = set()
        self._delivered = [0] * len(names)
        self.units: list[_Unit] = []
        self.handles: list[Any] = []
        self.sync = True  # False inside distckpt.accumulate: no reduction on this micro-batch (FSDP)
        self.step = 0
        self.records: list[_Record] = []
        self._current: _Record | None = None
        self._owner: _Unit | None = None  # the unit whose forward opened the current record
        # DDP reduces in the first accumulating backward after a forward with sync on ("armed"); each
        # such reduction closes a window. A forward of an earlier window backwarded later is refused.
        self.window = 0
        self._armed = False
        self.passes = 0  # autograd passes through the model so far
        self._reset_pass()
        self._window_used = torch.zeros(len(names), dtype=torch.bool)
        self._none_at_start: list[bool] | None = None
        self._static_used: torch.Tensor | None = None
        self._fired = torch.zeros(len(names), dtype=torch.int32)
        self._first_fired: torch.Tensor | None = None
        self._calls: list[int] = []  # grad-enabled forwards per FSDP unit in this window
        self._fwd_calls: list[int] = []  # the same, in the current forward of the model
        self._order = 0  # a rolling hash of the order the units ran in
        dev = torch.device("cpu")
        if dist.is_initialized() and "nccl" in str(dist.get_backend(group)):
            dev = torch.device("cuda", torch.cuda.current_device())
        self._comm_device = dev

    # --- per autograd pass --------------------------------------------------------------------

    def _reset_pass(self) -> None:
        # Python lists, not tensors: read per parameter in backward, where tensor indexing costs.
        self.used = [False] * len(self.names)
        self.in_graph = [False] * len(self.names)
        self.task_id: int | None = None
        self.accumulating = True  # False in torch.autograd.grad: no .grad is written
        self.joined: set[tuple[int, _Key]] = set()

    def live_records(self) -> list[_Record]:
        """The forwards whose outputs are still held (dead ones are dropped here)."""
        live = []
        for r in self.records:
            if r.alive() or r is self._current:
                live.append(r)
            else:
                r.clear()
        self.records = live
        return live

    # --- hooks --------------------------------------------------------------------------------

    def attach(self, unit: _Unit, prepend: bool) -> None:
        """Register the pre-forward and forward hooks of ``unit``."""
        self.units.append(unit)
        self._calls.append(0)
        self._fwd_calls.append(0)
        k = len(self.units) - 1
        self.handles.append(unit.module.register_forward_pre_hook(lambda m, a: self._pre_forward(unit, k)))
        self.handles.append(
            unit.module.register_forward_hook(lambda m, a, out: self._post_forward(unit, out), prepend=prepend)
        )

    def count_reentrant_firings(self, params: list[tuple[int, nn.Parameter]]) -> None:
        """Count gradient accumulations of parameters inside reentrant blocks (their nested backward
        is invisible to the outer graph)."""
        for i, p in params:
            self.handles.append(p.register_post_accumulate_grad_hook(lambda _p, i=i: self._fire(i)))

    def _fire(self, i: int) -> None:
        self._fired[i] += 1

    def _open_record(self, unit: _Unit) -> None:
        self.live_records()
        self._current = _Record(self.window, self.passes)
        self._owner = unit
        self._fwd_calls = [0] * len(self.units)
        self.records.append(self._current)
        ddp = self._ddp() if self._ddp is not None else None
        if ddp is not None and ddp.require_backward_grad_sync:
            self._armed = True  # DDP's forward called prepare_for_backward: the next backward reduces

    def arm(self) -> None:
        """Say that the next backward reduces although the forwards ran without sync: DDP's reducer was prepared
        for it afterwards (Accelerate's ``trigger_sync_in_backward``), so that backward closes the window."""
        self._armed = True

    def _count(self, k: int) -> None:
        self._calls[k] += 1
        self._fwd_calls[k] += 1
        self._order = (self._order * 1000003 + k + 1) % 2_147_483_647

    def _pre_forward(self, unit: _Unit, k: int) -> None:
        if not torch.is_grad_enabled():
            if self._current is not None:  # a unit run under no_grad inside a training forward all-gathers too
                self._count(k)
            return
        if unit is self.units[-1] or self._current is None:  # the root, or a unit called on its own
            self._open_record(unit)
        self._count(k)
        rec = self._current
        tensors = [getattr(owner, attr) for _, owner, attr in unit.params]
        if len(tensors) != len(unit.tensors) or any(a is not b for a, b in zip(tensors, unit.tensors)):
            # New tensors (FSDP1 makes new views each forward): find where their gradients flow in.
            # Leaf params keep theirs: holding the key keeps autograd's accumulator node the same.
            unit.tensors = tensors
            unit.keys = []
            if self.join_reentrant:
                for (i, _, _), t in zip(unit.params, tensors):
                    if i in self.reentrant and t.requires_grad and id(t) not in self._hooked:
                        # The unsharded param FSDP2 accumulates into: count its gradients (nested too).
                        self._hooked.add(id(t))
                        self.handles.append(t.register_post_accumulate_grad_hook(lambda _p, i=i: self._fire(i)))
            for t in tensors:
                edge = get_gradient_edge(t) if t.requires_grad else None
                unit.keys.append((edge.node, edge.output_nr) if edge is not None else None)
        for (i, _, _), key in zip(unit.params, unit.keys):
            if key is not None:
                rec.param_keys[key] = i

    def _post_forward(self, unit: _Unit, out: Any) -> Any:
        if not torch.is_grad_enabled() or self._current is None:
            return out
        rec = self._current
        closes = unit is self._owner
        try:
            flat, spec = compat.tree_flatten(out)
            idx = [k for k, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
            if not idx:
                return out
            self._walk(rec, [flat[k].grad_fn for k in idx])
            keys, tensors = [], []
            if self.mode == "join":
                for key, t in zip(unit.keys, unit.tensors):
                    if key is not None and (self.join_reentrant or rec.param_keys[key] not in self.reentrant):
                        keys.append(key)
                        tensors.append(t)
            # One _Participate per output tensor, each also taking the params: an output the loss does
            # not use then stays unreachable, so its consumers do not count as used (a head computed
            # but not in the loss). The first that runs in a pass delivers the zeros; the others nothing.
            for k in idx:
                flat[k] = _Participate.apply(self, rec, keys, flat[k], *tensors)
                if closes:
                    rec.roots.append(weakref.ref(flat[k].grad_fn))
            return compat.tree_unflatten(flat, spec)
        finally:
            if closes:
                rec.visited = set()
                self._current = self._owner = None
                if unit is self.units[-1] and self.engine is not Engine.DDP:
                    self._check_units_ran()

    def join_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The root's join on ``loss``, for a backward that runs inside the root's own forward (Lightning's
        manual optimization: ``training_step`` is the DDP forward, ``manual_backward`` runs in it, before the
        root's forward hook could join). Call it right before that backward, with DDP's
        ``require_backward_grad_sync`` as it will be read by the reducer's ``prepare_for_backward``.

        Args:
            loss: the tensor about to be backwarded.

        Returns:
            ``loss`` with every parameter of the root joined (the value is unchanged).

        Raises:
            ConfigError: under FSDP/FSDP2, whose root parameters are joined in their unit's forward only.
        """
        ddp = self._ddp() if self._ddp is not None else None
        if ddp is None:
            raise ConfigError(
                f"a backward inside the model's own forward (Lightning's manual optimization) under {self.strategy}: "
                "FSDP joins the root's parameters in the root's forward, which has not returned yet. Use DDP, or "
                "automatic optimization (return the loss from training_step)."
            )
        root, k = self.units[-1], len(self.units) - 1
        self._pre_forward(root, k)  # a record of its own: its window is the one this backward reduces
        # Each such backward re-arms the reducer (prepare_for_backward) unless inside no_sync: this one reduces
        # everything accumulated so far, so no earlier forward of the window is left unsynchronized.
        self._armed = bool(ddp.require_backward_grad_sync)
        return self._post_forward(root, loss)

    def _check_units_ran(self) -> None:
        """FSDP: every block unit runs in each forward. One that some forward skips while others run
        (an expert, a routed or sampled module) makes ranks pair the all-gathers of different units:
        wrong values, or a hang. Raised here, on the rank that sees it, before any backward (under
        torchrun the other ranks are then stopped)."""
        calls = self._fwd_calls[:-1]
        if calls and max(calls) > 0 and min(calls) == 0:
            skipped = self.units[calls.index(0)].name
            ran = self.units[calls.index(max(calls))].name
            raise ConfigError(
                f"{self.strategy}: the FSDP unit {skipped} did not run in this forward while {ran} did, so it runs "
                "conditionally (a mixture-of-experts expert, a routed or sampled module) and ranks would pair the "
                "all-gathers of different units (wrong values or a hang, pytorch#158719). Checkpoint and shard the "
                "layer that contains the router instead: distckpt.wrap(model, blocks=<the layer class>)."
            )

    def _walk(self, rec: _Record, roots: list[Any]) -> None:
        """Record, for each parameter, the graph nodes that consume it (each node once per forward)."""
        stack = [r for r in roots if r is not None]
        visited, keys, consumers = rec.visited, rec.param_keys, rec.consumers
        while stack:
            node = stack.pop()
            if node in visited:
                continue
            visited.add(node)
            edges = node.next_functions
            if isinstance(node, _Participate._backward_cls):
                edges = edges[:1]  # another unit's _Participate: only its real output, not its param edges
            for nxt, nr in edges:
                if nxt is None:
                    continue
                i = keys.get((nxt, nr))
                if i is not None:
                    consumers.setdefault(i, []).append(node)
                elif nxt not in visited:
                    stack.append(nxt)

    # --- backward -----------------------------------------------------------------------------

    def on_participate_backward(self, rec: _Record, keys: list[_Key]) -> list[bool]:
        """Which of ``keys`` get no zero gradient in this pass (used, already given one, or not
        accumulated at all); the first call of a pass does the pass's bookkeeping."""
        task = compat.current_graph_task_id()
        if self.task_id != task:
            self._begin_pass(task, rec)
        if not self.accumulating:
            return [True] * len(keys)  # autograd.grad: no .grad is written, nothing to keep in step
        out = []
        for k in keys:
            i = rec.param_keys.get(k)
            if i is None:  # a record already dropped (its root outputs are gone): nothing to add
                out.append(True)
                continue
            skip = self.used[i] or (i, k) in self.joined
            if not skip and i in self.reentrant:
                self._delivered[i] += 1  # a firing that is the zero, not a real gradient
            out.append(skip)
            self.joined.add((i, k))
        return out

    def _begin_pass(self, task: int, rec: _Record) -> None:
        self._reset_pass()
        self.task_id = task
        plain = compat.is_plain_backward()
        if self.reentrant and not plain:
            raise ConfigError(
                "torch.autograd.grad (or backward(inputs=...)) ran through reentrant-checkpointed blocks, which "
                "PyTorch's reentrant checkpoint cannot differentiate (gradient penalties, meta-learning). Use "
                "distckpt.wrap(..., reentrant=False)."
            )
        if self.engine.sharded and torch.is_grad_enabled():  # grad mode in backward: create_graph
            raise ConfigError(
                f"a backward with create_graph=True (a gradient penalty, a Hessian-vector product) ran under "
                f"{self.strategy}: FSDP frees the unsharded parameters after each pass, and the double-backward "
                "graph still points to them. Use strategy='ddp' for this loss."
            )
        passing = [r for r in self.live_records() if r is rec or r.in_pass()]
        if self.compiled and torch.is_grad_enabled():
            self._refuse_double_backward(passing)
        born, self.passes = self.passes, self.passes + 1
        if self.engine is Engine.FSDP1 and any(r.born != born for r in passing):
            raise ConfigError(
                "a backward ran through a forward that another backward followed (micro-batches interleaved, or "
                "a second backward of a retained graph): FSDP1 (strategy='fsdp') frees the unsharded parameters "
                "its saved tensors point to after each backward. Run each forward's backward before the next "
                "backward, sum the losses and call backward once, or use strategy='fsdp2'."
            )
        self.accumulating = plain or compat.writes_grad(rec.param_keys)
        if not self.accumulating:
            return
        if self.engine is Engine.DDP:
            stale = [r for r in passing if r.window != self.window]
            if stale:
                raise ConfigError(
                    "a backward ran through a forward whose micro-batch was already reduced: DDP reduces the "
                    "gradients in the first backward after a forward with sync on, so this backward's gradients "
                    "would stay unsynchronized. Run each micro-batch's backward before the next forward, run all "
                    "but the last micro-batch (forward and backward) inside distckpt.accumulate(model), or sum "
                    "the losses and call backward once."
                )
        if self._none_at_start is None:
            # First pass of an accumulation window: an unused param's grad is untouched so far (only the
            # zero writes it, later in this pass).
            self._none_at_start = [p.grad is None for p in self.registered]
        for r in passing:
            for i, nodes in r.consumers.items():
                self.in_graph[i] = True
                if not self.used[i] and any(compat.will_execute(n) for n in nodes):
                    self.used[i] = True
        if self.static_check:
            # Here, before any parameter's gradient is accumulated, DDP has not reduced anything, so a
            # changed graph raises this ConfigError instead of DDP's "graph has changed" or a desync.
            self._check_static(torch.tensor(self.used), torch.tensor(self.in_graph))
        reduces = self._armed if self.engine is Engine.DDP else self.sync and not deferred(self)
        # Queued now, this runs before DDP's finalize (queued by the last bucket); it queues the real
        # work behind it, so that resetting grads happens after the reduction wrote them.
        compat.queue_after_backward(lambda: self._end_of_backward(reduces))

    def _refuse_double_backward(self, passing: list[_Record]) -> None:
        """A create_graph=True pass through blocks compiled per block: their compiled backward cannot be
        differentiated again, so the second backward would raise a raw torch error (torch 2.13)."""
        through = sorted(
            {
                i
                for r in passing
                for i, nodes in r.consumers.items()
                if i in self.compiled and any(compat.will_execute(n) for n in nodes)
            }
        )
        if through:
            raise ConfigError(
                "a backward with create_graph=True (a gradient penalty, a Hessian-vector product) ran through blocks "
                f"compiled per block ({self._names(through)}): torch.compile's AOT autograd cannot differentiate their "
                "backward again (double backward). Drop compile= from parallelize for this loss."
            )

    def _allreduce(self, t: torch.Tensor, op: Any = None) -> torch.Tensor:
        if not dist.is_initialized():
            return t
        t = t.to(self._comm_device)
        dist.all_reduce(t, op=op or dist.ReduceOp.MAX, group=self.group)
        return t.cpu()

    def _end_of_backward(self, reduces: bool) -> None:
        used = torch.tensor(self.used)
        fired = self._fired.clone()
        self._fired.zero_()
        self._reset_pass()
        for i in self.reentrant:
            used[i] = bool(fired[i] > self._delivered[i])
        self._delivered = [0] * len(self.names)
        self._window_used |= used
        if self.reentrant and not self.join_reentrant:
            self._check_reentrant(fired)
        if not reduces:
            return
        if self.engine is Engine.DDP:
            self._armed = False
            self.window += 1
        none_at_start, self._none_at_start = self._none_at_start, None
        window = self._window_used
        if none_at_start is not None:
            # A parameter no forward used may still have a real gradient: one used only in the loss,
            # outside every unit's forward (a learnable temperature, a regularizer), or only through a
            # gradient penalty's double backward. Its gradient is reduced by now; a nonzero value on any
            # rank means it was used, so it keeps its gradient.
            for i in (~window).nonzero().flatten().tolist():
                grad = self.registered[i].grad if none_at_start[i] else None
                if grad is not None:
                    grad = compat.to_local(grad)
                    window[i] = bool(grad.numel() and grad.ne(0).any())
        self._window_used = torch.zeros(len(self.names), dtype=torch.bool)
        self.step += 1
        any_used = self._reduce_window(window)
        for i in (~any_used).nonzero().flatten().tolist():
            if none_at_start is None or none_at_start[i]:
                self.registered[i].grad = None

    def _reduce_window(self, window: torch.Tensor) -> torch.Tensor:
        """One all-reduce: the used bits, and under FSDP the units' forward counts and order, which
        must agree across ranks (a unit run by some ranks only pairs the all-gathers of different
        units: silently wrong values, pytorch#158719)."""
        n = len(self.names)
        calls = torch.tensor(self._calls + [self._order], dtype=torch.int64) if self.engine is not Engine.DDP else None
        self._calls = [0] * len(self._calls)
        self._order = 0
        if calls is None:
            return self._allreduce(window.to(torch.uint8)).bool()
        red = self._allreduce(torch.cat([window.to(torch.int64), calls, -calls]))
        hi, lo = red[n : n + len(calls)], -red[n + len(calls) :]
        bad = [k for k in range(len(self.units)) if hi[k] != lo[k]]
        if bad or hi[-1] != lo[-1]:
            unit = self.units[bad[0]] if bad else None
            what = (
                f"unit {unit.name or '(root)'} ran {int(lo[bad[0]])} to {int(hi[bad[0]])} times"
                if unit
                else "the units ran in a different order"
            )
            raise GradDesyncError(
                f"{self.strategy}: the ranks ran different FSDP units in step {self.step - 1} ({what} across ranks), "
                "so their all-gathers and reduce-scatters paired different parameters and this step's values are "
                "wrong. A block that runs conditionally (a mixture-of-experts expert, a routed or sampled module) "
                "cannot be its own unit: checkpoint and shard the layer that contains the router "
                "(distckpt.wrap(model, blocks=<the layer class>))."
            )
        return red[:n].bool()

    def _check_static(self, used: torch.Tensor, in_graph: torch.Tensor) -> None:
        """graph='static': the used set must be the same on every rank and step."""
        n = len(self.names)
        computed_unused = in_graph & ~used
        red = self._allreduce(torch.cat([used, ~used, computed_unused]).to(torch.uint8)).bool()
        anywhere, not_everywhere, dropped = red[:n], red[n : 2 * n], red[2 * n :]
        varies = anywhere & not_everywhere
        if dropped.any():
            raise ConfigError(
                f"graph='static' but {self._names(dropped.nonzero().flatten().tolist())} took part in step "
                f"{self.step}'s forward and not in its loss on some rank (an output computed but not used, "
                "pytorch#79171); DDP's static graph would desync. Use graph='auto'."
            )
        if self._static_used is None:
            if varies.any():
                raise ConfigError(
                    f"graph='static' but {self._names(varies.nonzero().flatten().tolist())} got no gradient on some "
                    f"ranks only in step {self.step}. Use graph='auto'."
                )
            self._static_used = used
        elif varies.any() or not torch.equal(anywhere, self._static_used):
            bad = varies | (anywhere != self._static_used)
            raise ConfigError(
                f"graph='static' but the parameters used in step {self.step} differ from the first step's "
                f"({self._names(bad.nonzero().flatten().tolist())}). Use graph='auto'."
            )

    def _check_reentrant(self, fired: torch.Tensor) -> None:
        """Params inside reentrant blocks: the same number of gradients on every rank and step."""
        n = len(self.names)
        red = self._allreduce(torch.cat([fired, -fired]))
        hi, lo = red[:n], -red[n:]
        if self._first_fired is None:
            self._first_fired = hi.clone()
        bad = [i for i in sorted(self.reentrant) if lo[i] == 0 or hi[i] != lo[i] or hi[i] != self._first_fired[i]]
        if bad:
            raise ConfigError(
                f"{self._names(bad)} inside reentrant-checkpointed blocks got no gradient, or a different "
                f"number of gradients, on some rank in step {self.step}: with reentrant checkpointing "
                f"{self.strategy} can only sync blocks that every step uses the same way on every rank. "
                "Use distckpt.wrap(..., reentrant=False)."
            )

    def _names(self, idx: list[int]) -> str:
        shown = ", ".join(self.names[i] for i in idx[:3])
        return shown + (f" and {len(idx) - 3} more" if len(idx) > 3 else "")

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


class _Participate(torch.autograd.Function):
    """Identity on a unit's outputs that also takes the unit's parameters as inputs (see module doc)."""

    @staticmethod
    def forward(
        ctx: Any, state: SyncState, rec: _Record, keys: list[_Key], out: torch.Tensor, *params: torch.Tensor
    ) -> Any:
        ctx.state, ctx.record, ctx.keys = state, rec, keys
        ctx.meta = [grad_meta(t) for t in params]
        ctx.set_materialize_grads(False)
        # detach(): the same data without a view relation (FSDP2 warns about view outputs; an in-place
        # op on the result is still seen by autograd through the shared version counter).
        return out.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> Any:
        skip = ctx.state.on_participate_backward(ctx.record, ctx.keys)
        zeros = [None if s else zero_grad(meta) for s, meta in zip(skip, ctx.meta)]
        return (None, None, None, grad, *zeros)


def param_owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The submodule that holds parameter ``name`` and its attribute name."""
    mod_name, _, attr = name.rpartition(".")
    return (model.get_submodule(mod_name) if mod_name else model), attr
