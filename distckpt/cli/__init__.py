"""The ``distckpt`` command: ``distckpt doctor`` checks that a model is safe to train with
checkpointing under DDP/FSDP/FSDP2 (see :mod:`distckpt.check.doctor`); ``distckpt plan`` predicts
per-rank memory of each checkpointing policy at any scale (see :mod:`distckpt.cli.plan`)."""

from __future__ import annotations

import argparse
import sys

from distckpt.options import GRAPHS, STRATEGIES

__all__ = ["add_doctor_flags", "add_plan_flags", "doctor_options", "main", "run_plan"]


def add_doctor_flags(parser: argparse.ArgumentParser) -> None:
    """The run flags of ``distckpt doctor``, shared with the launcher's ``python launch/doctor.py``."""
    parser.add_argument(
        "--strategy", choices=STRATEGIES, default=None, help="data parallelism (default: ddp, or the config's strategy)"
    )
    parser.add_argument(
        "--policy",
        default=None,
        help="checkpointing policy, e.g. full, every:2 (default: full, or the blocks the factory already wrapped)",
    )
    parser.add_argument("--reentrant", action="store_true", help="use reentrant checkpointing")
    parser.add_argument(
        "--no-preserve-rng-state",
        dest="preserve_rng_state",
        action="store_false",
        help="recompute without restoring the RNG state",
    )
    parser.add_argument(
        "--graph", choices=GRAPHS, default=None, help="DDP graph setting (default: auto, or the config's)"
    )
    parser.add_argument("--steps", type=int, default=3, help="training steps to run (default 3)")
    parser.add_argument("--nproc", type=int, default=2, help="CPU ranks (default 2)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before a run counts as a hang")


def doctor_options(args: argparse.Namespace, **fields: object):  # -> DoctorOptions (lazy import)
    """The :class:`~distckpt.check.doctor.DoctorOptions` of parsed doctor flags, plus ``fields``.

    Raises:
        ConfigError: ``--steps`` or ``--nproc`` below 1.
    """
    from distckpt.check.doctor import DoctorOptions
    from distckpt.errors import ConfigError

    if args.steps < 1 or args.nproc < 1:
        raise ConfigError("--steps and --nproc must be >= 1.")
    return DoctorOptions(
        strategy=args.strategy,
        policy=args.policy,
        reentrant=args.reentrant,
        preserve_rng_state=args.preserve_rng_state,
        graph=args.graph,
        steps=args.steps,
        nproc=args.nproc,
        timeout=args.timeout,
        **fields,
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="distckpt", description=__doc__.split("(see")[0].strip())
    sub = parser.add_subparsers(dest="command", required=True)
    doc = sub.add_parser(
        "doctor",
        help="run a model for a few steps on 2 CPU ranks under the guards and print a verdict",
        description="Spawn CPU ranks (gloo), build the model, checkpoint and parallelize it, run a few steps with "
        "GradSyncGuard and verify_recompute, and print what is safe and the settings to use. Exit 0 "
        "when safe, 1 otherwise. The model comes from --factory pkg.module:make (make() returns "
        "(model, loss_fn, batch_fn); see distckpt.check.doctor) or from the launcher's Hydra config "
        "(distckpt doctor model=gpt strategy=ddp ... runs launch/doctor.py of the checkout distckpt was "
        "installed from with pip install -e, from any directory, with the same arguments).",
    )
    doc.add_argument("overrides", nargs="*", help="Hydra overrides of the launcher's config (key=value)")
    doc.add_argument("--factory", help="pkg.module:function returning (model, loss_fn, batch_fn)")
    add_doctor_flags(doc)
    plan = sub.add_parser(
        "plan",
        help="predict per-rank memory and recompute of none/full/selective/budget at any scale, on fake tensors",
        description="Build the model from --factory pkg.module:make (the doctor's contract) on fake tensors, trace "
        "one block of each distinct shape, and print per rank: parameters, gradients, optimizer "
        "state, activations, the peak and recompute FLOPs of none, full, selective and the budget "
        "plan, and the blocks the budget would checkpoint. Launcher overrides (distckpt plan model=hf ...) "
        "run launch/plan.py of the checkout distckpt was installed from (pip install -e).",
    )
    plan.add_argument("overrides", nargs="*", help="Hydra overrides of the launcher's config (key=value)")
    plan.add_argument("--factory", help="pkg.module:function returning (model, loss_fn, batch_fn)")
    add_plan_flags(plan)
    return parser


def add_plan_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of ``distckpt plan``."""
    parser.add_argument("--strategy", choices=STRATEGIES, default="fsdp2", help="data parallelism (default fsdp2)")
    parser.add_argument("--world-size", type=int, default=1, help="ranks (default 1)")
    parser.add_argument("--shard-size", type=int, default=None, help="hsdp: ranks that shard (one node's)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (fsdp2; default 1)")
    parser.add_argument("--micro-batch", type=int, default=None, help="per-rank batch (default: the factory's)")
    parser.add_argument("--seq-len", type=int, default=None, help="sequence length (default: the factory's)")
    parser.add_argument("--budget", default=None, help="per-rank memory budget for the budget plan, e.g. 60GiB")
    parser.add_argument("--optimizer", default="adamw", help="adamw (default), adam, sgd, sgd_momentum, none")
    parser.add_argument("--grad-accumulation", action="store_true", help="gradients persist across micro-batches")


def run_plan(args: argparse.Namespace) -> int:
    """``distckpt plan``: print the report. Returns 0, or 2 on a usage error (printed)."""
    from distckpt.cli.plan import plan_at_scale, render
    from distckpt.errors import ConfigError
    from distckpt.select import parse_size

    try:
        if args.world_size < 1:
            raise ConfigError("--world-size must be >= 1.")
        report = plan_at_scale(
            args.factory,
            strategy=args.strategy,
            world_size=args.world_size,
            shard_size=args.shard_size,
            micro_batch=args.micro_batch,
            seq_len=args.seq_len,
            budget=parse_size(args.budget) if args.budget else None,
            optimizer=args.optimizer,
            grad_accumulation=args.grad_accumulation,
            tp=args.tp,
        )
    except ConfigError as e:
        print(f"distckpt plan: {e}", file=sys.stderr)
        return 2
    print(render(report))
    return 0


def _launcher(argv: list[str], command: str) -> int:
    """``distckpt doctor|plan <overrides>``: the checkout's launcher with the same arguments."""
    from distckpt.cli.launcher import run_launcher

    return run_launcher(command, argv[argv.index(command) + 1 :])


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``distckpt`` console script.

    Returns:
        The exit code: 0 safe, 1 not safe, 2 bad usage.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if args.command == "plan":
        if bool(args.factory) == bool(args.overrides):
            print(
                "distckpt plan: give either --factory pkg.module:make or launcher overrides such as model=gpt.",
                file=sys.stderr,
            )
            return 2
        return _launcher(argv, "plan") if args.overrides else run_plan(args)
    from distckpt.check.doctor import doctor
    from distckpt.errors import ConfigError

    if not args.factory and not args.overrides:
        print(
            "distckpt doctor: give --factory pkg.module:make or launcher overrides such as model=gpt.", file=sys.stderr
        )
        return 2
    if args.factory and args.overrides:
        print("distckpt doctor: give either --factory or Hydra overrides, not both.", file=sys.stderr)
        return 2
    try:
        if args.overrides:
            doctor_options(args)  # bad flags are reported here, not by the launcher
            return _launcher(argv, "doctor")
        return doctor(doctor_options(args, factory=args.factory))
    except ConfigError as e:
        print(f"distckpt doctor: {e}", file=sys.stderr)
        return 2
