"""GradSyncGuard's view of a DeepSpeed ZeRO engine: what reached ZeRO's gradient reduction on each rank, in what
order, and (ZeRO-1/2, whose parameters every rank holds whole) the parameters themselves.

After ZeRO's reduction each rank holds only its own partition of the gradients: no two ranks hold the same reduced
values, so there is nothing to compare there, and the full gradient (``deepspeed.utils.safe_get_full_grad``) is one
collective per parameter and equal on every rank by construction. What does differ when ZeRO adds up the wrong
gradients is its input: ZeRO-1/2/3 reduce a flat bucket of the gradients present, ZeRO-2/3 in the order their hooks
fire. So each rank records, per parameter, how many times its gradient reached ZeRO in the step and at which
positions, and the ranks compare those. Imports no DeepSpeed.
"""

from __future__ import annotations

from typing import Any

import torch

from distckpt._log import first_few
from distckpt.errors import GradDesyncError
from distckpt.runtime.swap import _clean_fqn

__all__ = ["ZeroRecorder", "is_zero_engine"]

# Fields of GradSyncGuard's table, as distckpt.check.sync_guard lays them out.
_F_PRESENT, _F_NUMEL, _G_SUMSQ, _G_PROJ, _P_SUMSQ, _P_PROJ, _F_KEY = range(7)


def is_zero_engine(model: Any) -> bool:
    """A ``DeepSpeedEngine`` running ZeRO (duck-typed: distckpt's check layer does not import DeepSpeed)."""
    stage = getattr(model, "zero_optimization_stage", None)
    return callable(stage) and hasattr(model, "module") and int(stage()) > 0


def _ordered(engine: Any) -> bool:
    """Whether ZeRO reduces gradients in the order their hooks fire on this engine: ZeRO-2 (and ZeRO-1 with
    overlap_comm) unless distckpt's state hands them over in a fixed order. ZeRO-3 reduces a leaf module's parameters
    from the module's own hook, in parameter order, so arrival order says nothing there: presence is compared."""
    from distckpt.parallel.state import sync_state

    state = sync_state(engine)
    if state is not None and getattr(state, "defer", False):
        return False
    stage = int(engine.zero_optimization_stage())
    return stage == 2 or (stage == 1 and bool(getattr(engine.optimizer, "overlap_comm", False)))


class ZeroRecorder:
    """Records which trainable parameters' gradients reached ZeRO, and when, between two checks.

    Args:
        engine: the ``DeepSpeedEngine``.
        fingerprint: ``distckpt.check.sync_guard``'s fingerprint of a tensor (sum of squares, projection).
    """

    def __init__(self, engine: Any, fingerprint: Any):
        self.engine = engine
        self.stage = int(engine.zero_optimization_stage())
        self.fingerprint = fingerprint
        self.params = [(_clean_fqn(n), p) for n, p in engine.module.named_parameters()]
        self.seq: list[int] = []
        # ZeRO-3 leaf modules (deepspeed.utils.set_z3_leaf_modules): DeepSpeed reduces all their parameters from the
        # module's backward hook, a zero gradient for those autograd left without one. Counted as reaching ZeRO
        # once per check on every rank; distckpt's ZeroSyncState checks them at each backward.
        self.leaf = [self.stage == 3 and getattr(p, "ds_z3_leaf_module", None) is not None for _, p in self.params]
        # A post-accumulate hook fires when autograd writes the gradient, which is when ZeRO's own hook takes it.
        self.handles = [
            p.register_post_accumulate_grad_hook(lambda _p, i=i: self.seq.append(i))
            for i, (_, p) in enumerate(self.params)
            if p.requires_grad and not self.leaf[i]
        ]

    def fingerprints(self, with_params: bool, rank: int) -> tuple[torch.Tensor, list[str], list[bool]]:
        """The guard's table rows: per parameter whether and how often its gradient reached ZeRO (present, count),
        where (the sum of its positions in this step's sequence, when ZeRO reduces in that order), and under
        ZeRO-1/2 its values (every rank holds them whole)."""
        n = len(self.params)
        count = torch.zeros(n, dtype=torch.float64)
        where = torch.zeros(n, dtype=torch.float64)
        ordered = _ordered(self.engine)
        for pos, i in enumerate(self.seq):
            count[i] += 1
            if ordered:
                where[i] += (pos + 1) ** 2  # squared: swapping two parameters' places changes both sums
        self.seq = []
        for i, leaf in enumerate(self.leaf):
            if leaf and self.params[i][1].requires_grad:
                count[i] = 1
        rows = []
        for i, (_, p) in enumerate(self.params):
            whole = self.stage < 3
            numel = p.numel() if whole else int(getattr(p, "ds_numel", p.numel()))
            ps, pp = (float(v) for v in self.fingerprint(p.detach())) if with_params and whole else (0.0, 0.0)
            key = 0.0 if whole else float(1 + rank)  # ZeRO-3: each rank holds its own partition of the values
            rows.append([float(count[i] > 0), float(numel), float(count[i]), float(where[i]), ps, pp, key])
        table = torch.tensor(rows, dtype=torch.float64).reshape(n, 7)
        return table, [name for name, _ in self.params], [p.requires_grad for _, p in self.params]

    def compare(self, table: torch.Tensor, names: list[str], step: int, rtol: float, differs: Any) -> None:
        """Raise GradDesyncError when the ranks handed ZeRO different gradients, or hold different parameters."""
        world = table.shape[0]
        if world == 1:
            return
        problems: list[str] = []
        for i, name in enumerate(names):
            col = table[:, i]
            counts = col[:, _G_SUMSQ].tolist()
            if any(c != counts[0] for c in counts):
                by = {c: [r for r in range(world) if counts[r] == c] for c in sorted(set(counts))}
                seen = "; ".join(f"{int(c)} time(s) on ranks {rs}" for c, rs in by.items())
                problems.append(f"{name}: its gradient reached ZeRO's reduction {seen}")
            elif any(w != col[0, _G_PROJ] for w in col[:, _G_PROJ].tolist()):
                problems.append(
                    f"{name}: its gradient reached ZeRO-{self.stage}'s reduction at another point of the step on some "
                    "ranks (ZeRO reduces in the order gradients arrive, so ranks added up different parameters)"
                )
            if self.stage < 3 and (col[:, _F_KEY] == 0).all():
                msg = differs(col[:, _P_SUMSQ], col[:, _P_PROJ], int(col[0, _F_NUMEL]), rtol)
                if msg:
                    problems.append(f"{name} (parameter): {msg}")
        if problems:
            raise GradDesyncError(
                f"GradSyncGuard, step {step}: {len(problems)} parameter(s) differ across ranks under DeepSpeed "
                f"ZeRO-{self.stage}: {first_few(problems)}. Likely cause: ranks use different "
                "parameters (a task head per rank) and ZeRO reduced whatever each rank had. Fix: build the engine "
                "with distckpt.integrations.deepspeed.initialize(model, config=..., graph='auto')."
            )

    def grad_norm(self) -> float | None:
        """DeepSpeed's global gradient norm of the last step, when it computed one."""
        get = getattr(self.engine, "get_global_grad_norm", None)
        norm = get() if callable(get) else None
        return float(norm) if norm is not None else None

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
