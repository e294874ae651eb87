"""Run-time guard: gradients (and, every so often, parameters) agree across ranks after backward.

:class:`GradSyncGuard` compares a small fingerprint of every gradient across ranks (one all-gather) and
names the parameters that differ; it also watches trainable parameters that never get a gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from distckpt._dist import local_shard as _local
from distckpt._dist import rank_world
from distckpt._dist import shard_key as _shard_key
from distckpt._dist import unwrap_ddp as _inner
from distckpt._log import first_few, notify
from distckpt.check.zero_guard import ZeroRecorder, is_zero_engine
from distckpt.errors import ConfigError, GradDesyncError, NoGradientError
from distckpt.parallel.handshake import watched
from distckpt.parallel.state import sync_state
from distckpt.runtime.swap import _clean_fqn

__all__ = ["GradSyncGuard", "GuardReport", "NoGradientError"]


def _fsdp1_sharded(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    units = [m for m in model.modules() if isinstance(m, FullyShardedDataParallel)]
    return any(u.sharding_strategy != ShardingStrategy.NO_SHARD for u in units)


# --- fingerprints -------------------------------------------------------------------------------

_CHUNK = 4096  # projection weights: w[i % _CHUNK] * v[i // _CHUNK], unique per position
_WEIGHTS: dict[tuple[torch.device, int], torch.Tensor] = {}
_WNORMS: dict[int, float] = {}


def _weights(device: torch.device, which: int, n: int) -> torch.Tensor:
    """A fixed pseudo-random vector in [-1, 1) of length >= n, the same on every rank.

    Built from seeded blocks so that its prefix does not depend on the length first asked for.
    """
    key = (device, which)
    have = _WEIGHTS.get(key)
    if have is None or have.numel() < n:
        blocks = []
        for k in range(max(1, math.ceil(n / _CHUNK))):
            gen = torch.Generator().manual_seed(0x5EED + 7919 * which + k)
            blocks.append(torch.rand(_CHUNK, generator=gen) * 2 - 1)
        have = torch.cat(blocks).to(device)
        _WEIGHTS[key] = have
    return have


def _projection(flat: torch.Tensor) -> torch.Tensor:
    """``sum_i weight_i * flat_i`` with fixed random weights (catches permutations and sign flips
    that sums and norms miss), in one pass over ``flat``."""
    n = flat.numel()
    w = _weights(flat.device, 0, _CHUNK)
    if n <= _CHUNK:
        return torch.dot(flat, w[:n])
    m, rem = divmod(n, _CHUNK)
    v = _weights(flat.device, 1, m + 1)
    proj = torch.dot(flat[: m * _CHUNK].view(m, _CHUNK) @ w, v[:m])  # one gemv reads the tensor once
    if rem:
        proj = proj + torch.dot(flat[m * _CHUNK :], w[:rem]) * v[m]
    return proj


def _wnorm(n: int) -> float:
    """L2 norm of the projection weights of an ``n``-element tensor (the scale of its differences)."""
    if n not in _WNORMS:
        w = _weights(torch.device("cpu"), 0, _CHUNK).double()
        if n <= _CHUNK:
            _WNORMS[n] = float(w[:n].norm())
        else:
            m, rem = divmod(n, _CHUNK)
            v = _weights(torch.device("cpu"), 1, m + 1).double()
            _WNORMS[n] = math.sqrt(
                float(w.norm()) ** 2 * float(v[:m].norm()) ** 2 + float(w[:rem].norm()) ** 2 * float(v[m]) ** 2
            )
    return _WNORMS[n]


def _fingerprint(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of squares, projection) of a tensor, computed in float32."""
    flat = t.detach().reshape(-1)
    if flat.dtype != torch.float32:
        flat = flat.float()  # bf16/fp16: accumulate in fp32; fp64 stays exact enough in fp32 too
    if flat.numel() == 0:
        zero = flat.new_zeros(())
        return zero, zero
    return torch.dot(flat, flat), _projection(flat)


# --- GradSyncGuard -------------------------------------------------------------------------------

# _F_KEY: which part of the parameter the rank holds (distckpt._dist.shard_key; FSDP1 shards: 1 + rank).
# Ranks with the same key hold the same values when in sync, and are compared with each other.
_F_PRESENT, _F_NUMEL, _G_SUMSQ, _G_PROJ, _P_SUMSQ, _P_PROJ, _F_KEY = range(7)
_N_FIELDS = 7


@dataclass
class GuardReport:
    """What one :meth:`GradSyncGuard.check` call did.

    Attributes:
        step: index of the ``check()`` call (0-based, counted on every call).
        grads_checked: whether gradients were compared on this call (every ``every`` calls).
        params_checked: whether replicated parameters were compared on this call.
        grad_norm: global L2 norm of all gradients (sharded ones included), or None when not checked.
        no_grad: parameters that have had no gradient on any rank for ``no_grad_steps`` checks.
    """

    step: int
    grads_checked: bool = False
    params_checked: bool = False
    grad_norm: float | None = None
    no_grad: list[str] = field(default_factory=list)


class GradSyncGuard:
    """Check after backward, before ``optimizer.step()``, that every rank holds the same gradients.

    Every ``every`` calls of :meth:`check`, each rank computes a fingerprint of each parameter's
    gradient (float32 sum of squares and a fixed random projection, which catches permutations
    and sign flips) and the ranks exchange them in ONE ``all_gather`` of a ``(params, 7)`` float64
    tensor: gradients themselves never travel. Each rank also says which part of each parameter it
    holds, and the ranks that hold the same part are compared with each other. What is compared:

    * replicated parameters (plain, DDP, FSDP ``NO_SHARD``, DTensor with only ``Replicate``
      placements): the gradient fingerprints must agree on all ranks, and a gradient must be
      present on all ranks or on none. Every ``params_every`` calls the parameters themselves are
      compared the same way (they drift apart when gradients ever differed).
    * sharded parameters (FSDP with ``use_orig_params=True``, FSDP2 DTensors with a ``Shard``
      placement): every rank holding a non-empty shard must have a gradient for it (the
      reduce-scatter ran on all of them, or on none). Ranks that hold the same shard, the
      ``"replicate"`` dimension of an HSDP mesh (DTensor ``(Replicate, Shard)``), must agree on its
      gradient and (every ``params_every`` checks) its values, as replicated parameters do; under
      FSDP/FSDP2 on a 1-D mesh no two ranks hold the same shard. The squares of each distinct
      shard add up to the global gradient norm that :class:`GuardReport` reports.
    * all parameters with ``requires_grad``: a parameter whose gradient is None or exactly zero on
      every rank for ``no_grad_steps`` consecutive checks is reported (a frozen input under
      reentrant checkpointing, a detached head): warned, raised (:class:`NoGradientError`) or
      ignored per ``on_no_grad``.

    Gradients after DDP's all-reduce or FSDP's reduce-scatter are bitwise identical on all ranks
    in fp32, bf16 and fp16 (each reduced value is computed once and copied), and the fingerprints
    are computed in float32 by the same kernels, so in practice they are bitwise equal. The
    tolerance only absorbs float32 rounding when ranks run different kernels (mixed hardware):
    a difference is reported when a fingerprint moves by more than ``rtol`` of the largest change
    a gradient difference of ``|g|`` could cause (the sum of squares by ``2|g|^2``, the projection
    by ``|w||g|``). With the default ``1e-6`` a 1% change of one element of a 1024-element
    gradient is caught; a change spread over the whole tensor is caught from about
    ``rtol * sqrt(numel)`` of its norm. Single process (world size 1): only the no-gradient check.

    Every rank must call :meth:`check` the same number of times (it is a collective).

    Args:
        model: the model: plain, DDP, FSDP or FSDP2. Names are reported as in the user's model.
        every: compare gradients on every ``every``-th call of :meth:`check` (1: every step).
        params_every: compare replicated parameters on every ``params_every``-th checked step
            (the first included; 0: never).
        no_grad_steps: consecutive checked steps without a gradient before reporting a parameter.
        on_no_grad: ``"warn"``, ``"raise"`` or ``"ignore"``.
        rtol: relative tolerance of the comparisons (see above).
        group: the process group (default: the default group).

    Raises:
        ConfigError: invalid arguments.
    """

    def __init__(
        self,
        model: nn.Module,
        every: int = 1,
        *,
        params_every: int = 100,
        no_grad_steps: int = 3,
        on_no_grad: str = "warn",
        rtol: float = 1e-6,
        group: Any = None,
    ) -> None:
        if not isinstance(every, int) or every < 1:
            raise ConfigError(f"GradSyncGuard(every={every!r}): every must be an int >= 1 (1 checks every step).")
        if not isinstance(params_every, int) or params_every < 0:
            raise ConfigError(f"GradSyncGuard(params_every={params_every!r}) must be an int >= 0 (0 turns it off).")
        if not isinstance(no_grad_steps, int) or no_grad_steps < 1:
            raise ConfigError(f"GradSyncGuard(no_grad_steps={no_grad_steps!r}) must be an int >= 1.")
        if on_no_grad not in ("warn", "raise", "ignore"):
            raise ConfigError(f"GradSyncGuard(on_no_grad={on_no_grad!r}): use 'warn', 'raise' or 'ignore'.")
        if not rtol >= 0:
            raise ConfigError(f"GradSyncGuard(rtol={rtol!r}) must be >= 0.")
        self.model = model
        self.every = every
        self.params_every = params_every
        self.no_grad_steps = no_grad_steps
        self.on_no_grad = on_no_grad
        self.rtol = float(rtol)
        self.group = group
        self.step = 0
        self._layout_checked = False
        self._missing: dict[str, int] = {}  # name -> consecutive checked steps without gradient
        self._reported: set[str] = set()
        # DeepSpeed ZeRO: each rank holds its own partition of the reduced gradients; what reached ZeRO's reduction
        # is compared instead (distckpt.check.zero_guard). Hooks from here on: build the guard before the first step.
        self._zero = ZeroRecorder(model, _fingerprint) if is_zero_engine(model) else None

    # The model's parameters are read on every check: FSDP2 replaces them by DTensors when
    # fully_shard runs, possibly after the guard was built.
    def _params(self) -> list[tuple[str, nn.Parameter]]:
        return [(_clean_fqn(n), p) for n, p in _inner(self.model).named_parameters()]

    def _world(self) -> tuple[int, int]:
        return rank_world(self.group)

    def _comm_device(self, fallback: torch.device) -> torch.device:
        backend = dist.get_backend(self.group)
        if "nccl" in str(backend) and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu") if "gloo" in str(backend) else fallback

    def check(self) -> GuardReport:
        """Compare this step's gradients across ranks (call after backward, before the optimizer step).

        Returns:
            A :class:`GuardReport`.

        Raises:
            GradDesyncError: gradients (or replicated parameters) differ across ranks; the message
                names the parameters, the ranks and the size of the difference.
            NoGradientError: with ``on_no_grad="raise"``, trainable parameters got no gradient.
        """
        step = self.step
        self.step += 1
        report = GuardReport(step=step)
        if step % self.every:
            return report
        with watched(sync_state(self.model), f"the guard check of step {step}"):  # the hang watchdog
            return self._check(step, report)

    def _check(self, step: int, report: GuardReport) -> GuardReport:
        # Counted in checked steps, so that `every` and `params_every` need not divide each other.
        with_params = self.params_every > 0 and (step // self.every) % self.params_every == 0
        params = self._params() if self._zero is None else self._zero.params
        rank, world = self._world()
        if self._zero is None:
            fp, _, sharded, device = self._local_fingerprints(params, with_params)
        else:
            fp, device, sharded = self._zero.fingerprints(with_params, rank)[0], torch.device("cpu"), []
        if world > 1:
            comm = self._comm_device(device)
            if not self._layout_checked:
                # Once: the all-gather below needs the same parameter count on every rank.
                counts = torch.tensor([len(params), -len(params)], dtype=torch.int64, device=comm)
                dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=self.group)
                self._layout_checked = True
                if int(counts[0]) != -int(counts[1]):
                    raise GradDesyncError(
                        f"GradSyncGuard: ranks hold different numbers of parameter tensors ({-int(counts[1])} to "
                        f"{int(counts[0])}; this rank {len(params)}): the model differs across ranks. Build the "
                        "same model on every rank (same config and seed) before wrapping it."
                    )
            local = fp.to(comm)
            out = local.new_empty((world * local.shape[0], _N_FIELDS))
            # The one collective; all_gather_single is its name from torch 2.13 on.
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            gather(out, local, group=self.group)
            table = out.view(world, *local.shape).cpu()
        else:
            table = fp.cpu().unsqueeze(0)
        report.grads_checked, report.params_checked = True, with_params
        names = [n for n, _ in params]
        trains = [p.requires_grad for _, p in params]
        if self._zero is None:
            self._compare(table, names, trains, sharded, with_params, step)
            report.grad_norm = float(_distinct_sumsq(table).sum().sqrt())
        else:
            self._zero.compare(table, names, step, self.rtol, _differs)
            report.grad_norm = self._zero.grad_norm()
        report.no_grad = self._track_no_grad(table, names, trains, step)
        return report

    def _local_fingerprints(
        self, params: list[tuple[str, nn.Parameter]], with_params: bool
    ) -> tuple[torch.Tensor, list[int], list[bool], torch.device]:
        sharded_model = _fsdp1_sharded(self.model)
        device = torch.device("cpu")
        values: list[torch.Tensor] = []  # 4 fp32 scalars per parameter, stacked once at the end
        meta: list[list[float]] = []
        numels: list[int] = []
        sharded: list[bool] = []
        zeros: dict[torch.device, torch.Tensor] = {}
        rank = self._world()[0]
        keys: list[float] = []
        for _, p in params:
            data, is_sharded = _local(p)
            keys.append(float(1 + rank if sharded_model else _shard_key(p)))
            is_sharded = is_sharded or sharded_model
            device = data.device
            if device not in zeros:
                zeros[device] = torch.zeros((), dtype=torch.float32, device=device)
            zero = zeros[device]
            grad = p.grad
            if grad is not None:
                grad, _ = _local(grad)
            gs, gp = _fingerprint(grad) if grad is not None else (zero, zero)
            # Sharded ones too: the ranks holding the same shard (HSDP's replicas) are compared.
            ps, pp = _fingerprint(data) if with_params else (zero, zero)
            meta.append([float(grad is not None or data.numel() == 0), float(data.numel())])
            values += [gs, gp, ps, pp]
            numels.append(data.numel())
            sharded.append(is_sharded)
        if not params:
            return torch.zeros((0, _N_FIELDS), dtype=torch.float64), [], [], device
        if len(zeros) > 1:  # parameters on several devices (CPU offload): gather the scalars first
            values = [v.to(device) for v in values]
        vals = torch.stack(values).double().view(-1, 4).cpu()
        key = torch.tensor(keys, dtype=torch.float64).unsqueeze(1)
        fp = torch.cat([torch.tensor(meta, dtype=torch.float64), vals, key], dim=1)
        return fp, numels, sharded, device

    def _compare(
        self,
        table: torch.Tensor,
        names: list[str],
        trains: list[bool],
        sharded: list[bool],
        with_params: bool,
        step: int,
    ) -> None:
        world = table.shape[0]
        if world == 1 or not names:
            return
        problems: list[str] = []
        # Fast path: a parameter whose fingerprints and presence are bitwise equal on all ranks is fine.
        fields = [_F_PRESENT, _G_SUMSQ, _G_PROJ] + ([_P_SUMSQ, _P_PROJ] if with_params else [])
        equal = (table[:, :, fields] == table[:1, :, fields]).all(dim=2).all(dim=0).tolist()
        for i, name in enumerate(names):
            if equal[i]:
                continue
            col = table[:, i]
            present = [bool(x) for x in col[:, _F_PRESENT].tolist()]
            holds = [x > 0 for x in col[:, _F_NUMEL].tolist()]
            groups = _same_part(col)
            if trains[i]:
                relevant = [r for r in range(world) if holds[r]] if sharded[i] else list(range(world))
                have = [r for r in relevant if present[r]]
                if have and len(have) < len(relevant):
                    miss = [r for r in relevant if not present[r]]
                    problems.append(f"{name}: gradient present on ranks {have} but None on ranks {miss}")
                elif have:
                    problems += [f"{name} (gradient): {m}" for m in _group_differs(col, groups, _G_SUMSQ, self.rtol)]
            if with_params:
                problems += [f"{name} (parameter): {m}" for m in _group_differs(col, groups, _P_SUMSQ, self.rtol)]
        if problems:
            raise GradDesyncError(
                f"GradSyncGuard, step {step}: {len(problems)} parameter(s) differ across ranks after "
                f"synchronization: {first_few(problems)}. Likely cause: a gradient that "
                "was not all-reduced (reentrant checkpointing with DDP, pytorch#121594; a no_sync()/"
                "accumulate() context left on; a hook that edits gradients on one rank). Fix: use "
                "distckpt.wrap(..., reentrant=False) and distckpt.parallelize(model, graph='auto'), and "
                "run `distckpt doctor` on the model."
            )

    def _track_no_grad(self, table: torch.Tensor, names: list[str], trains: list[bool], step: int) -> list[str]:
        # No gradient anywhere: None on every rank, or all-zero on every rank.
        none_anywhere = table[:, :, _F_PRESENT].sum(0) == 0
        zero_everywhere = (table[:, :, _G_SUMSQ] == 0).all(0) & (table[:, :, _F_NUMEL].sum(0) > 0)
        missing = (none_anywhere | zero_everywhere).tolist()
        stuck: list[str] = []
        for name, trains_it, miss in zip(names, trains, missing):
            if not trains_it or not miss:
                self._missing.pop(name, None)
                self._reported.discard(name)
                continue
            self._missing[name] = self._missing.get(name, 0) + 1
            if self._missing[name] >= self.no_grad_steps:
                stuck.append(name)
        new = [n for n in stuck if n not in self._reported]
        if new and self.on_no_grad != "ignore":
            shown = first_few(new, 8, ", ")
            msg = (
                f"GradSyncGuard, step {step}: {len(new)} parameter(s) with requires_grad=True got no gradient "
                f"(None or zero) on any rank for {self.no_grad_steps} checked steps: {shown}. Likely cause: the "
                "input of a reentrant-checkpointed block does not require grad (frozen embedding), or a head "
                "detached from the loss. Fix: distckpt.wrap(..., reentrant=False), or set requires_grad=False "
                "on parameters that are meant to be frozen."
            )
            if self.on_no_grad == "raise":
                raise NoGradientError(msg)
            notify(msg, category=RuntimeWarning, stacklevel=3)
            self._reported.update(new)
        return stuck


def _same_part(col: torch.Tensor) -> list[list[int]]:
    """The ranks of one parameter's column grouped by the part they hold (``_F_KEY``), groups of 2+."""
    by_key: dict[float, list[int]] = {}
    for r, k in enumerate(col[:, _F_KEY].tolist()):
        by_key.setdefault(k, []).append(r)
    return [g for g in by_key.values() if len(g) > 1]


def _group_differs(col: torch.Tensor, groups: list[list[int]], sumsq_field: int, rtol: float) -> list[str]:
    """How the ranks holding the same part differ in (``sumsq_field``, the projection after it)."""
    out = []
    for g in groups:
        idx = torch.tensor(g)
        numel = int(col[g[0], _F_NUMEL])
        msg = _differs(col[idx, sumsq_field], col[idx, sumsq_field + 1], numel, rtol, ranks=g)
        if msg:
            out.append(msg)
    return out


def _distinct_sumsq(table: torch.Tensor) -> torch.Tensor:
    """Per parameter, the sum of squares of its gradient over the distinct parts the ranks hold (a
    replicated parameter once, each shard once: HSDP's replicas of a shard are not added twice)."""
    keys = table[:, :, _F_KEY].long()
    if not keys.numel():
        return table.new_zeros(table.shape[1])
    # Ranks with the same key hold the same part (compared before this): any one of them stands for it.
    parts = table.new_zeros(int(keys.max()) + 1, table.shape[1])
    return parts.scatter_(0, keys, table[:, :, _G_SUMSQ]).sum(0)


def _differs(
    sumsq: torch.Tensor, proj: torch.Tensor, numel: int, rtol: float, ranks: list[int] | None = None
) -> str | None:
    """A description of how ranks differ, or None when they agree within ``rtol`` (``ranks``: the
    global ranks of the entries, default 0, 1, ...).

    Two tensors differing by ``d`` (L2) change the sum of squares by at most ``2|g||d|`` and the
    projection by at most ``|w||d|``: both differences are scaled back to ``|d| / |g|``.
    """
    s = sumsq.tolist()
    p = proj.tolist()
    world = len(s)
    if all(a == s[0] for a in s) and all(b == p[0] for b in p):
        return None  # the usual case: bitwise equal fingerprints
    wnorm = _wnorm(numel)
    finite = [x for x in s if math.isfinite(x)]
    norm = math.sqrt(max(finite)) if finite else 0.0
    tiny = 1e-30

    def rel(a: int, b: int) -> float:
        if not (math.isfinite(s[a]) and math.isfinite(s[b]) and math.isfinite(p[a]) and math.isfinite(p[b])):
            same_nan = all((math.isnan(x) and math.isnan(y)) or x == y for x, y in ((s[a], s[b]), (p[a], p[b])))
            return 0.0 if same_nan else math.inf
        d1 = abs(s[a] - s[b]) / max(2 * norm * norm, tiny)
        d2 = abs(p[a] - p[b]) / max(wnorm * norm, tiny)
        return max(d1, d2)

    agree = [[rel(a, b) <= rtol for b in range(world)] for a in range(world)]
    ref = max(range(world), key=lambda r: (sum(agree[r]), -r))  # the majority (rank 0 on a tie)
    odd = [r for r in range(world) if not agree[ref][r]]
    if not odd:
        return None
    worst = max(rel(ref, r) for r in odd)
    name = ranks or list(range(world))
    norms = ", ".join(f"rank {name[r]}: {math.sqrt(s[r]) if s[r] >= 0 else s[r]:.6g}" for r in range(world))
    return (
        f"ranks {[name[r] for r in odd]} differ from rank {name[ref]} by about {worst:.3g} of its norm "
        f"(L2 norms {norms}; tolerance {rtol:g})"
    )
