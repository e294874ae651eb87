"""The seed's pattern from config (pytorch#121594): a pretrained LM fine-tuned with LoRA on two tasks whose
data sets are mixed by sampling weight, one forward per task batch before one backward, under DDP and
FSDP2 on 2 ranks against a single process without checkpointing; the LoRA adapter each run writes loads
with peft (the launcher's 2-rank LoRA test, once a torchrun of its own in test_hf.py)."""

from __future__ import annotations

import importlib.util
import json

import pytest
from launchkit import (
    assert_params_equal,
    assert_saved_adapter,
    compose,
    example_commands,
    final_params,
    launcher_overrides,
    run_script,
    train_on_ranks,
)

from distckpt.errors import ConfigError
from launch.config import validate
from launch.run import train

# Skipped without peft, not imported at collection (by every pytest-xdist worker: ~6 s of CPU each).
pytestmark = [pytest.mark.launch, pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="needs peft")]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    # examples/tiny_pretrained.py's two docstring commands as written (the tiny pretrained directory, then the
    # LoRA fine-tune on two tasks, here with fewer samples and steps): the examples test of that example
    # (tests/launch/test_examples.py) and this file's 2-rank runs, without a torchrun of its own.
    root = tmp_path_factory.mktemp("multitask")
    pre = str(root / "gpt2-tiny")
    make, cmd = example_commands("tiny_pretrained.py")
    assert make[0] == "python"
    run_script([pre if w == "/tmp/gpt2-tiny" else w for w in make[1:]])  # in this process: transformers is here
    example = [w.replace("/tmp/gpt2-tiny", pre) for w in launcher_overrides(cmd)]
    assert {
        "model.lora.r=4",
        "data=multitask",
        "data.batch_size=12",
        "data.tasks.lm.weight=2",
        "data.tasks.cls.weight=1",
    } <= set(example)  # 8 lm + 4 cls samples per batch
    over = [
        *example,
        "model.seq_len=16",
        "model.lora.alpha=8",  # alpha: reaches the saved adapter config
        "data.tasks.lm.data.n=48",
        "data.tasks.cls.data.n=24",  # 6 batches per epoch each: 8 steps cross one
        "+trainer.task_weights={lm: 1.0, cls: 0.5}",
        "trainer=debug",
        "trainer.max_steps=8",
        "trainer.save_every=0",
        "trainer.eval_every=0",
    ]
    ref = train(compose([*over, "strategy=none", "ac=none"]), run_dir=root / "ref")
    return over, root / "ref", ref, pre


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_task_lora_on_2_ranks_matches_a_single_process(strategy, setup, dist_pool, tmp_path):
    over, ref_dir, ref, pretrained = setup
    # On the pool's 2 ranks as torchrun's workers run it (launchkit.train_on_ranks; torchrun: test_torchrun.py).
    out = dist_pool.run(
        train_on_ranks, [*over, f"strategy={strategy}", "trainer.guard_every=1"], str(tmp_path / strategy)
    )
    assert "grad sync: 8 steps compared across 2 ranks, all in sync" in out[0]
    assert "hf weights" in out[0]
    records = [json.loads(line) for line in (tmp_path / strategy / "metrics.jsonl").read_text().splitlines()]
    for r in records:  # both tasks' losses logged; the loss is their weighted sum
        assert r["loss"] == pytest.approx(r["lm"] + 0.5 * r["cls"], rel=1e-5)
    assert records[-1]["lm"] == pytest.approx(ref.losses["lm"], rel=1e-4)
    assert records[-1]["cls"] == pytest.approx(ref.losses["cls"], rel=1e-4)
    trained = final_params(tmp_path / strategy, over)
    assert_params_equal(trained, final_params(ref_dir, over), exact=False)
    assert_saved_adapter(tmp_path / strategy, pretrained, trained)
    adapter = json.loads((tmp_path / strategy / "hf" / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"]) == (4, 8)


def test_task_shares_must_split_over_the_ranks(setup):
    over, _, _, _ = setup
    with pytest.raises(
        ConfigError,
        match=r"data.tasks.lm: weight 5 gives 10 of data.batch_size=12 samples, not a "
        r"multiple of 1 ranks x trainer.grad_accum=4",
    ):
        validate(compose([*over, "data.tasks.lm.weight=5", "strategy=none", "trainer.grad_accum=4"]), 1)
    validate(compose([*over, "strategy=none", "trainer.grad_accum=4"]), 1)  # 8 + 4 samples: both split


def test_a_task_must_name_a_loss_of_the_model(setup, tmp_path):
    over, _, _, _ = setup
    bad = [
        *over,
        "strategy=none",
        "+data.tasks.ner={weight: 1.0, data: {name: synthetic, n: 48, n_eval: 0}}",
        "data.batch_size=16",
    ]
    with pytest.raises(
        ConfigError,
        match=r"data.tasks.ner: the model's forward on this task's batch returns "
        r"\['cls', 'lm'\]",
    ):
        train(compose(bad), run_dir=tmp_path / "bad")
