"""``python launch/doctor.py model=gpt strategy=ddp ... [--steps N]``: ``distckpt doctor`` on the model,
data and checkpointing of the launcher's config, built by the launcher's own builders.

The library's doctor takes a factory (``distckpt doctor --factory pkg.mod:make``); this script is the
factory of a Hydra config, so the library never imports the launcher. ``distckpt doctor <overrides>``
runs this script (distckpt/cli/launcher.py). Exit 0 safe, 1 not safe, 2 bad usage or override.
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


def _parser() -> argparse.ArgumentParser:
    from distckpt.cli import add_doctor_flags

    parser = argparse.ArgumentParser(prog="python launch/doctor.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="+", help="Hydra overrides of the launcher's config (key=value)")
    add_doctor_flags(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Diagnose the config of ``argv``'s overrides and print the verdict.

    Returns:
        The exit code: 0 safe, 1 not safe, 2 bad usage or override.
    """
    from distckpt.check.doctor import doctor
    from distckpt.cli import doctor_options
    from launch.config import validate
    from launch.subject import build_subject, compose_job, job_world

    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        # The job doctor runs: --nproc ranks under the config's (or --strategy's) strategy, validated as
        # launch/train.py validates it (ranges, combinations, the ac group on a meta model).
        cfg = compose_job(args.overrides, args.strategy)
        validate(cfg, world_size=job_world(cfg, args.nproc))
        opts = doctor_options(args, label=" ".join(args.overrides), policy_label=str(cfg.ac.policy))
        opts.strategy = cfg.strategy.name
        opts.graph = opts.graph or cfg.strategy.graph
        # The config's checkpointing, as training applies it, unless --policy overrides it (then the doctor wraps).
        opts.factory = functools.partial(
            build_subject,
            tuple(args.overrides),
            opts.policy is None,
            opts.nproc,
            opts.preserve_rng_state,
            args.strategy,
        )
        return doctor(opts)
    except ConfigError as e:
        print(f"distckpt doctor: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
