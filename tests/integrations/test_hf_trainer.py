"""distckpt.integrations.hf on 2 gloo ranks: Hugging Face ``Trainer.train`` with ``DistckptCallback`` and
``prepare(trainer)`` against the single-process reference without checkpointing. Every pattern of tests/patterns.py
that one ``compute_loss`` can express (one backward per micro-batch), the seed's case (GPT-2 and Llama with LoRA, two
forwards, reentrant and not), gradient reductions per micro-batch under ``gradient_accumulation_steps``, a desync
injected on one rank, the refusals, the docs' example under torchrun, and what Trainer gives without distckpt.

Each sweep runs in ONE call on the test pool's ranks (tests/integrations/hf_fit.py): Trainer costs its imports
once per rank, then well under a second a run.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

import hf_fit as hf  # noqa: E402
from docs_example import docs_example, run_under_torchrun  # noqa: E402
from harness import RankError  # noqa: E402
from patterns import PATTERNS, assert_matches, reference_of, sequential  # noqa: E402

import distckpt  # noqa: E402
from distckpt.integrations.hf import DistckptCallback, DistckptTrainer, prepare  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# The patterns one compute_loss expresses: every one whose step is a forward and one backward per micro-batch (the
# interleaved schedules run several backwards per optimizer step, which Trainer's training_step does not).
EXPRESSIBLE = [n for n, p in PATTERNS.items() if p.schedule is sequential]


@pytest.fixture(scope="module", autouse=True)
def _one_worker():
    """Module-scoped: tests/conftest.py's scheduler keeps this file's tests on one xdist worker, so transformers is
    imported by one pair of pool ranks, not two."""
    yield


def _exact(out, ref):
    assert all("error" not in o for o in out), [o.get("message") for o in out]
    assert_matches([(o["grads"], o["params"]) for o in out], ref)


def _guard_logged_every_step(o):
    """The guard's verdict rides on every training log line (logging_steps=1): one check each, in sync."""
    steps = [h for h in o["log_history"] if "loss" in h]
    assert len(steps) == hf.STEPS and all(h["distckpt_guard_checks"] == 1 for h in steps), o["log_history"]
    assert all(h["distckpt_guard_grad_norm"] == pytest.approx(h["grad_norm"], rel=1e-4) for h in steps), steps


@pytest.mark.dist
def test_every_expressible_pattern_under_hf_trainer_ddp(dist_pool):
    """Exact against the reference (AdamW, 3 steps), DDP without find_unused_parameters, GradSyncGuard every step;
    ``accumulate`` (gradient_accumulation_steps=2) reduces on the last micro-batch of each window only."""
    out = dist_pool.run(hf.sweep, EXPRESSIBLE, "distckpt", count=True, timeout=600)
    for name in EXPRESSIBLE:
        o0, o1 = out[0][name], out[1][name]
        _exact([o0, o1], reference_of(name, steps=hf.STEPS))
        assert o0["find_unused"] is False and o0["static_graph"] is False, name
        _guard_logged_every_step(o0)
        if name == "accumulate":
            assert o0["reductions"] == o1["reductions"] == [0, 1] * hf.STEPS, (o0["reductions"], o1["reductions"])
        else:
            assert all(n > 0 for n in o0["reductions"]) and len(o0["reductions"]) == hf.STEPS, (name, o0["reductions"])


def _seed_cases(rank, world):
    """The seed's case with distckpt: GPT-2 and Llama, LoRA and every parameter trained, Trainer's default DDP
    settings otherwise (Llama's buffers included). Non-reentrant blocks: task b's forward on rank 1 at odd steps;
    reentrant blocks: task b on every rank and step (``both``), and on rank 1 only (refused)."""
    out = {}
    for kind in ("gpt2", "llama"):
        for lora in (True, False):
            out[(kind, lora, False, False)] = hf.seed_fit(rank, world, kind, "distckpt", lora=lora)
        out[(kind, True, True, True)] = hf.seed_fit(rank, world, kind, "distckpt", reentrant=True, both=True)
    out[("gpt2", True, True, False)] = hf.seed_fit(rank, world, "gpt2", "distckpt", reentrant=True)
    return out


@pytest.mark.dist
def test_seed_case_gpt2_and_llama_two_forwards(dist_pool):
    out = dist_pool.run(_seed_cases, timeout=600)
    for key, o0 in out[0].items():
        kind, lora, reentrant, both = key
        o1 = out[1][key]
        if reentrant and not both:
            # DDP's static graph (which reentrant blocks need) cannot sync blocks that one rank runs twice and the
            # other once: distckpt stops at that step on every rank, naming the fix, instead of desyncing.
            for o in (o0, o1):
                assert o["error"][0] == "ConfigError" and "reentrant=False" in o["message"], o.get("message")
            continue
        _exact([o0, o1], hf.seed_reference(kind, [o0["seen"], o1["seen"]], lora=lora, both=both))
        # distckpt's flags: no search for unused parameters; DDP's static graph for reentrant blocks.
        assert (o0["find_unused"], o0["static_graph"]) == (False, reentrant), key
        assert o0["seen"] != o1["seen"]  # each rank trained on its own items


@pytest.mark.dist
def test_seed_case_with_gradient_accumulation(dist_pool):
    """gradient_accumulation_steps=2: exact, and the first micro-batch of each window runs no all-reduce."""
    out = dist_pool.run(hf.seed_fit, "gpt2", "distckpt", accumulate=2, count=True, timeout=300)
    _exact(out, hf.seed_reference("gpt2", [o["seen"] for o in out], accumulate=2))
    assert out[0]["reductions"] == out[1]["reductions"] == [0, 1] * hf.STEPS


@pytest.mark.dist
def test_desync_on_one_rank_is_caught_on_every_rank_naming_the_parameter(dist_pool):
    bad = "blocks.0.fc1.weight"
    out = dist_pool.run(hf.pattern_fit, "by_rank", perturb=(1, bad, 1e-3), timeout=120)
    for o in out:
        assert o["error"][0] == "GradDesyncError", o["error"]
        assert bad in o["message"] and "\n" not in o["message"], o["message"]


@pytest.mark.dist
def test_fsdp_through_trainer_is_refused(dist_pool):
    """TrainingArguments(fsdp=...): refused naming the fix. On CPU Accelerate would run plain DDP instead of the FSDP2
    asked for (measured: DistributedType.MULTI_CPU) and refuse FSDP1 ("sync_module_states=True is not supported on
    cpu"); on a GPU it shards in units distckpt does not choose."""
    fsdp = {"fsdp": True, "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"]}}
    out = dist_pool.run(hf.seed_fit, "gpt2", "distckpt", lora=False, **fsdp, timeout=120)
    for o in out:
        assert o["error"][0] == "ConfigError" and "distckpt.parallelize" in o["message"], o.get("message")


def _verify_once(rank, world):
    calls = []
    real = distckpt.verify_recompute

    def counted(model, loss_fn, **kwargs):
        calls.append(1)
        return real(model, loss_fn, **kwargs)

    distckpt.verify_recompute = counted
    try:
        out = hf.pattern_fit(rank, world, "all_heads", options={"verify": True})
    finally:
        distckpt.verify_recompute = real
    return out, len(calls)


@pytest.mark.dist
def test_verify_runs_once_on_the_first_batch_and_leaves_training_exact(dist_pool):
    out = dist_pool.run(_verify_once, timeout=120)
    assert [n for _, n in out] == [1, 1]
    _exact([o for o, _ in out], reference_of("all_heads"))  # all_heads' loss does not depend on the step


# --- Trainer(model_init=...): train() builds the model it trains ---------------------------------------------------


def _model_init_cases(rank, world):
    """by_rank (a head rank 0 leaves unused) with the model from Trainer(model_init=...): with distckpt, and
    without it (Trainer's own DDP, find_unused_parameters=True for a plain nn.Module); and one trial of
    hyperparameter_search's path (train(trial=...): model_init, then a new accelerator)."""
    out = {how: hf.pattern_fit(rank, world, "by_rank", how, model_init=True) for how in ("distckpt", "none")}
    out["trial"] = hf.pattern_fit(rank, world, "by_rank", model_init=True, trial={"logging_steps": 1})
    return out


@pytest.mark.dist
def test_model_init_two_ranks_trains_the_checkpointed_model_exactly(dist_pool):
    """train() calls model_init again: distckpt checkpoints and joins THAT model (before: an unwrapped model under
    distckpt's find_unused_parameters=False, and gloo aborted with 'Received data size doesn't match')."""
    out = dist_pool.run(_model_init_cases, timeout=300)
    for how in ("distckpt", "none", "trial"):
        _exact([o[how] for o in out], reference_of("by_rank"))
    for how in ("distckpt", "trial"):
        o0 = out[0][how]
        assert o0["checkpointed"] == ["blocks.0", "blocks.1"] and o0["find_unused"] is False, (how, o0["checkpointed"])
        _guard_logged_every_step(o0)
    assert out[0]["none"]["checkpointed"] == []


@pytest.mark.usefixtures("_accelerate_reset")
def test_model_init_one_process_trains_the_checkpointed_model():
    """One process: before, train() trained model_init's new model with no block checkpointed, and said nothing."""
    o = hf.pattern_fit(0, 1, "by_rank", model_init=True)
    _exact([o], reference_of("by_rank", world_size=1))
    assert o["checkpointed"] == ["blocks.0", "blocks.1"]


# --- the rest of Trainer's life cycle: evaluate/predict mid-training, save and resume -------------------------------


def _life_cycle(rank, world, out):
    """by_rank under distckpt: (1) evaluate after every step and predict after step 1, in the middle of train();
    (2) saved at step 2 into ``out`` (shared by the ranks), then a new Trainer resumed from checkpoint-2 for step 3."""
    ev = {"eval_data": hf.PatternData("by_rank", world, steps=1), "predict_at": 1}
    evaluated = hf.pattern_fit(
        rank, world, "by_rank", life=ev, eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=1
    )
    saved = hf.pattern_fit(rank, world, "by_rank", life={"output_dir": out}, save_strategy="steps", save_steps=2)
    resumed = hf.pattern_fit(rank, world, "by_rank", life={"output_dir": out, "resume": "checkpoint-2"})
    return {"evaluated": evaluated, "saved": saved, "resumed": resumed}


@pytest.mark.dist
def test_evaluate_predict_save_and_resume_stay_exact(dist_pool, tmp_path):
    out = dist_pool.run(_life_cycle, str(tmp_path), timeout=300)
    ref_grads, ref_params = reference_of("by_rank")
    _exact([o["evaluated"] for o in out], (ref_grads, ref_params))
    _exact([o["saved"] for o in out], (ref_grads, ref_params))
    o0, o1 = out[0]["evaluated"], out[1]["evaluated"]
    evals = [h["eval_loss"] for h in o0["log_history"] if "eval_loss" in h]
    assert len(evals) == hf.STEPS and evals == [h["eval_loss"] for h in o1["log_history"] if "eval_loss" in h], evals
    assert len(o0["predicted"]) == 1 and o0["predicted"] == o1["predicted"], (o0["predicted"], o1["predicted"])
    # The resumed Trainer runs step 3 only, from checkpoint-2's weights, AdamW state and data position.
    resumed = [o["resumed"] for o in out]
    _exact(resumed, ([ref_grads[-1]], ref_params))
    assert resumed[0]["checkpointed"] == ["blocks.0", "blocks.1"] and resumed[0]["find_unused"] is False


# --- refusals (one process: Trainer without DDP) -------------------------------------------------------------------


def _trainer(callbacks=(), trainer_cls=None, accumulate=1, **targs):
    from hf_fit import LossTrainer, PatternData, _one_item, pattern_loss

    return (trainer_cls or LossTrainer)(
        model=PATTERNS["all_heads"].model(),
        args=hf.training_args(tempfile.mkdtemp(), batch_size=1, accumulate=accumulate, **targs),
        train_dataset=PatternData("all_heads", 1),
        data_collator=_one_item,
        callbacks=list(callbacks),
        loss=pattern_loss("all_heads"),
    )


class _DistckptLossTrainer(DistckptTrainer, hf.LossTrainer):
    """DistckptTrainer with the tests' compute_loss."""


@pytest.fixture
def _accelerate_reset():
    env = dict(os.environ)
    yield
    hf._release_accelerate()
    os.environ.clear()
    os.environ.update(env)


@pytest.mark.usefixtures("_accelerate_reset")
def test_hf_checkpointing_alongside_is_refused_naming_the_one_to_drop():
    """TrainingArguments' default is off, so True is the user's choice: refused, under the name this transformers has
    (activation_checkpointing since 5.25), with the fix that also works in a TRL config."""
    with pytest.raises(distckpt.ConfigError, match=re.escape(f"Pass {hf.HF_CKPT}=False (TrainingArguments or any TRL")):
        _trainer([DistckptCallback()], **{hf.HF_CKPT: True})


@pytest.mark.usefixtures("_accelerate_reset")
def test_callback_without_prepare_is_refused_at_train():
    trainer = _trainer([DistckptCallback()])
    with pytest.raises(distckpt.ConfigError, match=re.escape("distckpt.integrations.hf.prepare(trainer)")):
        trainer.train()


@pytest.mark.usefixtures("_accelerate_reset")
def test_prepare_refuses_what_distckpt_cannot_keep_exact():
    with pytest.raises(distckpt.ConfigError, match="ddp_find_unused_parameters"):
        prepare(_trainer([DistckptCallback()], ddp_find_unused_parameters=True))
    with pytest.raises(distckpt.ConfigError, match="Drop ddp_static_graph"):
        prepare(_trainer([DistckptCallback()], ddp_static_graph=True))
    with pytest.raises(distckpt.ConfigError, match="reentrant=False"):
        prepare(_trainer([DistckptCallback(reentrant=True)], accumulate=2))
    gpt2 = hf.tiny_model("gpt2", lora=False)
    new = hasattr(gpt2, "activation_checkpointing_enable")  # transformers 5.25's name; 4.x: gradient_checkpointing_*
    (gpt2.activation_checkpointing_enable if new else gpt2.gradient_checkpointing_enable)()
    disable = "activation_checkpointing_disable" if new else "gradient_checkpointing_disable"
    with pytest.raises(distckpt.ConfigError, match=disable):
        prepare(hf.LossTrainer(model=gpt2, args=hf.training_args(tempfile.mkdtemp()), loss=hf.seed_loss))
    trainer = prepare(_trainer([DistckptCallback()]))
    with pytest.raises(distckpt.ConfigError, match="once"):
        prepare(trainer)
    with pytest.raises(distckpt.ConfigError, match="guard_every"):
        DistckptCallback(guard_every=-1)
    with pytest.raises(distckpt.ConfigError, match="graph"):
        DistckptCallback(graph="sometimes")


@pytest.mark.usefixtures("_accelerate_reset")
def test_prepare_adds_the_callback_and_distckpt_trainer_prepares_itself():
    trainer = prepare(_trainer())
    (cb,) = [c for c in trainer.callback_handler.callbacks if isinstance(c, DistckptCallback)]
    assert cb.prepared and trainer.callback_handler.callbacks[0] is cb  # first: its on_log runs before the printers
    assert distckpt.checkpointed(trainer.model) == ["blocks.0", "blocks.1"]
    hf._release_accelerate()
    trainer = _trainer([DistckptCallback("every:2", guard_every=1)], trainer_cls=_DistckptLossTrainer)
    assert distckpt.checkpointed(trainer.model) == ["blocks.0"]
    trainer.train()  # one process: the checkpointing and the guard's no-gradient check run, nothing to sync


# --- the docs' example under torchrun ------------------------------------------------------------------------------


@pytest.mark.dist
def test_docs_example_runs_under_torchrun(tmp_path):
    run = run_under_torchrun(docs_example("Hugging Face Trainer"), tmp_path)
    for r in (0, 1):
        assert f"rank {r}: 4 steps, parameters identical on all ranks: True" in run.stdout, run.stdout[-2000:]


# --- what Trainer gives without distckpt (docs/integrations.md's table) -------------------------------------------


def _own_cases(rank, world):
    """The seed's case (task b's forward on rank 1 at odd steps) as Trainer runs it without distckpt's integration,
    GPT-2 and Llama with LoRA. ddp_broadcast_buffers=False: with Trainer's default, Llama hangs whatever the
    checkpointing (test_llama_with_trainers_default_buffers_hangs)."""
    cases = (("none", False), ("hf", False), ("hf", True), ("wrap", True), ("wrap", False))
    return {
        (kind, how, reentrant): hf.seed_fit(rank, world, kind, how, reentrant=reentrant, ddp_broadcast_buffers=False)
        for kind in ("gpt2", "llama")
        for how, reentrant in cases
    }


_READY_ONCE = "Expected to mark a variable ready only once"


@pytest.mark.slow  # measurements of Trainer itself, not of distckpt (whose seed cases run by default above)
@pytest.mark.dist
def test_hf_trainer_own_checkpointing_table(dist_pool):
    out = dist_pool.run(_own_cases, timeout=600)
    for key, o0 in out[0].items():
        kind, how, reentrant = key
        o1 = out[1][key]
        if reentrant:  # HF's use_reentrant=True, or distckpt.wrap(reentrant=True), under Trainer's DDP
            assert all(o["error"][0] == "RuntimeError" and _READY_ONCE in o["error"][1] for o in (o0, o1)), key
            continue
        _exact([o0, o1], hf.seed_reference(kind, [o0["seen"], o1["seen"]]))
        # Trainer's choice for a PeftModel (not a PreTrainedModel): DDP searches the graph for unused parameters
        # every step, and torch warns it found none.
        assert o0["find_unused"] is True, key
    # Full fine-tuning (a PreTrainedModel): HF's checkpointing makes Trainer turn find_unused_parameters off. With
    # use_reentrant=False exact; with True, rank 1 (two forwards) raises and rank 0 waits in its all-reduce (here
    # until the pool gives up on it or rank 1 closes the group; under torchrun, until the launcher kills it).
    out = dist_pool.run(hf.seed_fit, "gpt2", "hf", lora=False, ddp_broadcast_buffers=False, timeout=120)
    _exact(out, hf.seed_reference("gpt2", [o["seen"] for o in out], lora=False))
    assert out[0]["find_unused"] is False
    with pytest.raises(RankError) as err:
        dist_pool.run(hf.seed_fit, "gpt2", "hf", reentrant=True, lora=False, catch=False, timeout=120)
    errors = err.value.errors  # rank 0: still waiting (absent), or "Connection closed" once rank 1 left the group
    assert _READY_ONCE in errors[1][1] and _READY_ONCE not in errors.get(0, ("", "", ""))[1], errors


def _fup_false_cases(rank, world):
    """TrainingArguments(ddp_find_unused_parameters=False), what torch's warning suggests for a LoRA model: with
    reentrant blocks the seed's case is pytorch#121594 (every trainable parameter inside checkpointed blocks, two
    forwards before one backward)."""
    kw = {"ddp_find_unused_parameters": False, "ddp_broadcast_buffers": False}
    return {
        (kind, how, reentrant): hf.seed_fit(rank, world, kind, how, reentrant=reentrant, **kw)
        for kind in ("gpt2", "llama")
        for how, reentrant in (("hf", True), ("wrap", True), ("hf", False))
    }


@pytest.mark.slow  # measurements of Trainer itself, as above
@pytest.mark.dist
def test_hf_trainer_reentrant_without_find_unused_desyncs_silently(dist_pool):
    out = dist_pool.run(_fup_false_cases, timeout=600)
    for key, o0 in out[0].items():
        kind, how, reentrant = key
        o1 = out[1][key]
        ref = hf.seed_reference(kind, [o0["seen"], o1["seen"]])
        if not reentrant:
            _exact([o0, o1], ref)
            continue
        assert "error" not in o0 and "error" not in o1, key  # trains without a word...
        with pytest.raises(AssertionError, match="ranks 0 and 1 differ"):  # ...with gradients that differ by rank
            _exact([o0, o1], ref)


@pytest.mark.slow  # a hang: costs the pool a restart (the default tier runs Llama with distckpt, which avoids it)
@pytest.mark.dist
def test_llama_with_trainers_default_buffers_hangs(dist_pool):
    """DDP broadcasts the buffers (Llama's rotary inv_freq) at every forward: rank 1's second forward waits for a
    broadcast that rank 0, already in backward, never joins. distckpt's prepare turns it off for such models."""
    with pytest.raises(TimeoutError):
        dist_pool.run(hf.seed_fit, "llama", "none", timeout=90)
