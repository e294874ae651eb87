"""TRL's trainers with distckpt on 2 gloo ranks (tests/integrations/trl_fit.py): DPO and SFT with LoRA, reentrant
blocks and not, against TRL's own trainer in one process without checkpointing on the same global batch; TRL's
default ``gradient_checkpointing=True`` taken over; ``with_distckpt(DPOTrainer)``; the docs' TRL example under
torchrun; and what TRL gives without distckpt (docs/integrations.md's TRL table). GRPO (tests/integrations/
grpo_fit.py): ``with_distckpt(GRPOTrainer)`` against ``GRPOTrainer`` without checkpointing, the same completions
first, in one process and on 2 ranks.
"""

from __future__ import annotations

import logging
import os
import tempfile

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("peft")

import grpo_fit  # noqa: E402
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


# --- GRPO (tests/integrations/grpo_fit.py) ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def grpo_references():
    """TRL's GRPOTrainer in this process, no checkpointing, the global batch, its generation seeded per rank-sized
    chunk as the ranks' is (grpo_fit.seeded_trainer): {(kind, gradient_accumulation_steps): run}."""
    env = dict(os.environ)
    try:
        return {
            (kind, acc): grpo_fit.fit(
                0, 1, kind, "none", seeded=True, batch=2 * grpo_fit.BATCH, gradient_accumulation_steps=acc
            )
            for kind, acc in {(c[0], c[3]) for c in GRPO_CASES}
        }
    finally:
        hf._release_accelerate()
        os.environ.clear()
        os.environ.update(env)


def _trains(run: dict) -> None:
    """The comparison can fail: completions differ within each group (else every advantage is zero), and every step
    has a gradient that is not zero."""
    assert "error" not in run, run.get("message")
    assert all(len({tuple(c) for c in gen}) > 1 for gen in run["completions"]), run["completions"]
    assert len(run["grads"]) == grpo_fit.STEPS
    for step, grads in enumerate(run["grads"]):
        assert sum(float(g.abs().sum()) for g in grads.values() if g is not None) > 0, f"step {step}: zero gradient"


def _grpo_blocks(kind: str) -> list[str]:
    return BLOCKS if kind == "lora" else ["model.layers.0", "model.layers.1"]


def _evaluations(run: dict, kind: str) -> torch.Tensor:
    """(eval_loss, eval_reward) of each evaluation in the middle of train() ("lora": one after each step)."""
    evals = [(h["eval_loss"], h["eval_reward"]) for h in run["log_history"] if "eval_loss" in h]
    assert len(evals) == (grpo_fit.STEPS if kind == "lora" else 0), run["log_history"]
    return torch.tensor(evals).reshape(-1, 2)


def _guarded_steps(run: dict) -> None:
    steps = [h for h in run["log_history"] if "loss" in h]
    assert len(steps) == grpo_fit.STEPS and all(h["distckpt_guard_checks"] == 1 for h in steps), steps


@pytest.mark.usefixtures("_accelerate_reset")
@pytest.mark.parametrize("kind", list(grpo_fit.KINDS))
def test_grpo_with_distckpt_is_exact_in_one_process(kind, caplog):
    """with_distckpt(GRPOTrainer), TRL's sampling as it is: the same completions as GRPOTrainer without
    checkpointing from the same seed (generation through the checkpointed blocks under no_grad, with the KV cache),
    the same gradients every step and the same parameters after; TRL's default checkpointing taken over, logged."""
    batch = 2 * grpo_fit.BATCH
    ref = grpo_fit.fit(0, 1, kind, "none", batch=batch)
    _trains(ref)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="distckpt"):
        run = grpo_fit.fit(0, 1, kind, "distckpt", batch=batch)
    assert "error" not in run, run.get("message")
    (line,) = [r.getMessage() for r in caplog.records if r.name.startswith("distckpt")]
    assert f"GRPOConfig turns HF's checkpointing on by default ({hf.HF_CKPT}=True)" in line, line
    assert run["checkpointed"] == _grpo_blocks(kind) and run["hf_checkpointing"] is False, run["checkpointed"]
    assert run["completions"] == ref["completions"]
    assert_matches([(run["grads"], run["params"])], (ref["grads"], ref["params"]))
    torch.testing.assert_close(_evaluations(run, kind), _evaluations(ref, kind), rtol=1e-5, atol=1e-6)
    _guarded_steps(run)


# Each kind with reentrant blocks and without (reentrant: DDP's static graph; GRPO's forward with gradients is the same
# every step, its forwards without gradients run on the unwrapped model, outside DDP); LoRA with 2 micro-batches per
# step (one generation split over them, the first without DDP's sync: distckpt.accumulate); TRL without distckpt on
# the ranks, for its evaluation loss. (kind, how, reentrant, gradient_accumulation_steps); all six take ~3 s.
GRPO_CASES = [(kind, "distckpt", reentrant, 1) for kind in grpo_fit.KINDS for reentrant in (False, True)]
GRPO_CASES.append(("lora", "distckpt", False, 2))
TRL_EVAL = ("lora", "none", False, 1)


def _check_grpo_exact(dist_pool, grpo_references, cases):
    out = dist_pool.run(grpo_fit.sweep, [*cases, TRL_EVAL], timeout=240)  # the pool's restart before pytest's 300 s
    for case in [*cases, TRL_EVAL]:
        assert all("error" not in out[r][case] for r in (0, 1)), [out[r][case].get("message") for r in (0, 1)]
    for case in cases:
        o0, o1, ref = out[0][case], out[1][case], grpo_references[case[0], case[3]]
        _trains(ref)
        # Each rank drew its half of every generation batch, as the reference drew the whole.
        assert [a + b for a, b in zip(o0["completions"], o1["completions"], strict=True)] == ref["completions"], case
        assert_matches([(o["grads"], o["params"]) for o in (o0, o1)], (ref["grads"], ref["params"]))
        assert o0["checkpointed"] == _grpo_blocks(case[0]) and o0["hf_checkpointing"] is False, case
        assert o0["find_unused"] is False, case
        _guarded_steps(o0)
        # The evaluations' rewards are the reference's; their loss depends on the layout in TRL itself (measured, the
        # first evaluation: 0.1668 on 2 ranks with or without distckpt, 0.000176 in one process, on the same
        # completions and weights), so it is compared with TRL's own run on the ranks.
        got = _evaluations(o0, case[0])
        torch.testing.assert_close(got[:, 1], _evaluations(ref, case[0])[:, 1], rtol=1e-5, atol=1e-6)
        if case[0] == TRL_EVAL[0] and case[3] == TRL_EVAL[3]:
            torch.testing.assert_close(got, _evaluations(out[0][TRL_EVAL], case[0]), rtol=1e-5, atol=1e-6)


@pytest.mark.dist
def test_grpo_two_ranks_is_exact_with_distckpt(dist_pool, grpo_references):
    """with_distckpt(GRPOTrainer) on 2 ranks, a group of completions split across them, reentrant blocks and not:
    exact against GRPOTrainer in one process without checkpointing on the same global batch and the same
    completions (LoRA, its reference the model with the adapters disabled; the full model, with a separate reference
    model and num_iterations=2)."""
    _check_grpo_exact(dist_pool, grpo_references, GRPO_CASES)
