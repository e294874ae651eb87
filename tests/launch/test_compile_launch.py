"""``strategy.compile=BACKEND``: the launcher compiles each block (parallelize's compile=), and the run trains to the
same parameters as without it; an unknown backend is refused by --check's validation, naming the setting."""

from __future__ import annotations

import pytest
import torch
from launchkit import TINY, assert_params_equal, compose, final_params

from distckpt.errors import ConfigError
from launch.config import validate
from launch.run import train

# One process (strategy=none: parallelize compiles the blocks and returns the model), dropout on, 4 steps.
RUN = [*TINY, "strategy=none", "trainer.max_steps=4", "trainer.save_every=4", "model.dropout=0.1"]


def test_compiled_run_trains_to_the_same_parameters(tmp_path):
    torch.compiler.reset()
    try:
        train(compose(RUN), run_dir=tmp_path / "eager")
        res = train(compose([*RUN, "strategy.compile=aot_eager"]), run_dir=tmp_path / "compiled")
    finally:
        torch.compiler.reset()
    assert res.step == 4 and res.skipped_steps == []
    # aot_eager runs the same aten ops as eager (dropout masks included): bitwise the same parameters.
    assert_params_equal(final_params(tmp_path / "compiled", RUN), final_params(tmp_path / "eager", RUN), exact=True)


def test_unknown_backend_is_refused():
    with pytest.raises(ConfigError, match="strategy.compile='nope' is not a torch.compile backend.*inductor"):
        validate(compose([*RUN, "strategy.compile=nope"]), world_size=1)
