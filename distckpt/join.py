"""Gradient-sync bookkeeping behind ``parallelize``: every trainable parameter takes part in each
forward (a zero-weight join), and a parameter that no rank used keeps ``.grad`` None.

Why hand-written: DDP's ``find_unused_parameters`` and ``static_graph`` each break some multi-task
pattern under checkpointing (DESIGN.md's table), and FSDP/FSDP2 have no setting for parameters that
only some ranks use (pytorch#158719). What makes every pattern right is a forward in which every
parameter is in the autograd graph; PyTorch has no such switch, so a small autograd Function adds it.

How one step goes:

1. Forward: a hook on each *unit* (the DDP root; each FSDP unit, where its parameters are unsharded)
   walks the new autograd graph from the unit's outputs and records, for each parameter, the graph
   nodes that consume it. Then ``_Join`` wraps the unit's outputs and takes the unit's parameters
   as extra inputs.
2. Backward: ``_Join.backward`` runs before any parameter's gradient is accumulated. It asks the
   autograd engine which consumer nodes this backward will execute
   (``torch._C._will_engine_execute_node``): a parameter none of whose consumers runs is unused
   this step and gets a zero gradient from the join (an expanded scalar: no allocation, NaN-proof,
   unlike ``0 * p.sum()``); a used parameter gets nothing extra (no added work). Every rank thus
   marks every parameter ready exactly once and DDP/FSDP reduce the same buckets everywhere.
3. End of backward, after DDP/FSDP finished reducing: the used bits are all-reduced (one small
   collective per optimizer step), and the parameters no rank used get ``.grad = None`` back, as in
   a single-process run (AdamW then applies no decay or momentum to them).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd.graph import get_gradient_edge
from torch.utils._pytree import tree_flatten, tree_unflatten

from distckpt.errors import ConfigError

__all__ = ["SyncState"]

_MAX_PENDING_FORWARDS = 64  # forwards without a backward (eval with grad on): drop their records
_Key = tuple[Any, int]  # (autograd node, output_nr): where a parameter's gradient flows in


class _Unit:
    """One module whose parameters are joined in its own forward (unsharded there under FSDP)."""

    def __init__(self, module: nn.Module, params: list[tuple[int, nn.Module, str]]):
        self.module = module
        self.params = params  # (index in SyncState.names, owning submodule, attribute name)
        self.keys: list[_Key] = []  # set by the pre-forward hook
        self.tensors: list[torch.Tensor] = []


class SyncState:
    """Per parallel model: units, the per-step consumer map, used bits and the reset of unused grads.

    Args:
        names: clean FQNs of the trainable parameters (same order on every rank).
        registered: the parameters as the optimizer sees them (sharded under FSDP), same order.
        mode: ``"join"`` (unused params join with zero gradients) or ``"static"`` (DDP static graph:
            no join).
        group: process group for the used-bits all-reduce.
        strategy: ``"ddp"``, ``"fsdp"`` or ``"fsdp2"``.
        reentrant: indices of the params inside reentrant-checkpointed blocks.
        static_check: graph='static': raise ConfigError at the first step whose used set differs.
    """

    def __init__(self, names: list[str], registered: list[nn.Parameter], mode: str, group: Any,
                 strategy: str, reentrant: set[int], static_check: bool = False):
        self.names = names
        self.registered = registered
        self.mode = mode
        self.static_check = static_check  # graph='static': refuse a step whose used set differs
        self.group = group
        self.strategy = strategy
        self.reentrant = reentrant  # indices of params inside reentrant-checkpointed blocks
        # FSDP2 accumulates a param's gradient over any number of autograd passes, so params inside
        # reentrant blocks join too (their nested backward adds the real gradient). DDP's static graph
        # counts each firing, so there they do not.
        self.join_reentrant = strategy == "fsdp2"
        self._hooked: set[int] = set()
        self._delivered = [0] * len(names)
        self.units: list[_Unit] = []
        self.handles: list[Any] = []
        self.sync = True  # False inside distckpt.accumulate: no reduction on this micro-batch
        self.step = 0
        self._reset_step()
        self._window_used = torch.zeros(len(names), dtype=torch.bool)
        self._none_at_start: list[bool] | None = None
        self._static_used: torch.Tensor | None = None
        self._fired = torch.zeros(len(names), dtype=torch.int32)
        self._first_fired: torch.Tensor | None = None
        dev = torch.device("cpu")
        if dist.is_initialized() and "nccl" in str(dist.get_backend(group)):
            dev = torch.device("cuda", torch.cuda.current_device())
        self._comm_device = dev

    # --- per step -----------------------------------------------------------------------------

    def _reset_step(self) -> None:
        self.param_keys: dict[_Key, int] = {}
        self.consumers: dict[int, list[Any]] = {}
        self.visited: set[Any] = set()
        self.forwards = 0
        # Python lists, not tensors: read per parameter in backward, where tensor indexing costs.
        self.used = [False] * len(self.names)
        self.in_graph = [False] * len(self.names)
        self.task_id: int | None = None
        self.joined: set[_Key] = set()

    # --- hooks --------------------------------------------------------------------------------

    def attach(self, unit: _Unit, prepend: bool) -> None:
        """Register the pre-forward and forward hooks of ``unit``."""
        self.units.append(unit)
        self.handles.append(unit.module.register_forward_pre_hook(lambda m, a: self._pre_forward(unit)))
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

    def _pre_forward(self, unit: _Unit) -> None:
        if not torch.is_grad_enabled():
            return
        if unit is self.units[-1] and self.forwards >= _MAX_PENDING_FORWARDS:  # the root: a new forward
            warnings.warn(
                f"distckpt: {self.forwards} forwards with grad enabled and no backward; their sync records "
                "were dropped. Run evaluation under torch.no_grad() to avoid this.", stacklevel=3)
            self._reset_step()
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
                self.param_keys[key] = i

    def _post_forward(self, unit: _Unit, out: Any) -> Any:
        if not torch.is_grad_enabled():
            return out
        flat, spec = tree_flatten(out)
        idx = [k for k, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not idx:
            return out
        if unit is self.units[-1]:
            self.forwards += 1
        self._walk([flat[k].grad_fn for k in idx])
        keys, tensors = [], []
        if self.mode == "join":
            for key, t in zip(unit.keys, unit.tensors):
                if key is not None and (self.join_reentrant or self.param_keys[key] not in self.reentrant):
                    keys.append(key)
                    tensors.append(t)
        # One join per output tensor, each also taking the params: an output the loss does not use
        # then stays unreachable, so its consumers do not count as used (a head computed but not in the
        # loss). The first join that runs in a backward delivers the zeros; the others deliver nothing.
        for k in idx:
            flat[k] = _Join.apply(self, keys, flat[k], *tensors)
        return tree_unflatten(flat, spec)

    def _walk(self, roots: list[Any]) -> None:
        """Record, for each parameter, the graph nodes that consume it (each node once per step)."""
        stack = [r for r in roots if r is not None]
        visited, keys, consumers = self.visited, self.param_keys, self.consumers
        while stack:
            node = stack.pop()
            if node in visited:
                continue
            visited.add(node)
            edges = node.next_functions
            if isinstance(node, _Join._backward_cls):
                edges = edges[:1]  # another unit's join: only its real output, not its param edges
            for nxt, nr in edges:
                if nxt is None:
                    continue
                i = keys.get((nxt, nr))
                if i is not None:
                    consumers.setdefault(i, []).append(node)
                elif nxt not in visited:
                    stack.append(nxt)

    # --- backward -----------------------------------------------------------------------------

    def on_join_backward(self, keys: list[_Key]) -> list[bool]:
        """Which of ``keys`` this backward reaches through the real graph; queues the end-of-step work."""
        task = torch._C._current_graph_task_id()
        if self.task_id != task:
            # The first join of this backward: the engine already knows the whole graph, so `used`
            # covers every forward of the step; the other joins only read it.
            self.task_id = task
            if self._none_at_start is None:
                # First backward of an accumulation window: an unused param's grad is untouched so far
                # (only the join writes it, later in this backward).
                self._none_at_start = [p.grad is None for p in self.registered]
            will = torch._C._will_engine_execute_node
            for i, nodes in self.consumers.items():
                self.in_graph[i] = True
                if any(will(n) for n in nodes):
                    self.used[i] = True
            if self.static_check:
                # Here, before any parameter's gradient is accumulated, DDP has not reduced anything, so
                # a changed graph raises this ConfigError instead of DDP's "graph has changed" or a desync.
                # `used` covers every forward of the step: the engine knows the whole graph.
                self._check_static(torch.tensor(self.used), torch.tensor(self.in_graph))
            # Queued now, this runs before DDP's finalize (queued by the last bucket); it queues the
            # real work behind it, so that resetting grads happens after the reduction wrote them.
            torch.autograd.Variable._execution_engine.queue_callback(
                lambda: torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            )
        out = []
        for k in keys:
            i = self.param_keys[k]
            skip = self.used[i] or k in self.joined
            if not skip and i in self.reentrant:
                self._delivered[i] += 1  # a firing that is the join's zero, not a real gradient
            out.append(skip)
            self.joined.add(k)
        return out

    def _allreduce(self, t: torch.Tensor, op: Any = None) -> torch.Tensor:
        if not dist.is_initialized():
            return t
        t = t.to(self._comm_device)
        dist.all_reduce(t, op=op or dist.ReduceOp.MAX, group=self.group)
        return t.cpu()

    def _end_of_backward(self) -> None:
        used = torch.tensor(self.used)
        fired = self._fired.clone()
        self._fired.zero_()
        self._reset_step()
        for i in self.reentrant:
            used[i] = bool(fired[i] > self._delivered[i])
        self._delivered = [0] * len(self.names)
        self._window_used |= used
        if self.reentrant and not self.join_reentrant:
            self._check_reentrant(fired)
        if not self.sync:
            return
        none_at_start, self._none_at_start = self._none_at_start, None
        window = self._window_used
        if none_at_start is not None:
            # A parameter no forward used may still have a real gradient: one used only in the loss,
            # outside every unit's forward (a learnable temperature, a regularizer). Its gradient is
            # reduced by now; a nonzero value on any rank means it was used, so it keeps its gradient.
            for i in (~window).nonzero().flatten().tolist():
                grad = self.registered[i].grad if none_at_start[i] else None
                if grad is not None:
                    grad = grad.to_local() if hasattr(grad, "to_local") else grad
                    window[i] = bool(grad.numel() and grad.ne(0).any())
        window = window.to(torch.uint8)
        self._window_used = torch.zeros(len(self.names), dtype=torch.bool)
        self.step += 1
        any_used = self._allreduce(window).bool()
        for i in (~any_used).nonzero().flatten().tolist():
            if none_at_start is None or none_at_start[i]:
                self.registered[i].grad = None

    def _check_static(self, used: torch.Tensor, in_graph: torch.Tensor) -> None:
        """graph='static': the used set must be the same on every rank and step."""
        n = len(self.names)
        red = self._allreduce(torch.cat([used, ~used]).to(torch.uint8)).bool()
        anywhere, not_everywhere = red[:n], red[n:]
        varies = anywhere & not_everywhere
        if self._static_used is None:
            bad = (in_graph & ~used) | varies
            if bad.any():
                raise ConfigError(
                    f"graph='static' but {self._names(bad.nonzero().flatten().tolist())} got no gradient on some "
                    f"rank in step {self.step} (computed but not in the loss, or used by some ranks only). Use "
                    "graph='auto'.")
            self._static_used = used
        elif varies.any() or not torch.equal(anywhere, self._static_used):
            bad = varies | (anywhere != self._static_used)
            raise ConfigError(
                f"graph='static' but the parameters used in step {self.step} differ from the first step's "
                f"({self._names(bad.nonzero().flatten().tolist())}). Use graph='auto' (or 'dynamic').")

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
                "Use distckpt.wrap(..., reentrant=False).")

    def _names(self, idx: list[int]) -> str:
        shown = ", ".join(self.names[i] for i in idx[:3])
        return shown + (f" and {len(idx) - 3} more" if len(idx) > 3 else "")

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


class _Join(torch.autograd.Function):
    """Identity on a unit's outputs that also takes the unit's parameters as inputs (see module doc)."""

    @staticmethod
    def forward(ctx: Any, state: SyncState, keys: list[_Key], out: torch.Tensor, *params: torch.Tensor) -> Any:
        ctx.state, ctx.keys = state, keys
        ctx.meta = [(t.shape, t.dtype, t.device) for t in params]
        ctx.set_materialize_grads(False)
        # detach(): the same data without a view relation (FSDP2 warns about view outputs; an in-place
        # op on the result is still seen by autograd through the shared version counter).
        return out.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> Any:
        skip = ctx.state.on_join_backward(ctx.keys)
        zeros = [None if s else torch.zeros((), dtype=dt, device=dev).expand(shape)
                 for s, (shape, dt, dev) in zip(skip, ctx.meta)]
        return (None, None, grad, *zeros)


def param_owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The submodule that holds parameter ``name`` and its attribute name."""
    mod_name, _, attr = name.rpartition(".")
    return (model.get_submodule(mod_name) if mod_name else model), attr

