"""strategy.tp=2 end to end on 4 ranks (a 2x2 ("dp", "tp") mesh): the launcher applies its tensor-parallel plan to
the built-in gpt (q, k, v, fc column-wise; proj, fc_out row-wise) and to a Llama built by transformers (q/k/v/gate/up
column-wise, o/down row-wise), checkpoints the blocks, shards them with FSDP2 over "dp", and trains the tp ranks of a
replica on the same batch; the final parameters (DCP checkpoint) against a single-process run without
checkpointing. The launcher's overrides run on a pool of 4 ranks, as torchrun's workers run them."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import DistPool
from launchkit import TINY, assert_params_equal, compose, final_params, train_on_ranks

from distckpt.errors import ConfigError
from launch.config import validate
from launch.run import train

pytestmark = pytest.mark.launch

STEPS = [*TINY, "trainer.max_steps=4", "trainer.save_every=4", "trainer.keep_last=0", "trainer.guard_every=1"]


@pytest.fixture(scope="module")
def pool4():
    pool = DistPool(world_size=4, timeout=300)
    yield pool
    pool.close()


def _against_single_process(pool, model: list[str], tmp_path: Path) -> str:
    outs = pool.run(train_on_ranks, [*STEPS, *model, "strategy=fsdp2", "strategy.tp=2"], str(tmp_path / "tp"))
    train(compose([*STEPS, *model, "strategy=none", "ac=none"]), run_dir=tmp_path / "none")
    got, want = final_params(tmp_path / "tp", [*STEPS, *model]), final_params(tmp_path / "none", [*STEPS, *model])
    assert_params_equal(got, want, exact=False)
    return outs[0]


def test_gpt_tp2_matches_single_process(pool4, tmp_path):
    out = _against_single_process(pool4, [], tmp_path)
    assert "strategy=fsdp2 x4 (mesh 2 dp x 2 tp)" in out and "0 -> 4 of 4" in out, out
    assert "grad sync: 4 steps compared across 4 ranks, all in sync" in out, out


@pytest.mark.slow
def test_llama_tp2_matches_single_process(pool4, tmp_path):
    """Slow only (transformers' Llama on 4 ranks, about a minute here): the default run takes the plan and the
    launcher path with the built-in gpt above, the Llama names with the plan check in test_config below."""
    pytest.importorskip("transformers")
    out = _against_single_process(pool4, ["model=hf", "model.config_name=llama"], tmp_path)
    assert "(mesh 2 dp x 2 tp)" in out and "checkpointed   full: lm.model.layers.0, lm.model.layers.1" in out, out


@pytest.mark.parametrize(
    "overrides,expect",
    [
        (["strategy=fsdp2", "strategy.tp=2"], None),
        (["strategy=fsdp2", "strategy.tp=3"], "tp=3 does not divide the 4 ranks"),
        (["strategy=ddp", "strategy.tp=2"], "runs with strategy='fsdp2' only"),
        (["strategy=fsdp2", "strategy.tp=0"], "is out of range"),
        (["strategy=fsdp2", "strategy.tp=4", "model.n_head=2"], "tp=4 does not divide the model's n_head=2"),
        (["strategy=fsdp2", "strategy.tp=2", "model=mlp"], "no tensor-parallel plan for blocks.0"),
        (["strategy=fsdp2", "strategy.tp=2", "model=hf", "model.config_name=llama"], None),
        (["strategy=fsdp2", "strategy.tp=2", "model=hf", "model.config_name=llama", "model.kv_heads=1"], "heads=1"),
        (["strategy=fsdp2", "strategy.tp=2", "model=hf"], "no tensor-parallel plan for lm.transformer.h.0"),
    ],
)
def test_tp_is_validated_before_anything_runs(overrides, expect):
    if "model=hf" in overrides:
        pytest.importorskip("transformers")
    tiny = ["data.batch_size=8"] if "model=mlp" in overrides else TINY
    cfg = compose([*tiny, *overrides])
    if expect is None:
        validate(cfg, world_size=4)
        return
    with pytest.raises(ConfigError) as e:
        validate(cfg, world_size=4)
    assert expect in str(e.value) and "strategy.tp" in str(e.value), str(e.value)
