"""Run-time guards: gradients agree across ranks (:class:`GradSyncGuard`), and the checkpointed
recompute reproduces the forward (:func:`verify_recompute`)."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils.checkpoint as tuc

from distckpt._dist import rank_world
from distckpt.errors import ConfigError, GradDesyncError, RecomputeMismatchError
from distckpt.wrap import _clean_fqn, checkpointing_disabled, is_checkpointed

__all__ = [
    "GradSyncGuard",
    "GuardReport",
    "Mismatch",
    "NoGradientError",
    "RecomputeReport",
    "verify_recompute",
]


class NoGradientError(GradDesyncError):
    """Parameters that should train received no gradient on any rank for several checked steps."""


# --- what the guard sees of a (possibly wrapped) model ------------------------------------------


def _inner(model: nn.Module) -> nn.Module:
    """The user's module under DDP (FSDP keeps its wrappers in the tree; names are cleaned)."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def _fsdp1_sharded(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    units = [m for m in model.modules() if isinstance(m, FullyShardedDataParallel)]
    return any(u.sharding_strategy != ShardingStrategy.NO_SHARD for u in units)


_DTENSOR: Any = None


def _dtensor_types() -> Any:
    global _DTENSOR
    if _DTENSOR is None:
        try:
            from torch.distributed.tensor import DTensor, Replicate

            _DTENSOR = (DTensor, Replicate)
        except ImportError:  # pragma: no cover - torch without distributed
            _DTENSOR = ()
    return _DTENSOR


def _local(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The tensor this rank holds, and whether other ranks hold other parts of it (sharded)."""
    types = _dtensor_types()
    if types and isinstance(t, types[0]):
        return t.to_local(), not all(isinstance(p, types[1]) for p in t.placements)
    return t, False


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
        proj = proj + torch.dot(flat[m * _CHUNK:], w[:rem]) * v[m]
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
            _WNORMS[n] = math.sqrt(float(w.norm()) ** 2 * float(v[:m].norm()) ** 2
                                   + float(w[:rem].norm()) ** 2 * float(v[m]) ** 2)
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

_F_PRESENT, _F_NUMEL, _G_SUMSQ, _G_PROJ, _P_SUMSQ, _P_PROJ = range(6)
_N_FIELDS = 6


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
    and sign flips) and the ranks exchange them in ONE ``all_gather`` of a ``(params, 6)`` float64
    tensor: gradients themselves never travel. What is compared:

    * replicated parameters (plain, DDP, FSDP ``NO_SHARD``, DTensor with only ``Replicate``
      placements): the gradient fingerprints must agree on all ranks, and a gradient must be
      present on all ranks or on none. Every ``params_every`` calls the parameters themselves are
      compared the same way (they drift apart when gradients ever differed).
    * sharded parameters (FSDP with ``use_orig_params=True``, FSDP2 DTensors with a ``Shard``
      placement): no other rank holds the same shard, so values cannot be compared. The guard
      checks that every rank holding a non-empty shard has a gradient for it (the reduce-scatter
      ran on all of them, or on none), and sums the shards' squares into the global gradient
      norm that :class:`GuardReport` reports and the no-gradient check uses.
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

    def __init__(self, model: nn.Module, every: int = 1, *, params_every: int = 100, no_grad_steps: int = 3,
                 on_no_grad: str = "warn", rtol: float = 1e-6, group: Any = None) -> None:
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
        # Counted in checked steps, so that `every` and `params_every` need not divide each other.
        with_params = self.params_every > 0 and (step // self.every) % self.params_every == 0
        params = self._params()
        fp, numels, sharded, device = self._local_fingerprints(params, with_params)
        rank, world = self._world()
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
                        "same model on every rank (same config and seed) before wrapping it.")
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
        self._compare(table, names, trains, numels, sharded, with_params, step)
        # Sharded: the shards' squares add up; replicated: every rank holds the whole gradient.
        sumsq = table[:, :, _G_SUMSQ].sum(0).where(torch.tensor(sharded, dtype=torch.bool), table[0, :, _G_SUMSQ])
        report.grad_norm = float(sumsq.sum().sqrt())
        report.no_grad = self._track_no_grad(table, names, trains, step)
        return report

    def _local_fingerprints(self, params: list[tuple[str, nn.Parameter]], with_params: bool
                            ) -> tuple[torch.Tensor, list[int], list[bool], torch.device]:
        sharded_model = _fsdp1_sharded(self.model)
        device = torch.device("cpu")
        values: list[torch.Tensor] = []  # 4 fp32 scalars per parameter, stacked once at the end
        meta: list[list[float]] = []
        numels: list[int] = []
        sharded: list[bool] = []
        zeros: dict[torch.device, torch.Tensor] = {}
        for _, p in params:
            data, is_sharded = _local(p)
            is_sharded = is_sharded or sharded_model
            device = data.device
            if device not in zeros:
                zeros[device] = torch.zeros((), dtype=torch.float32, device=device)
            zero = zeros[device]
            grad = p.grad
            if grad is not None:
                grad, _ = _local(grad)
            gs, gp = _fingerprint(grad) if grad is not None else (zero, zero)
            ps, pp = _fingerprint(data) if with_params and not is_sharded else (zero, zero)
            meta.append([float(grad is not None or data.numel() == 0), float(data.numel())])
            values += [gs, gp, ps, pp]
            numels.append(data.numel())
            sharded.append(is_sharded)
        if not params:
            return torch.zeros((0, _N_FIELDS), dtype=torch.float64), [], [], device
        if len(zeros) > 1:  # parameters on several devices (CPU offload): gather the scalars first
            values = [v.to(device) for v in values]
        vals = torch.stack(values).double().view(-1, 4).cpu()
        fp = torch.cat([torch.tensor(meta, dtype=torch.float64), vals], dim=1)
        return fp, numels, sharded, device

    def _compare(self, table: torch.Tensor, names: list[str], trains: list[bool], numels: list[int],
                 sharded: list[bool], with_params: bool, step: int) -> None:
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
            if trains[i]:
                relevant = [r for r in range(world) if holds[r]] if sharded[i] else list(range(world))
                have = [r for r in relevant if present[r]]
                if have and len(have) < len(relevant):
                    miss = [r for r in relevant if not present[r]]
                    problems.append(f"{name}: gradient present on ranks {have} but None on ranks {miss}")
                elif have and not sharded[i]:
                    msg = _differs(col[:, _G_SUMSQ], col[:, _G_PROJ], numels[i], self.rtol)
                    if msg:
                        problems.append(f"{name} (gradient): {msg}")
            if with_params and not sharded[i]:
                msg = _differs(col[:, _P_SUMSQ], col[:, _P_PROJ], numels[i], self.rtol)
                if msg:
                    problems.append(f"{name} (parameter): {msg}")
        if problems:
            more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
            raise GradDesyncError(
                f"GradSyncGuard, step {step}: {len(problems)} parameter(s) differ across ranks after "
                f"synchronization: " + "; ".join(problems[:5]) + more + ". Likely cause: a gradient that "
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
            shown = ", ".join(new[:8]) + (f" (and {len(new) - 8} more)" if len(new) > 8 else "")
            msg = (
                f"GradSyncGuard, step {step}: {len(new)} parameter(s) with requires_grad=True got no gradient "
                f"(None or zero) on any rank for {self.no_grad_steps} checked steps: {shown}. Likely cause: the "
                "input of a reentrant-checkpointed block does not require grad (frozen embedding), or a head "
                "detached from the loss. Fix: distckpt.wrap(..., reentrant=False), or set requires_grad=False "
                "on parameters that are meant to be frozen."
            )
            if self.on_no_grad == "raise":
                raise NoGradientError(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=3)
            self._reported.update(new)
        return stuck


def _differs(sumsq: torch.Tensor, proj: torch.Tensor, numel: int, rtol: float) -> str | None:
    """A description of how ranks differ, or None when they agree within ``rtol``.

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
    norms = ", ".join(f"rank {r}: {math.sqrt(s[r]) if s[r] >= 0 else s[r]:.6g}" for r in range(world))
    return (f"ranks {odd} differ from rank {ref} by about {worst:.3g} of its norm "
            f"(L2 norms {norms}; tolerance {rtol:g})")


# --- verify_recompute -----------------------------------------------------------------------------

_RANDOM_OPS = ("bernoulli", "dropout", "rand", "normal", "uniform", "multinomial", "exponential", "cauchy",
               "geometric", "log_normal", "poisson", "random_")
_UNINITIALIZED_OPS = ("empty",)  # outputs of empty/empty_like/new_empty hold garbage: never compared
# Autograd detaches the tensors it saves in the recompute but not in the forward, and autocast casts a
# weight once per autocast region (its cache), so the recompute casts where the forward reused a
# cast: neither is a difference (a cast's value follows from its input, which is compared).
_IGNORED_OPS = frozenset({"aten::detach", "aten::alias", "aten::lift_fresh", "aten::_to_copy"})


@dataclass(frozen=True)
class Mismatch:
    """One place where the checkpointed step differs from the step without checkpointing.

    Attributes:
        module: FQN of the module (a submodule of a checkpointed block, the block, or the owner of a
            differing gradient or buffer).
        kind: ``"rng"``, ``"control_flow"``, ``"shape"``, ``"state"``, ``"batchnorm"``, ``"buffer"``,
            ``"gradient"``, ``"loss"`` or ``"checkpoint_error"``.
        detail: what differs.
        cause: the likely cause and the fix, in words.
    """

    module: str
    kind: str
    detail: str
    cause: str


@dataclass
class RecomputeReport:
    """The result of :func:`verify_recompute`.

    Attributes:
        ok: whether loss, every gradient and every buffer matched.
        blocks: FQNs of the checkpointed blocks that ran.
        loss: (with checkpointing, without).
        max_grad_diff: largest absolute gradient difference over all parameters.
        mismatches: what differs, the first one (in forward order) first.
    """

    ok: bool
    blocks: list[str]
    loss: tuple[float, float]
    max_grad_diff: float
    mismatches: list[Mismatch]

    def __str__(self) -> str:
        if self.ok:
            return (f"recompute exact: {len(self.blocks)} checkpointed block(s), loss {self.loss[0]:.6g}, "
                    f"max gradient difference {self.max_grad_diff:.3g}")
        return "recompute differs:\n" + "\n".join(f"  {m.module} [{m.kind}]: {m.detail}. {m.cause}"
                                                  for m in self.mismatches)


_CAUSES = {
    "rng": "Likely cause: a random op (dropout) is recomputed with another RNG state because the block is "
           "checkpointed with preserve_rng_state=False. Fix: distckpt.wrap(..., preserve_rng_state=True) "
           "(the default).",
    "rng_preserved": "Likely cause: a random op draws from a generator or device whose state checkpointing "
                     "does not save. Fix: use the default generator, or leave this block out of checkpointing.",
    "control_flow": "Likely cause: control flow inside the block reads state (a flag or attribute such as a task "
                    "switch) that changed between forward and backward. Fix: pass it as a forward argument or "
                    "restore it before backward, or leave this block out of checkpointing (wrap's blocks=).",
    "shape": "Likely cause: data-dependent shapes (nonzero, unique, masked_select) or state that changed between "
             "forward and backward. Fix: make the shapes depend only on the block's inputs, or leave this block "
             "out of checkpointing (wrap's blocks=).",
    "state": "Likely cause: the block reads state (an attribute, a global, a buffer or a parameter modified in "
             "place) that changed between forward and backward. Fix: pass it as a forward argument, or leave "
             "this block out of checkpointing (wrap's blocks=).",
    "batchnorm": "Likely cause: BatchNorm running statistics updated a second time by the recompute "
                 "(pytorch#96136). Fix: checkpoint with distckpt.wrap (which restores them) rather than a bare "
                 "torch.utils.checkpoint, or keep BatchNorm outside checkpointed blocks.",
    "buffer": "Likely cause: the block updates this buffer in its forward, and the recompute updates it again. "
              "Fix: leave this block out of checkpointing, or update the buffer outside it.",
    "gradient": "Likely cause: the recompute of a checkpointed block does not reproduce its forward. Fix: run "
                "verify_recompute with the blocks checkpointed one at a time to find it.",
    "loss": "Likely cause: the forward itself differs when checkpointing is on (a module that behaves "
            "differently under checkpointing). Fix: leave the block out of checkpointing.",
    "checkpoint_error": "Likely cause: the recompute saved tensors of other shapes or dtypes than the forward "
                        "(state or data that changed between forward and backward). Fix: see the message; leave "
                        "this block out of checkpointing if it must read such state.",
}


def _storage(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensors without storage (subclasses)
        return -1


def _op_record(name: str, module: str, out: Any, state: frozenset[int] = frozenset()
               ) -> tuple[str, str, list[tuple[Any, ...]]]:
    tensors = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.Tensor)]
    values = []
    for t in tensors:
        t = t.detach()
        # Buffers updated in place (BatchNorm statistics) legitimately differ in the recompute;
        # whether their final value is right is checked on the buffers themselves.
        if t.is_complex() or t.is_sparse or t.device.type == "meta" or _storage(t) in state:
            values.append((tuple(t.shape), t.dtype, None, None))
            continue
        t64 = t.double()
        values.append((tuple(t.shape), t.dtype, float(t64.sum()), float((t64 * t64).sum())))
    return name, module, values


@dataclass
class _Call:
    """One checkpointed call of a block: what its forward ran and what its recompute ran."""

    index: int
    block: str
    preserve_rng: bool
    fwd: list[Any] = field(default_factory=list)
    rec: list[Any] = field(default_factory=list)
    stack: list[str] = field(default_factory=list)


def _recorder(log: list[Any], stack: list[str], state: frozenset[int]) -> Any:
    # A TorchDispatchMode (what selective checkpointing itself uses) sees every op with its outputs;
    # it is the only place where the recompute's intermediate values can be observed.
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            out = func(*args, **(kwargs or {}))
            if func.name() in _IGNORED_OPS:
                return out
            log.append(_op_record(str(func.name()), stack[-1], out, state))
            return out

    return _Recorder()


@contextlib.contextmanager
def _recording(blocks: list[tuple[str, nn.Module]], calls: list[_Call], phase: list[str],
               state: frozenset[int]) -> Iterator[None]:
    """Record per checkpointed call the ops of its forward and of its recompute.

    Non-reentrant blocks: through their ``context_fn`` (checkpoint enters one context around the
    forward and another around the recompute). Reentrant blocks accept no ``context_fn``: their
    submodules' outputs are recorded with forward hooks, which fire in both passes.
    """
    handles = []
    saved: list[tuple[nn.Module, Any]] = []
    current: dict[int, _Call] = {}
    try:
        for bname, block in blocks:
            opts = block._distckpt_options
            saved.append((block, opts))

            def pre(mod: nn.Module, _args: Any, bname: str = bname, opts: Any = opts) -> None:
                if phase[0] == "fwd":
                    call = _Call(len(calls), bname, opts.preserve_rng_state, stack=[bname])
                    calls.append(call)
                    current[id(mod)] = call

            handles.append(block.register_forward_pre_hook(pre))
            for sub_name, sub in block.named_modules():
                if sub is block:
                    continue
                full = f"{bname}.{sub_name}"

                def sub_pre(_m: nn.Module, _a: Any, full: str = full, block: nn.Module = block) -> None:
                    call = current.get(id(block))
                    if call is not None:
                        call.stack.append(full)

                def sub_post(_m: nn.Module, _a: Any, out: Any, full: str = full, block: nn.Module = block,
                             reentrant: bool = opts.reentrant) -> None:
                    call = current.get(id(block))
                    if call is None:
                        return
                    if call.stack and call.stack[-1] == full:
                        call.stack.pop()
                    if reentrant:  # op-level records are not available: record the submodule's output
                        log = call.fwd if phase[0] == "fwd" else call.rec
                        log.append(_op_record(f"{type(_m).__name__} output", full, out, state))

                handles.append(sub.register_forward_pre_hook(sub_pre))
                handles.append(sub.register_forward_hook(sub_post))
            if opts.reentrant:
                continue
            user_fn = opts.context_fn

            def context_fn(block: nn.Module = block, user_fn: Any = user_fn, bname: str = bname) -> tuple[Any, Any]:
                call = current[id(block)]  # context_fn runs in the forward, inside this call
                fwd_user, rec_user = user_fn() if user_fn else (contextlib.nullcontext(), contextlib.nullcontext())

                @contextlib.contextmanager
                def ctx(log: list[Any]) -> Iterator[None]:
                    current[id(block)] = call  # submodule hooks tag ops with this call's module stack
                    call.stack[:] = [bname]  # a recompute stopped early leaves submodules on the stack
                    with fwd_or_rec(log), _recorder(log, call.stack, state):
                        yield

                def fwd_or_rec(log: list[Any]) -> Any:
                    return fwd_user if log is call.fwd else rec_user

                return ctx(call.fwd), ctx(call.rec)

            block._distckpt_options = dataclasses.replace(opts, context_fn=context_fn)
        yield
    finally:
        for h in handles:
            h.remove()
        for block, opts in saved:
            block._distckpt_options = opts


def _values_differ(a: tuple[Any, ...], b: tuple[Any, ...], rtol: float) -> bool:
    (_, _, s1, q1), (_, _, s2, q2) = a, b
    if s1 is None or s2 is None:
        return False
    if any(math.isnan(x) for x in (s1, q1, s2, q2)):
        return not all(math.isnan(x) == math.isnan(y) for x, y in ((s1, s2), (q1, q2)))
    # Outputs differing by d (L2) change the sum of squares by at most 2|x||d| and the sum by at
    # most sqrt(n)|d|: both bounds at |d| = rtol * |x|.
    norm = math.sqrt(max(q1, q2, 0.0))
    n = max(1, math.prod(a[0]))
    return abs(q1 - q2) > 2 * rtol * norm * norm + 1e-30 or abs(s1 - s2) > rtol * norm * math.sqrt(n) + 1e-30


def _first_mismatch(call: _Call, rtol: float) -> Mismatch | None:
    """The first op (or submodule output) whose recompute differs from its forward."""
    fwd, rec = call.fwd, call.rec
    if not rec:
        return None
    # Non-reentrant checkpoint stops the recompute once it has what backward needs: compare the prefix.
    for k, ((fname, fmod, fvals), (rname, _rmod, rvals)) in enumerate(zip(fwd, rec)):
        if fname != rname or len(fvals) != len(rvals):
            return Mismatch(fmod, "control_flow",
                            f"op #{k} of the recompute is {rname}, the forward ran {fname}", _CAUSES["control_flow"])
        if any(_UNINITIALIZED in fname for _UNINITIALIZED in _UNINITIALIZED_OPS):
            continue
        for fv, rv in zip(fvals, rvals):
            if fv[0] != rv[0] or fv[1] != rv[1]:
                return Mismatch(fmod, "shape", f"{fname} (op #{k}) gave shape {list(rv[0])} {rv[1]} in the "
                                f"recompute, {list(fv[0])} {fv[1]} in the forward", _CAUSES["shape"])
            if _values_differ(fv, rv, rtol):
                random = any(r in fname.lower() for r in _RANDOM_OPS)
                kind = "rng" if random else "state"
                cause = _CAUSES[("rng_preserved" if call.preserve_rng else "rng") if random else "state"]
                return Mismatch(fmod, kind, f"{fname} (op #{k}) gave other values in the recompute "
                                f"(sum {rv[2]:.6g} vs {fv[2]:.6g} in the forward)", cause)
    return None


def _rng_state() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[torch.Tensor, list[torch.Tensor] | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


def _grads(params: list[tuple[str, nn.Parameter]]) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else _local(p.grad)[0].detach().clone() for n, p in params}


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> bool:
    if a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    a64, b64 = a.double(), b.double()
    scale = float(b64.abs().max()) if b64.isfinite().all() else 0.0
    return torch.allclose(a64, b64, rtol=rtol, atol=atol + rtol * scale, equal_nan=True)


def _owner_kind(model: nn.Module, buffer_fqn: str) -> str:
    owner = buffer_fqn.rpartition(".")[0]
    try:
        mod = model.get_submodule(owner) if owner else model
    except AttributeError:
        return "buffer"
    return "batchnorm" if isinstance(mod, nn.modules.batchnorm._NormBase) else "buffer"


def _scalar(loss: Any) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ConfigError(f"verify_recompute: loss_fn(model) must return a scalar tensor, got {type(loss).__name__}"
                          f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}. Return loss.mean() or sum.")
    return loss


def _step(model: nn.Module, loss_fn: Callable[[nn.Module], torch.Tensor]) -> torch.Tensor:
    loss = _scalar(loss_fn(model))
    loss.backward()
    return loss.detach().clone()


def verify_recompute(model: nn.Module, loss_fn: Callable[[nn.Module], torch.Tensor], *, rtol: float = 1e-5,
                     atol: float = 1e-8, raise_on_mismatch: bool = True) -> RecomputeReport:
    """Run one step with checkpointing as configured and once without; check they agree.

    Both runs start from the same CPU and CUDA RNG state and the same buffers. Compared: the loss,
    every gradient, every buffer (BatchNorm statistics), and, inside each checkpointed block, every
    op of the recompute against the same op of the forward (sums of its outputs), which names the
    first module whose recompute differs. Blocks checkpointed with ``reentrant=True`` are compared
    at the outputs of their submodules instead of op by op. When the model is wrapped in DDP or
    FSDP, each run synchronizes gradients: call it on all ranks (or pass the unwrapped model).

    Afterwards the model is as before: RNG states, buffers and each parameter's ``.grad`` (the
    same tensor object, or None) are restored; no optimizer state is touched.

    Args:
        model: a model with blocks checkpointed by :func:`distckpt.wrap`.
        loss_fn: ``loss_fn(model) -> scalar tensor``: one forward on a fixed batch. It may change
            state (e.g. a task flag) to reproduce what training does.
        rtol: relative tolerance of every comparison.
        atol: absolute tolerance added for gradients and buffers.
        raise_on_mismatch: raise instead of returning a report with ``ok=False``.

    Returns:
        A :class:`RecomputeReport`.

    Raises:
        RecomputeMismatchError: something differs (with ``raise_on_mismatch``); the message names
            the first module whose recompute differs and the likely cause; ``.report`` holds the report.
        ConfigError: ``loss_fn`` does not return a scalar tensor.
    """
    inner = _inner(model)
    blocks = [(_clean_fqn(n), m) for n, m in inner.named_modules() if is_checkpointed(m)]
    params = [(_clean_fqn(n), p) for n, p in inner.named_parameters()]
    buffers = [(_clean_fqn(n), b) for n, b in inner.named_buffers()]
    before_grads = [p.grad for _, p in params]
    before_bufs = [b.detach().clone() for _, b in buffers]
    rng = _rng_state()
    calls: list[_Call] = []
    phase = ["fwd"]
    error: Exception | None = None

    def restore_buffers() -> None:
        with torch.no_grad():
            for (_, b), v in zip(buffers, before_bufs):
                b.copy_(v)

    try:
        for _, p in params:
            p.grad = None
        with _recording(blocks, calls, phase, frozenset(_storage(b) for _, b in buffers)):
            loss = _scalar(loss_fn(model))
            phase[0] = "rec"
            try:
                loss.backward()
            except tuc.CheckpointError as e:  # torch's own check of the recomputed saved tensors
                error = e
            loss_a = loss.detach().clone()
        grads_a = _grads(params)
        bufs_a = [b.detach().clone() for _, b in buffers]
        restore_buffers()
        _set_rng_state(rng)
        for _, p in params:
            p.grad = None
        with checkpointing_disabled(inner):
            loss_b = _step(model, loss_fn)
        grads_b = _grads(params)
        bufs_b = [b.detach().clone() for _, b in buffers]
    finally:
        restore_buffers()
        _set_rng_state(rng)
        for (_, p), g in zip(params, before_grads):
            p.grad = g

    mismatches: list[Mismatch] = []
    if reentrant_calls := [c for c in calls if blocks and c.fwd and _is_reentrant(blocks, c.block)]:
        _match_reentrant(reentrant_calls)
    for call in calls:  # op-level differences first: they name the op
        m = _first_mismatch(call, rtol)
        if m is not None:
            mismatches.append(m)
    if error is not None:
        rec = [c for c in calls if c.rec]
        where = rec[-1].stack[-1] if rec and rec[-1].stack else (blocks[0][0] if blocks else "")
        mismatches.append(Mismatch(where, "checkpoint_error", str(error).strip().splitlines()[0].rstrip("."),
                                   _CAUSES["checkpoint_error"]))
    if not _close(loss_a, loss_b, rtol, atol):
        mismatches.append(Mismatch("", "loss", f"loss {float(loss_a):.8g} with checkpointing, "
                                   f"{float(loss_b):.8g} without", _CAUSES["loss"]))
    max_diff = 0.0
    for name, _ in params:
        a, b = grads_a[name], grads_b[name]
        if a is None or b is None:
            if (a is None) != (b is None):
                mismatches.append(Mismatch(name.rpartition(".")[0], "gradient", f"{name} has a gradient only "
                                           f"{'without' if a is None else 'with'} checkpointing",
                                           _CAUSES["gradient"]))
            continue
        diff = float((a.double() - b.double()).abs().max()) if a.shape == b.shape and a.numel() else 0.0
        max_diff = max(max_diff, diff)
        if not _close(a, b, rtol, atol):
            what = f"max abs diff {diff:.3g}" if a.shape == b.shape else f"shape {list(a.shape)} vs {list(b.shape)}"
            mismatches.append(Mismatch(name.rpartition(".")[0], "gradient", f"gradient of {name} differs ({what})",
                                       _CAUSES["gradient"]))
    for (name, _), a, b in zip(buffers, bufs_a, bufs_b):
        if not _close(a, b, rtol, atol):
            kind = _owner_kind(inner, name)
            mismatches.append(Mismatch(name.rpartition(".")[0], kind,
                                       f"buffer {name} differs after the step with checkpointing", _CAUSES[kind]))
    report = RecomputeReport(ok=not mismatches, blocks=[b for b, _ in blocks], loss=(float(loss_a), float(loss_b)),
                             max_grad_diff=max_diff, mismatches=_dedupe(mismatches))
    if mismatches and raise_on_mismatch:
        first = report.mismatches[0]
        where = f"the recompute of {first.module}" if first.module else "the checkpointed step"
        err = RecomputeMismatchError(f"{where} differs from its forward: {first.detail}. {first.cause}"
                                     + (f" ({len(report.mismatches) - 1} more difference(s) in .report)"
                                        if len(report.mismatches) > 1 else ""))
        err.report = report  # type: ignore[attr-defined]
        raise err
    return report


def _is_reentrant(blocks: list[tuple[str, nn.Module]], name: str) -> bool:
    return any(n == name and m._distckpt_options.reentrant for n, m in blocks)


def _match_reentrant(calls: list[_Call]) -> None:
    """Reentrant recomputes are recorded per block, in backward order: deal them back to the calls."""
    by_block: dict[str, list[_Call]] = {}
    for c in calls:
        by_block.setdefault(c.block, []).append(c)
    for group in by_block.values():
        rec = [r for c in group for r in c.rec]
        for c in group:
            c.rec = []
        for c in reversed(group):  # backward recomputes the last call first
            n = len(c.fwd)
            c.rec, rec = rec[:n], rec[n:]


def _dedupe(mismatches: list[Mismatch]) -> list[Mismatch]:
    seen: set[tuple[str, str]] = set()
    out = []
    for m in mismatches:
        if (m.module, m.kind) not in seen:
            seen.add((m.module, m.kind))
            out.append(m)
    return out
