"""TRL's trainers with distckpt on 2 gloo ranks (tests/integrations/trl_fit.py): DPO and SFT with LoRA, reentrant
blocks and not, against TRL's own trainer in one process without checkpointing on the same global batch; TRL's
default ``gradient_checkpointing=True`` taken over; ``with_distckpt(DPOTrainer)``; the docs' TRL example under
torchrun; and what TRL gives without distckpt (docs/integrations.md's TRL table).
"""

from __future__ import annotations

import logging
import os
import tempfile

import pytest

pytest.importorskip("trl")
pytest.importorskip("peft")

import hf_fit as hf  # noqa: E402
import trl_fit  # noqa: E402
from docs_example import docs_example, run_under_torchrun  # noqa: E402
from patterns import assert_matches  # noqa: E402

import distckpt  # noqa: E402
from distckpt.integrations.hf import DistckptCallback, DistckptTrainer, with_distckpt  # noqa: E402

BLOCKS = ["base_model.model.model.layers.0", "base_model.model.model.layers.1"]


@pytest.fixture(scope="module", autouse=True)
def _one_worker():
    """Module-scoped: tests/conftest.py's scheduler keeps this file's tests on one xdist worker (TRL's imports once
    per pair of pool ranks)."""
    yield


@pytest.fixture
def _accelerate_reset():
    env = dict(os.environ)
    yield
    hf._release_accelerate()
    os.environ.clear()
    os.environ.update(env)


@pytest.fixture(scope="module")
def references():
    """TRL's DPO and SFT trainers in this process, no checkpointing, the global batch: {kind: (grads, params)}."""
    env = dict(os.environ)
    try:
        return {kind: trl_fit.reference(kind) for kind in trl_fit.KINDS}
    finally:
        hf._release_accelerate()
        os.environ.clear()
        os.environ.update(env)


def _exact(out, ref):
    assert all("error" not in o for o in out), [o.get("message") for o in out]
    assert_matches([(o["grads"], o["params"]) for o in out], ref)


# DPO runs chosen and rejected in one forward (and the reference forward under no_grad, outside DDP); SFT one forward
# of the padded batch. Reentrant blocks: DDP's static graph, which both satisfy (the same forwards every step).
# The default tier: each trainer, each entry point (with_distckpt, prepare), reentrant off and on, once.
CORE = [("dpo", "distckpt", False), ("sft", "prepare", True)]
REST = [("dpo", "distckpt", True), ("sft", "distckpt", False), ("dpo", "prepare", False)]


def _check_exact(dist_pool, references, cases):
    out = dist_pool.run(trl_fit.sweep, cases, timeout=600)
    for case in cases:
        o0, o1 = out[0][case], out[1][case]
        _exact([o0, o1], references[case[0]])
        assert o0["checkpointed"] == BLOCKS and o0["hf_checkpointing"] is False, (case, o0["checkpointed"])
        assert o0["find_unused"] is False, case
        steps = [h for h in o0["log_history"] if "loss" in h]
        assert len(steps) == trl_fit.STEPS and all(h["distckpt_guard_checks"] == 1 for h in steps), case


@pytest.mark.dist
def test_dpo_and_sft_with_lora_are_exact_with_distckpt(dist_pool, references):
    """with_distckpt(DPOTrainer) and SFTTrainer + prepare, with TRL's default config (gradient_checkpointing=True,
    taken over): exact against TRL's own trainer in one process without checkpointing, GradSyncGuard every step,
    distckpt's DDP flags, HF's checkpointing off and distckpt's blocks on."""
    _check_exact(dist_pool, references, CORE)


@pytest.mark.slow  # the other combinations of the same trainers, entry points and reentrant setting
@pytest.mark.dist
def test_dpo_and_sft_every_entry_point_and_reentrant_setting(dist_pool, references):
    _check_exact(dist_pool, references, REST)


# --- TRL's default, and the refusal when the user turned HF's checkpointing on --------------------------------------


@pytest.mark.usefixtures("_accelerate_reset")
def test_trl_default_checkpointing_is_taken_over_and_logged(caplog):
    """Every TRL config defaults gradient_checkpointing=True, which the user never set: distckpt turns it off and
    says so on rank 0, naming the argument this transformers has; an explicit False says nothing."""
    with caplog.at_level(logging.WARNING, logger="distckpt"):
        o = trl_fit.fit(0, 1, "dpo", "distckpt", batch=2 * trl_fit.BATCH)
    assert "error" not in o, o.get("message")
    assert o["checkpointed"] == BLOCKS and o["hf_checkpointing"] is False
    (line,) = [r.getMessage() for r in caplog.records if r.name.startswith("distckpt")]
    assert f"DPOConfig turns HF's checkpointing on by default ({hf.HF_CKPT}=True)" in line, line
    assert f"Pass {hf.HF_CKPT}=False" in line, line
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="distckpt"):
        o = trl_fit.fit(0, 1, "sft", "prepare", batch=2 * trl_fit.BATCH, **{hf.HF_CKPT: False})
    assert "error" not in o and o["checkpointed"] == BLOCKS, o.get("message")
    assert not [r for r in caplog.records if r.name.startswith("distckpt")]


@pytest.mark.usefixtures("_accelerate_reset")
def test_user_checkpointing_is_refused_with_the_fix_for_trainer_and_trl_users():
    """TrainingArguments' default is off: True there is the user's choice, refused with the fix that works in
    TrainingArguments and in every TRL config, under this transformers' name."""
    from transformers import TrainingArguments

    args = TrainingArguments(tempfile.mkdtemp(), use_cpu=True, report_to="none", **{hf.HF_CKPT: True})
    with pytest.raises(distckpt.ConfigError) as err:
        hf.LossTrainer(model=hf.tiny_model("gpt2"), args=args, callbacks=[DistckptCallback()], loss=hf.seed_loss)
    assert f"Pass {hf.HF_CKPT}=False (TrainingArguments or any TRL config)" in str(err.value), str(err.value)


# --- with_distckpt ---------------------------------------------------------------------------------------------------


def test_with_distckpt_makes_one_prepared_subclass_per_trainer():
    from trl import DPOTrainer, SFTTrainer

    dpo = with_distckpt(DPOTrainer)
    assert dpo is with_distckpt(DPOTrainer) and dpo.__name__ == "DistckptDPOTrainer"
    assert dpo.__mro__[1:3] == (DistckptTrainer, DPOTrainer)  # DistckptTrainer.__init__ runs TRL's, then prepare
    assert with_distckpt(dpo) is dpo and with_distckpt(SFTTrainer) is not dpo
    with pytest.raises(distckpt.ConfigError, match="transformers.Trainer subclass"):
        with_distckpt(DPOTrainer.__init__)


# --- the docs' example under torchrun --------------------------------------------------------------------------------


@pytest.mark.slow  # ~40 s of TRL imports in two torchrun processes; its DPO + with_distckpt case runs by default above
@pytest.mark.dist
def test_docs_trl_example_runs_under_torchrun(tmp_path):
    run = run_under_torchrun(docs_example("TRL"), tmp_path)
    for r in (0, 1):
        assert f"rank {r}: 3 steps, checkpointed 2 blocks, parameters identical on all ranks: True" in run.stdout, (
            run.stdout[-2000:]
        )


# --- what TRL gives without distckpt (docs/integrations.md's TRL table) ---------------------------------------------

_READY_ONCE = "Expected to mark a variable ready only once"
OWN = [(kind, "trl", reentrant) for kind in trl_fit.KINDS for reentrant in (False, True)]


@pytest.mark.slow  # measurements of TRL itself, not of distckpt (whose cases run by default above)
@pytest.mark.dist
def test_trl_own_checkpointing_table(dist_pool, references):
    """TRL's defaults (HF's checkpointing on, Trainer's DDP with find_unused_parameters=True for a PeftModel):
    non-reentrant exact; use_reentrant=True fails on both ranks in the first backward."""
    out = dist_pool.run(trl_fit.sweep, OWN, timeout=600)
    for case in OWN:
        o0, o1 = out[0][case], out[1][case]
        if case[2]:
            for o in (o0, o1):
                assert o.get("error", ("", ""))[0] == "RuntimeError" and _READY_ONCE in o["error"][1], (case, o)
            continue
        _exact([o0, o1], references[case[0]])
        assert o0["checkpointed"] == [] and o0["hf_checkpointing"] is True and o0["find_unused"] is True, case
