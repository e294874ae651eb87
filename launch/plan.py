"""``python launch/plan.py model=hf model.config_name=llama model.d_model=4096 ... [--world-size 64]``:
``distckpt plan`` on the model and data of the launcher's config (its strategy unless ``--strategy``).

The library's plan takes a factory; this script passes the doctor's factory of a Hydra config
(:func:`launch.subject.build_subject`, unwrapped), so the library never imports the launcher.
``distckpt plan <overrides>`` runs this script (distckpt/cli/launcher.py). Exit 0, or 2 on a bad override.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

if __name__ == "__main__":
    # `python launch/X.py` puts launch/, not the checkout, first on the path: `launch` and `distckpt` from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from distckpt.errors import ConfigError  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """Plan the config of ``argv``'s overrides and print the report.

    Returns:
        The exit code: 0, or 2 on bad usage or a bad override.
    """
    from distckpt.cli import add_plan_flags, run_plan
    from launch.ac import wrap_args
    from launch.subject import build_subject, compose_job

    parser = argparse.ArgumentParser(prog="python launch/plan.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="+", help="Hydra overrides of the launcher's config (key=value)")
    add_plan_flags(parser)
    parser.set_defaults(strategy=None, optimizer=None, tp=None)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = compose_job(args.overrides)
        # The run's own facts, as training hands them to a budget (launch.ac.wrap_args), unless a flag says.
        facts = wrap_args(cfg, args.world_size).facts
    except ConfigError as e:
        print(f"distckpt plan: {e}", file=sys.stderr)
        return 2
    args.strategy = args.strategy or facts.strategy
    args.optimizer = args.optimizer or facts.optimizer
    args.grad_accumulation = args.grad_accumulation or facts.grad_accumulation
    if args.shard_size is None and args.strategy == "hsdp":
        args.shard_size = cfg.strategy.get("shard_size")
    if args.tp is None:
        args.tp = int(cfg.strategy.get("tp", 1)) if args.strategy == cfg.strategy.name else 1
    # The launcher's whole global batch is one micro-batch unless --micro-batch says otherwise.
    args.factory = functools.partial(build_subject, tuple(args.overrides), False, 1, True)
    return run_plan(args)


if __name__ == "__main__":
    sys.exit(main())
