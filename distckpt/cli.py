"""The ``distckpt`` command: ``distckpt doctor`` checks that a model is safe to train with
checkpointing under DDP/FSDP/FSDP2 (see :mod:`distckpt.doctor`)."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="distckpt", description=__doc__.split("(see")[0].strip())
    sub = parser.add_subparsers(dest="command", required=True)
    doc = sub.add_parser(
        "doctor",
        help="run a model for a few steps on 2 CPU ranks under the guards and print a verdict",
        description="Spawn CPU ranks (gloo), build the model, checkpoint and parallelize it, run a few steps with "
                    "GradSyncGuard and verify_recompute, and print what is safe and the settings to use. Exit 0 "
                    "when safe, 1 otherwise. The model comes from --factory pkg.module:make (make() returns "
                    "(model, loss_fn, batch_fn); see distckpt.doctor) or from the launcher's Hydra config "
                    "(distckpt doctor model=gpt strategy=ddp ...).",
    )
    doc.add_argument("overrides", nargs="*", help="Hydra overrides of the launcher's config (key=value)")
    doc.add_argument("--factory", help="pkg.module:function returning (model, loss_fn, batch_fn)")
    doc.add_argument("--strategy", choices=("none", "ddp", "fsdp", "fsdp2"), default=None,
                     help="data parallelism (default: ddp, or the config's strategy)")
    doc.add_argument("--policy", default=None, help="checkpointing policy, e.g. full, every:2 (default: full, "
                     "or the blocks the factory already wrapped)")
    doc.add_argument("--reentrant", action="store_true", help="use reentrant checkpointing")
    doc.add_argument("--no-preserve-rng-state", dest="preserve_rng_state", action="store_false",
                     help="recompute without restoring the RNG state")
    doc.add_argument("--graph", choices=("auto", "static", "dynamic"), default=None,
                     help="DDP graph setting (default: auto, or the config's)")
    doc.add_argument("--steps", type=int, default=3, help="training steps to run (default 3)")
    doc.add_argument("--nproc", type=int, default=2, help="CPU ranks (default 2)")
    doc.add_argument("--timeout", type=float, default=300.0, help="seconds before a run counts as a hang")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``distckpt`` console script.

    Returns:
        The exit code: 0 safe, 1 not safe, 2 bad usage.
    """
    args = _parser().parse_args(argv)
    from distckpt.doctor import DoctorOptions, doctor
    from distckpt.errors import ConfigError

    if not args.factory and not args.overrides:
        print("distckpt doctor: give --factory pkg.module:make or launcher overrides such as model=gpt.",
              file=sys.stderr)
        return 2
    if args.factory and args.overrides:
        print("distckpt doctor: give either --factory or Hydra overrides, not both.", file=sys.stderr)
        return 2
    if args.steps < 1 or args.nproc < 1:
        print("distckpt doctor: --steps and --nproc must be >= 1.", file=sys.stderr)
        return 2
    opts = DoctorOptions(factory=args.factory, overrides=list(args.overrides), strategy=args.strategy,
                         policy=args.policy, reentrant=args.reentrant, preserve_rng_state=args.preserve_rng_state,
                         graph=args.graph, steps=args.steps, nproc=args.nproc, timeout=args.timeout)
    try:
        return doctor(opts)
    except ConfigError as e:
        print(f"distckpt doctor: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
