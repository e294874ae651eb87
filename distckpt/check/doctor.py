"""``distckpt doctor``: run a user's model for a few steps on 2 CPU ranks with checkpointing and the
chosen strategy, under the guards, and print whether it is safe and which settings to use.

The factory contract (``--factory pkg.module:make``): ``make()`` returns ``(model, loss_fn, batch_fn)``:

* ``model``: an ``nn.Module``, not wrapped in DDP/FSDP. If it already has blocks checkpointed by
  :func:`distckpt.apply.wrap`, they are kept (unless ``--policy`` is given); otherwise ``--policy`` (default
  ``full``) is applied.
* ``loss_fn(model, batch) -> scalar tensor``: the loss of one forward (a mean over the batch).
* ``batch_fn(step, rank, world_size) -> batch``: rank ``rank``'s share of the global batch of ``step``.

``make`` runs once on every rank after the process group is up and after ``torch.manual_seed(0)``,
so every rank builds the same initial model.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from distckpt.errors import error_line
from distckpt.factory import load_factory

__all__ = ["DoctorOptions", "Finding", "doctor", "load_factory"]


@dataclass
class DoctorOptions:
    """What ``distckpt doctor`` runs (the command line's flags)."""

    # "pkg.module:function", or a picklable zero-argument callable with the same contract (the
    # launcher's `python launch/doctor.py` passes one that builds its Hydra config's model).
    factory: str | Callable[[], Any] | None = None
    label: str | None = None  # what is diagnosed, for the verdict's first line (default: the factory)
    strategy: str | None = None  # None: ddp
    policy: str | None = None
    reentrant: bool = False
    preserve_rng_state: bool = True
    graph: str | None = None  # None: auto
    policy_label: str | None = None  # the policy the factory applied itself (the launcher's config), for the verdict
    # Checkpoint exactly these blocks (FQNs), replacing what the factory wrapped: how a suggestion is re-verified.
    blocks: list[str] | None = None
    steps: int = 3
    nproc: int = 2
    lr: float = 1e-2
    timeout: float = 300.0


@dataclass
class Finding:
    """One line of the verdict: a check, whether it passed, what was seen and what to do."""

    check: str
    ok: bool
    detail: str
    fix: str = ""
    data: Any = None


# --- the subject: model, loss and batches, from the factory ----------------------------------------


def _subject(opts: DoctorOptions) -> tuple[nn.Module, Callable[[nn.Module, Any], torch.Tensor], Callable[..., Any]]:
    made = (load_factory(opts.factory) if isinstance(opts.factory, str) else opts.factory)()
    if not (isinstance(made, tuple) and len(made) == 3):
        from distckpt.errors import ConfigError

        raise ConfigError(f"{_label(opts)}() must return (model, loss_fn, batch_fn); got {type(made).__name__}.")
    return made


def _subject_or_error(opts: DoctorOptions) -> tuple[Any, str | None]:
    """The factory's ``(model, loss_fn, batch_fn)``, or the first line of what it raised on any rank (every
    rank learns it, so none goes on alone into a collective)."""
    import torch.distributed as dist

    made, error = None, None
    try:
        made = _subject(opts)
    except Exception as e:  # the user's factory: whatever it raises is a usage error, not a verdict
        error = error_line(e)
    if dist.is_initialized() and dist.get_world_size() > 1:
        errors: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        error = next((f"{err} (rank {r})" for r, err in enumerate(errors) if err), None)
    return made, error


def _label(opts: DoctorOptions) -> str:
    return opts.label or (opts.factory if isinstance(opts.factory, str) else getattr(opts.factory, "__name__", "?"))


# --- one rank ------------------------------------------------------------------------------------


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    from distckpt.runtime.swap import _clean_fqn

    return {_clean_fqn(n): p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _estimate(model: nn.Module, loss_fn: Callable, batch: Any) -> list[tuple[str, int, int]]:
    """(block, activation bytes freed by checkpointing it, FLOPs of its recompute) per checkpointed block."""
    from distckpt.runtime.swap import checkpointed, checkpointing_disabled, is_checkpointed
    from distckpt.select.profile import profile_blocks

    class _Loss(nn.Module):  # profile_blocks runs model(*inputs): let the "model" be the loss
        def __init__(self) -> None:
            super().__init__()
            self.m = model

        def forward(self, b: Any) -> torch.Tensor:
            return loss_fn(self.m, b)

    blocks = [(n, m) for n, m in zip(checkpointed(model), [m for m in model.modules() if is_checkpointed(m)])]
    with checkpointing_disabled(model):
        profiles = profile_blocks(_Loss(), blocks, (batch,), modes=())  # activations and FLOPs: no recompute steps
    # A checkpointed block frees what it saved except its input, which checkpointing keeps.
    return [(p.fqn, p.activation_bytes - p.saved_input_bytes, p.forward_flops) for p in profiles]


def _diagnose(rank: int, world: int, opts: DoctorOptions) -> list[Finding]:
    from distckpt.apply.wrap import wrap
    from distckpt.check.recompute import verify_recompute
    from distckpt.parallel.strategies import parallelize
    from distckpt.runtime.swap import checkpointed, unwrap

    findings: list[Finding] = []
    torch.manual_seed(0)
    made, error = _subject_or_error(opts)
    if error is not None:
        return [Finding("factory", False, error)]
    model, loss_fn, batch_fn = made
    by_doctor = opts.blocks is not None or opts.policy is not None or not checkpointed(model)
    if by_doctor:
        unwrap(model)  # the settings tried replace the factory's own, whole
        wrap(
            model,
            opts.policy or "full",
            blocks=opts.blocks,
            reentrant=opts.reentrant,
            preserve_rng_state=opts.preserve_rng_state,
        )
    blocks = checkpointed(model)
    used = next((m._distckpt_options for m in model.modules() if hasattr(m, "_distckpt_options")), None)
    if used is not None:  # what the blocks really use (the factory may have wrapped them itself)
        findings.append(
            Finding(
                "settings",
                True,
                "",
                data={
                    "reentrant": used.reentrant,
                    "preserve_rng_state": used.preserve_rng_state,
                    "blocks": blocks,
                    "by_doctor": by_doctor,
                },
            )
        )
    modes = checkpointed(model, modes=True)
    shown = [f"{b} ({modes[b]})" if modes.get(b, "full") != "full" else b for b in blocks[:4]]  # op-level modes named
    findings.append(
        Finding(
            "blocks",
            bool(blocks),
            f"{len(blocks)} checkpointed block(s)"
            + (f": {', '.join(shown)}{' ...' if len(blocks) > 4 else ''}" if blocks else ""),
            "" if blocks else "nothing is checkpointed: pass --policy, or wrap blocks in the factory",
        )
    )
    ref = copy.deepcopy(model)
    unwrap(ref)  # the reference: same weights, no checkpointing, one process, the global batch

    # 1. recompute == forward, on this rank's first batch, before any parallel wrapper.
    batch0 = batch_fn(0, rank, world)
    report = verify_recompute(model, lambda m: loss_fn(m, batch0), raise_on_mismatch=False)
    if report.ok:
        findings.append(
            Finding(
                "recompute",
                True,
                f"recompute is exact (loss, every gradient and buffer; max "
                f"gradient difference {report.max_grad_diff:.2g})",
            )
        )
    else:
        first = report.mismatches[0]
        findings.append(
            Finding(
                "recompute",
                False,
                f"{first.module or 'the step'} [{first.kind}]: {first.detail}",
                first.cause,
                data={
                    "kind": first.kind,
                    "module": first.module,
                    "all": [(m.kind, m.module) for m in report.mismatches],
                },
            )
        )
    try:  # on every rank: profile_blocks makes the ranks agree on their numbers (a collective)
        findings.append(Finding("estimate", True, "", data=_estimate(model, loss_fn, batch0)))
    except Exception as e:  # an estimate is a nicety: never fail the diagnosis on it
        findings.append(Finding("estimate", True, f"unavailable ({type(e).__name__}: {e})"))

    # 2. a few steps under the strategy and the guard, against the single-process reference.
    try:
        pmodel = parallelize(model, opts.strategy, graph=opts.graph)
    except Exception as e:
        findings.append(Finding("parallelize", False, f"{type(e).__name__}: {e}"))
        return findings
    findings += _train_against_reference(pmodel, ref, loss_fn, batch_fn, rank, world, opts)
    return findings


def _train_against_reference(
    pmodel: nn.Module, ref: nn.Module, loss_fn: Callable, batch_fn: Callable, rank: int, world: int, opts: DoctorOptions
) -> list[Finding]:
    """``opts.steps`` SGD steps of the parallel model under GradSyncGuard, each compared with the
    single-process reference on the global batch."""
    from distckpt.check.sync_guard import GradSyncGuard

    guard = GradSyncGuard(pmodel, params_every=1, no_grad_steps=min(2, opts.steps), on_no_grad="ignore")
    opt = torch.optim.SGD([p for p in pmodel.parameters() if p.requires_grad], lr=opts.lr)
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=opts.lr)
    worst, no_grad = 0.0, []
    for step in range(opts.steps):
        rng = torch.get_rng_state()
        done = _parallel_step(pmodel, loss_fn, batch_fn, guard, step, rank, world, opts.strategy)
        if isinstance(done, Finding):
            return [done]
        value, rep = done
        after = torch.get_rng_state()
        ref_norm = _reference_grad_norm(ref, loss_fn, batch_fn, step, world, rng)
        torch.set_rng_state(after)
        if _any_rank(not all(math.isfinite(v) for v in (value, rep.grad_norm or 0.0, ref_norm))):
            return [
                Finding(
                    "finite",
                    False,
                    f"step {step}: loss {value:.4g}, global gradient norm "
                    f"{rep.grad_norm or 0.0:.4g}, without checkpointing on one process "
                    f"{ref_norm:.4g}",
                    "a non-finite loss or gradient is never safe: fix the "
                    "model, loss, data or lr first (it is not a checkpointing setting)",
                )
            ]
        worst = max(worst, abs((rep.grad_norm or 0.0) - ref_norm) / max(ref_norm, 1e-12))
        no_grad = rep.no_grad
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    return _training_verdict(worst, no_grad, world, opts.steps)


def _parallel_step(
    pmodel: nn.Module,
    loss_fn: Callable,
    batch_fn: Callable,
    guard: Any,
    step: int,
    rank: int,
    world: int,
    strategy: str | None,
) -> tuple[float, Any] | Finding:
    """Forward and backward of ``step`` on this rank's batch, then the guard's check: ``(loss, the guard's
    report)``, or the Finding that ends the diagnosis (gradients out of sync, or the step raised)."""
    from distckpt.errors import GradDesyncError

    try:
        loss = loss_fn(pmodel, batch_fn(step, rank, world))
        loss.backward()
        rep = guard.check()
    except GradDesyncError as e:
        return Finding(
            "sync",
            False,
            f"step {step}: {e}".split(" Likely cause")[0],
            "gradients were not synchronized: use reentrant=False and graph='auto'",
        )
    except Exception as e:
        return Finding(
            "step",
            False,
            f"step {step} under {strategy}: {type(e).__name__}: "
            f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}",
        )
    return float(loss.detach()), rep


def _reference_grad_norm(
    ref: nn.Module, loss_fn: Callable, batch_fn: Callable, step: int, world: int, rng: torch.Tensor
) -> float:
    """The global gradient norm of ``step`` without checkpointing, in one process: what DDP computes, the mean
    over ranks of each rank's gradient. Every rank replays each rank's batch from the same RNG state ``rng``
    (dropout masks agree); the RNG is left where the last replay left it."""
    for r in range(world):
        torch.set_rng_state(rng)
        (loss_fn(ref, batch_fn(step, r, world)) / world).backward()
    ref_grads = list(_grads(ref).values())
    return float(torch.stack([g.double().norm() for g in ref_grads]).norm()) if ref_grads else 0.0


def _training_verdict(worst: float, no_grad: list[str], world: int, steps: int) -> list[Finding]:
    """The findings of a run that finished its steps: in sync (the guard never raised), as the reference
    (``worst``: the largest relative difference of the global gradient norms), every parameter trained."""
    return [
        Finding(
            "sync",
            True,
            f"gradients identical across {world} ranks on {steps} step(s), parameters too (GradSyncGuard)",
        ),
        Finding(
            "reference",
            worst <= 1e-4,
            f"global gradient norm vs one process without "
            f"checkpointing on the global batch: max relative difference {worst:.2g}",
            ""
            if worst <= 1e-4
            else "the parallel run computes other gradients than the model "
            "itself: check the loss is a mean over equal rank batches, and use reentrant=False",
        ),
        Finding(
            "gradients",
            not no_grad,
            "every trainable parameter got a gradient"
            if not no_grad
            else f"no gradient on any rank for {len(no_grad)} trainable parameter(s): {', '.join(no_grad[:5])}",
            ""
            if not no_grad
            else "use reentrant=False (a frozen input under reentrant "
            "checkpointing), or set requires_grad=False on parameters meant to be frozen",
        ),
    ]


def _any_rank(flag: bool) -> bool:
    """``flag`` on any rank (a collective: every rank calls it at the same point)."""
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return flag
    t = torch.tensor([1.0 if flag else 0.0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


# --- the parent: spawn, collect, print -----------------------------------------------------------


def _run_ranks(opts: DoctorOptions) -> dict[int, list[Finding]]:
    from distckpt._spawn import RankFailure, run_ranks

    ranks = run_ranks(_diagnose, opts.nproc, opts, timeout=opts.timeout, pg_timeout=min(60.0, opts.timeout / 2))
    results: dict[int, list[Finding]] = {}
    for rank, value in ranks.items():
        if not isinstance(value, RankFailure):
            results[rank] = value
        elif value.kind == "timeout":
            results[rank] = [
                Finding(
                    "hang",
                    False,
                    f"{value.message}: a collective one rank never joined",
                    "run with --strategy none to isolate the model, then compare reentrant/graph settings",
                )
            ]
        else:  # raised outside the checks, which report their own failures as findings
            results[rank] = [Finding("doctor", False, f"{value.kind}: {value.message}", value.traceback)]
    return results


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


# Recompute mismatches that are the block's own (each block's recompute is compared with its own
# forward, so one broken block does not make another look broken); gradient and loss differences are
# consequences: every block upstream of a broken one gets other gradients.
_OWN_BLOCK = ("control_flow", "state", "shape", "buffer", "batchnorm", "checkpoint_error")
_RUN_LEVEL = ("sync", "step", "gradients", "reference", "hang")


@dataclass(frozen=True)
class _Settings:
    """A wrap/parallelize setting: what was tried, or a fix of it."""

    reentrant: bool
    preserve_rng_state: bool
    blocks: tuple[str, ...]  # the checkpointed blocks
    named: bool  # say blocks=[...] in the call (a fix left some out, or the factory chose them)


def _tried(opts: DoctorOptions, used: dict[str, Any] | None) -> _Settings:
    blocks = tuple(used["blocks"]) if used else ()
    named = bool(used and not used["by_doctor"] and opts.policy_label is None and len(blocks) <= 8)
    return _Settings(
        used["reentrant"] if used else opts.reentrant,
        used["preserve_rng_state"] if used else opts.preserve_rng_state,
        blocks,
        named,
    )


def _fixed(tried: _Settings, failed: list[Finding]) -> _Settings:
    """``tried`` with the fixes the failed findings call for (it may be ``tried`` itself: nothing to change)."""
    reentrant, preserve, exclude = tried.reentrant, tried.preserve_rng_state, set()
    for f in failed:
        if f.check == "recompute" and isinstance(f.data, dict):
            pairs = f.data.get("all") or [(f.data["kind"], f.data["module"])]
            own = [(k, m) for k, m in pairs if k in (*_OWN_BLOCK, "rng")]
            for kind, module in own or pairs[:1]:
                if kind == "rng" and not tried.preserve_rng_state:
                    preserve = True
                elif kind in (*_OWN_BLOCK, "rng", "gradient"):  # rng with preserved state: a generator it misses
                    exclude |= {b for b in tried.blocks if module == b or module.startswith(b + ".")}
        elif f.check in _RUN_LEVEL and not f.ok:
            reentrant = False
    keep = tuple(b for b in tried.blocks if b not in exclude)
    return _Settings(reentrant, preserve, keep, tried.named or bool(exclude))


def _call(opts: DoctorOptions, s: _Settings) -> str:
    policy = opts.policy or opts.policy_label or "full"
    if s.named and policy not in ("full", "selective"):
        policy = "full"  # the blocks are listed: a policy choosing among them would choose again
    call = f'distckpt.wrap(model, "{policy}", reentrant={s.reentrant}, preserve_rng_state={s.preserve_rng_state}'
    if s.named:
        call += f", blocks={list(s.blocks)!r}"
    return call + f'); distckpt.parallelize(model, "{opts.strategy}", graph="{opts.graph}")'


def _used(results: dict[int, list[Finding]]) -> dict[str, Any] | None:
    return next((f.data for fs in results.values() for f in fs if f.check == "settings"), None)


def _failed(results: dict[int, list[Finding]]) -> list[Finding]:
    return [f for _, fs in sorted(results.items()) for f in fs if not f.ok]


def verified_fix(opts: DoctorOptions, results: dict[int, list[Finding]], rounds: int = 3) -> str | None:
    """Settings that fix the failures of ``results``, re-verified: doctor runs them and they pass.

    Each round applies the fixes the last run's failures call for and runs doctor again with them
    (a block whose recompute broke in backward can hide the breakage of blocks recomputed after it).

    Returns:
        The wrap/parallelize call of the first fix that passes, or None when a round finds nothing to
        change (the failures are not checkpointing settings: a nan loss, a model that differs by rank) or
        ``rounds`` runs did not find one.
    """
    first = _tried(opts, _used(results))
    tried, failed, seen = first, _failed(results), {first}
    for _ in range(rounds):
        fix = _fixed(tried, failed)
        if fix in seen or not fix.blocks:
            return None
        seen.add(fix)
        policy = opts.policy or opts.policy_label or "full"
        again = dataclasses.replace(
            opts,
            policy=policy if policy == "selective" else "full",
            blocks=list(fix.blocks),
            reentrant=fix.reentrant,
            preserve_rng_state=fix.preserve_rng_state,
        )
        run = _run_ranks(again)
        if not _failed(run):
            return _call(opts, fix)
        tried, failed = fix, _failed(run)
    return None


def render(opts: DoctorOptions, results: dict[int, list[Finding]], verified: str | None = None) -> tuple[bool, str]:
    """The verdict text and whether it is safe; ``verified``: settings that doctor ran and that passed
    (see :func:`verified_fix`), suggested when not safe."""
    used = _used(results)
    reentrant = used["reentrant"] if used else opts.reentrant
    preserve = used["preserve_rng_state"] if used else opts.preserve_rng_state
    lines = [
        f"distckpt doctor: {_label(opts)}  "
        f"strategy={opts.strategy} policy={opts.policy or opts.policy_label or 'as wrapped'} "
        f"reentrant={reentrant} "
        f"preserve_rng_state={preserve}  ({opts.nproc} CPU rank(s), {opts.steps} step(s))"
    ]
    safe = True
    seen: dict[tuple[str, str], list[int]] = {}
    estimate = None
    for rank, findings in sorted(results.items()):
        for f in findings:
            if f.check == "estimate":
                estimate = f
                continue
            if f.check == "settings":
                continue
            key = (f.check, f"{'ok' if f.ok else 'FAIL'}\t{f.detail}\t{f.fix}")
            seen.setdefault(key, []).append(rank)
            safe &= f.ok
    for (_check, text), ranks in seen.items():
        status, detail, fix = text.split("\t")
        where = "" if len(ranks) == len(results) else f" (rank {', '.join(map(str, ranks))})"
        lines.append(f"  [{'ok' if status == 'ok' else 'NOT OK'}] {detail}{where}")
        if fix and status != "ok":
            lines.append(f"         {fix if fix.startswith('Likely') else 'fix: ' + fix}")
    if estimate is not None and estimate.data:
        lines.append("  per checkpointed block: activation memory freed / recompute cost (one forward, at most):")
        for fqn, saved, flops in estimate.data:
            lines.append(f"    {fqn:<32} {_fmt_bytes(saved):>10}   {flops / 1e6:10.2f} MFLOP")
    elif estimate is not None:
        lines.append(f"  memory/recompute estimate {estimate.detail}")
    tried = _call(opts, _tried(opts, used))
    if safe:
        lines.append(f"verdict: SAFE. Settings to use: {tried}")
    else:
        lines.append(f"verdict: NOT SAFE (see the NOT OK lines). Settings tried: {tried}")
        lines.append(
            f"  settings to try: {verified}  (doctor ran them: SAFE)"
            if verified
            else "  no checkpointing setting that doctor tried passes: fix what the NOT OK lines name first"
        )
    return safe, "\n".join(lines)


def doctor(opts: DoctorOptions) -> int:
    """Run the diagnosis and print the verdict.

    When a check fails, the fixes it calls for are run by doctor too, and only settings that pass
    are suggested (:func:`verified_fix`).

    Returns:
        0 when every check passed on every rank, 1 otherwise.

    Raises:
        ConfigError: no factory, a factory spec that cannot be imported, or a factory that raised (on
            any rank; its exception in one line).
    """
    opts = dataclasses.replace(opts)
    if isinstance(opts.factory, str):
        load_factory(opts.factory)  # a bad spec is a usage error (ConfigError), before spawning ranks
    elif not callable(opts.factory):
        from distckpt.errors import ConfigError

        raise ConfigError("distckpt doctor needs a factory: --factory pkg.module:make (see distckpt.check.doctor).")
    opts.strategy = opts.strategy or "ddp"
    opts.graph = opts.graph or "auto"
    if opts.strategy == "none":
        opts.nproc = 1  # without data parallelism ranks would not synchronize: one process
    results = _run_ranks(opts)
    raised = next((f.detail for _, fs in sorted(results.items()) for f in fs if f.check == "factory"), None)
    if raised is not None:
        from distckpt.errors import ConfigError

        raise ConfigError(f"the factory {_label(opts)} raised {raised}; doctor diagnoses a model it can build.")
    fix = verified_fix(opts, results) if _failed(results) else None
    safe, text = render(opts, results, fix)
    print(text, flush=True)
    return 0 if safe else 1
