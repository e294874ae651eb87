"""torch's own per-op planner of selective activation checkpointing (``torch.distributed._tools.sac_ilp``), run
on the CPU for ``benchmarks.frontier``: its statistics gathered under FakeTensorMode as torch's tests gather
them (MemTracker over two steps, RuntimeEstimator and SACEstimator over one), every op priced at its FLOPs
(``distckpt._torch_compat.sac_runtimes_as_flops``: torch's estimators time ops on CUDA only, and FLOPs are
what the budget minimises too), the module-level MILP restricted to the repeated blocks, then the per-op MILP
of each chosen block, applied with torch's ``checkpoint_wrapper`` and a selective-checkpoint policy that saves
the ops it chose (as torch's ``auto_sac`` does). Needs ``pulp`` and ``pwlf`` (``pip install -e ".[bench]"``).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from distckpt import _torch_compat as compat
from distckpt.select.profile import flop_counter, scalar_loss


@dataclass
class SacPlan:
    """What torch's planner chose at one memory budget: per block FQN, the share of activation memory to
    discard (``sac_milp``) and the per-op decisions (1: save) in the order the block's forward runs its ops
    (``OPS_TO_ALWAYS_SKIP`` left out); its own predicted peak and recompute time (FLOPs / 1e9)."""

    budget_bytes: int
    discard: dict[str, float]
    decisions: dict[str, list[int]]
    predicted_peak: int
    recompute: float


def _counted(func: Any, args: Any, kwargs: Any) -> tuple[Any, int]:
    counter = flop_counter()
    with counter:
        out = func(*args, **kwargs)
    return out, counter.get_total_flops()


def _fake_copy(model: nn.Module, mode: Any) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are fake tensors of ``mode`` (same shapes)."""
    fake = copy.deepcopy(model)
    for mod in fake.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            setattr(mod, name, nn.Parameter(mode.from_tensor(p.detach()), p.requires_grad))
        for name, b in list(mod.named_buffers(recurse=False)):
            mod._buffers[name] = mode.from_tensor(b)
    return fake


def gather_stats(model: nn.Module, inputs: tuple, kwargs: dict) -> tuple[Any, Any]:
    """torch's module graph (``parse_module_info``) and its ``SACEstimator`` for one AdamW step of ``model`` on
    the batch, under FakeTensorMode, every op priced at its FLOPs."""
    tools = compat.sac_planner()
    mode = compat.fake_mode()
    with compat.sac_runtimes_as_flops(_counted):
        fake = _fake_copy(model, mode)
        with mode:
            fin = tuple(mode.from_tensor(t) if torch.is_tensor(t) else t for t in inputs)
            fkw = {k: mode.from_tensor(v) if torch.is_tensor(v) else v for k, v in kwargs.items()}
            opt = torch.optim.AdamW(fake.parameters(), lr=1e-4)

            def step() -> None:
                scalar_loss(fake(*fin, **fkw)).backward()
                opt.step()
                opt.zero_grad()

            tracker = tools.MemTracker()
            tracker.track_external(fake, opt)
            with tracker:
                for k in range(2):  # the second step has the optimizer state
                    step()
                    if k == 0:
                        tracker.reset_mod_stats()
                last = tracker.get_tracker_snapshot("current")
            _fill_backward_snapshots(tracker, last)
            runtime = tools.RuntimeEstimator()
            with runtime("operator-level-cost-model"):
                step()
            sac = tools.SACEstimator()
            with sac("operator-level-cost-model"):
                loss = scalar_loss(fake(*fin, **fkw))
            loss.backward()
            info = tools.aggregate_stats(fake, tracker, runtime, sac, torch.device("cpu"))
    # RuntimeEstimator's module orders also list "Func" (HF Llama's step: calls outside any module it names),
    # which has no statistics; parse_module_info wants one entry per module: those without any are left out.
    known = {m["fqn"] for m in info["mod_stats"]}
    for key, order in info["mod_order"].items():
        info["mod_order"][key] = [name for name in dict.fromkeys(order) if name in known]
    return tools.parse_module_info(info), sac


def _fill_backward_snapshots(tracker: Any, last: Any) -> None:
    """A module that no backward runs through (its inputs need no gradient: Llama's rotary embedding) has no
    backward snapshots, which ``aggregate_stats`` reads: given the step's last one, as torch's own tests of the
    planner do for the post-backward one."""
    peak_bw = compat.mem_tracker_states()[1]
    post_bw, pre_bw = compat.mem_tracker_states(post=True)
    for stats in tracker.memory_tracking.values():
        for state in (pre_bw, peak_bw, post_bw):
            if not stats.snapshots.get(state):
                stats.snapshots.setdefault(state, []).append(copy.deepcopy(last))


def plan(graph: Any, sac: Any, root: str, blocks: list[str], budget_bytes: int) -> SacPlan:
    """torch's plan at ``budget_bytes`` (its MILP takes GiB), checkpointing only ``blocks`` (FQNs in the model;
    torch names them ``root.fqn``)."""
    tools = compat.sac_planner()
    units = [f"{root}.{b}" for b in blocks]
    discard, recompute, peak = tools.sac_milp(graph, budget_bytes / 2**30, 1, units)
    # An op of 0 bytes and 0 FLOPs (a pointwise op on a scalar) appears in no constraint of the per-op MILP, so
    # pulp leaves its variable unset and torch's rounding of it raises: every op is given at least one byte.
    decisions = {
        fqn.removeprefix(root + "."): tools.get_optimal_checkpointing_policy_per_module(
            dataclasses.replace(sac.sac_mod_stats[fqn], memory=[max(1, m) for m in sac.sac_mod_stats[fqn].memory]),
            1 - ratio,
        )
        for fqn, ratio in discard.items()
    }
    return SacPlan(
        budget_bytes, {k.removeprefix(root + "."): v for k, v in discard.items()}, decisions, peak, recompute
    )


def _policy(decisions: list[int], skip: Any) -> Callable[..., Any]:
    from torch.utils.checkpoint import CheckpointPolicy

    count = [0]

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if func in skip:
            return CheckpointPolicy.MUST_RECOMPUTE
        k = count[0]
        count[0] += 1
        save = k < len(decisions) and decisions[k] == 1
        return CheckpointPolicy.PREFER_SAVE if save else CheckpointPolicy.MUST_RECOMPUTE

    return policy


def apply(model: nn.Module, sac_plan: SacPlan) -> nn.Module:
    """``model`` with each block of the plan wrapped in torch's ``checkpoint_wrapper`` (non-reentrant) under a
    selective-checkpoint policy saving the ops it chose; in place, returned."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    skip = compat.sac_planner().OPS_TO_ALWAYS_SKIP
    for fqn, decisions in sac_plan.decisions.items():
        parent_name, _, name = fqn.rpartition(".")
        parent = model.get_submodule(parent_name)

        def context(decisions: list[int] = decisions) -> tuple[Any, Any]:
            return create_selective_checkpoint_contexts(_policy(decisions, skip))

        wrapped = checkpoint_wrapper(
            parent.get_submodule(name), checkpoint_impl=CheckpointImpl.NO_REENTRANT, context_fn=context
        )
        setattr(parent, name, wrapped)
    return model


@functools.cache
def available() -> str:
    """``""`` when torch's planner can run here, else why not (a missing package)."""
    try:
        compat.sac_planner()
        import pulp  # noqa: F401
    except ImportError as e:
        return f"torch's SAC planner needs pulp and pwlf ({e})"
    return ""


def _serve(conn: Any, model: nn.Module, inputs: tuple, kwargs: dict, root: str, blocks: list[str]) -> None:
    try:
        graph, sac = gather_stats(model, inputs, kwargs)
    except Exception as e:  # noqa: BLE001 - handed to the parent, which reports it
        conn.send(e)
        return
    conn.send(None)
    while (budget_bytes := conn.recv()) is not None:
        conn.send(plan(graph, sac, root, blocks, budget_bytes))


class Planner:
    """torch's planner for ``model`` in a process of its own: :func:`gather_stats` once there, then
    :meth:`plan` per budget. Why not in the benchmark's process: after that process had measured the other setups,
    torch's MILP found no plan at any budget argument up to 423 MiB on HF GPT-2 (twice), while a fresh process
    finds one at 173 MiB from the same statistics code."""

    def __init__(self, model: nn.Module, inputs: tuple, kwargs: dict, root: str, blocks: list[str]) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, model, inputs, kwargs, root, blocks), daemon=True)
        self._proc.start()
        error = self._conn.recv()
        if error is not None:
            self.close()
            raise error

    def plan(self, budget_bytes: int) -> SacPlan:
        self._conn.send(budget_bytes)
        return self._conn.recv()

    def close(self) -> None:
        if self._proc.is_alive():
            self._conn.send(None)
        self._proc.join(timeout=60)
