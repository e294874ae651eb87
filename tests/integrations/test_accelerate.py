"""distckpt.integrations.accelerate on 2 gloo ranks: every pattern of tests/patterns.py in a loop written as an
Accelerate user writes it (``accelerator.prepare``, ``accumulate``, ``backward``) against the single-process reference
without checkpointing (AdamW, 3 steps), gradient reductions per micro-batch under ``gradient_accumulation_steps``,
a desync injected on one rank, the refusals, and the docs' example under torchrun.

All patterns run in ONE call on the test pool's ranks (tests/integrations/accelerate_fit.py).
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("accelerate")

import accelerate_fit as af  # noqa: E402
from accelerate.utils import DistributedType  # noqa: E402
from docs_example import docs_example, run_under_torchrun  # noqa: E402
from patterns import PATTERNS, assert_matches, reference, reference_of  # noqa: E402

import distckpt  # noqa: E402
from distckpt.integrations import accelerate as dc_accelerate  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def _one_worker():
    """Module-scoped: tests/conftest.py's scheduler keeps this file's tests on one xdist worker, so Accelerate is
    imported by one pair of pool ranks, not two."""
    yield


def _check(out, name, refused=None, ref=None):
    """Both ranks exact (and equal): returns rank 0's reductions per micro-batch. Or both refused with a ConfigError
    containing one of ``refused``'s words."""
    o0, o1 = out[0][name], out[1][name]
    if refused is None:
        assert o0[0] == o1[0] == "ok", (name, o0[:3], o1[:3])
        assert_matches([o0[1][:2], o1[1][:2]], reference_of(ref or name))
        assert o0[1][2:] == o1[1][2:], (name, o0[1][2:], o1[1][2:])
        # GradSyncGuard (guard_every=1) checked before each real optimizer step, not on skipped micro-batches.
        assert o0[1][3] == af.STEPS, (name, o0[1][3])
        return o0[1][2]
    assert all(o[0] == "refused" and o[1] == "ConfigError" and any(w in o[2] for w in refused) for o in (o0, o1)), (
        name,
        o0,
        o1,
    )
    return None


# All forwards first, then each backward syncing (interleaved_sync), or pytorch#109191's order: DDP reduces in the
# first backward after a synced forward, so distckpt refuses, as parallelize does (tests/distributed/test_parallel.py),
# naming accumulate; Accelerate's own way for that order (trigger_sync_in_backward) is exact (test below).
_REFUSED = {"interleaved_sync": ("accumulate",), "interleaved_109191": ("accumulate",)}


@pytest.mark.dist
def test_every_pattern_under_accelerate_ddp(dist_pool):
    """All 23 patterns, GradSyncGuard before every optimizer step: exact (or refused as by parallelize). The usual
    loop: ``gradient_accumulation_steps`` + ``accelerator.accumulate``; the interleaved schedules: ``no_sync``."""
    out = dist_pool.run(af.sweep, list(PATTERNS), timeout=600)
    for name in PATTERNS:
        reductions = _check(out, name, _REFUSED.get(name))
        if name == "accumulate":
            # gradient_accumulation_steps=2: no reduction on the first micro-batch of a window, one bucket on the last
            assert reductions == [0, 1] * af.STEPS, reductions
        elif reductions is not None:
            assert reductions == [1] * af.STEPS, (name, reductions)


@pytest.mark.dist
def test_trigger_sync_in_backward_and_reentrant(dist_pool):
    """Accelerate's way to run every forward before the backwards (``no_sync``, then ``trigger_sync_in_backward`` for
    the last backward): exact, one reduction per step, a head no rank used keeps grad None (distckpt's state is told
    that backward reduces). reentrant=True: the seed's two forwards with LoRA (pytorch#121594) exact."""
    names = ["interleaved_sync", "interleaved_accumulate", "accumulate"]
    out = dist_pool.run(af.sweep, names, trigger=True, timeout=300)
    for name in names:  # accumulate: head "c" unused over the whole window of step 0 (grad None in the reference)
        assert _check(out, name) == [1] * af.STEPS, name
    out = dist_pool.run(af.sweep, ["two_forwards", "lora_two_forwards"], reentrant=True, timeout=300)
    _check(out, "two_forwards")
    _check(out, "lora_two_forwards")


@pytest.mark.dist
def test_desync_on_one_rank_is_caught_on_every_rank_naming_the_parameter(dist_pool):
    bad = "blocks.0.fc1.weight"
    out = dist_pool.run(af.outcome, "by_rank", perturb=(1, bad), timeout=120)
    for o in out:
        assert o[0] == "refused" and o[1] == "GradDesyncError", o
        assert bad in o[2] and "\n" not in o[2], o[2]


@pytest.mark.dist
def test_what_install_refuses(dist_pool):
    out = dist_pool.run(af.refusals, timeout=300)
    assert out[0] == out[1], out
    got = out[0]
    assert got["fup"].startswith("ConfigError") and "find_unused_parameters=True" in got["fup"], got
    assert "static_graph=True" in got["static"] and "graph='static'" in got["static"], got
    assert "gradient_accumulation_steps=2" in got["accumulate_reentrant"], got
    assert "reentrant=False" in got["accumulate_reentrant"], got
    assert got["no_sync_static"].startswith("ConfigError") and "graph='auto'" in got["no_sync_static"], got
    # Measured: Accelerator() without cpu=True under torchrun on CPU says 1 process on every rank and builds no DDP.
    assert "Accelerator(cpu=True)" in got["not_cpu"], got
    assert "before accelerator.prepare" in got["prepared"], got
    assert "policy=None" in got["wrapped_twice"], got
    assert got["kept_by_policy_none"] == "no error", got
    # strategies.attach_ddp, the mechanism under install, on DDPs built by hand:
    assert "DistributedDataParallel only" in got["attach_not_ddp"], got
    assert "already has distckpt's gradient-sync state" in got["attach_twice"], got
    assert "find_unused_parameters=True" in got["attach_fup"], got
    assert "static_graph=False contradicts" in got["attach_static_mismatch"], got
    # Measured: on CPU Accelerate ignores an FSDP plugin and builds DDP; install says so (and makes that DDP exact).
    assert "Accelerate ignored its FSDP plugin (MULTI_CPU" in got["fsdp_plugin_on_cpu"], got


@pytest.mark.parametrize(
    ("kind", "words"),
    [
        (DistributedType.FSDP, "distckpt.parallelize(model, 'fsdp')"),
        (DistributedType.DEEPSPEED, "DEEPSPEED"),
        (DistributedType.XLA, "XLA"),
    ],
)
def test_accelerators_distckpt_cannot_make_exact_are_refused(kind, words):
    fake = SimpleNamespace(distributed_type=kind, num_processes=1, parallelism_config=None, state=SimpleNamespace())
    with pytest.raises(distckpt.ConfigError, match=re.escape(words)):
        dc_accelerate._refuse_accelerator(fake)


def test_options_are_checked_first():
    fake = SimpleNamespace()  # never reached
    with pytest.raises(distckpt.ConfigError, match="guard_every"):
        dc_accelerate.install(fake, None, guard_every=-1)
    with pytest.raises(distckpt.ConfigError, match="graph"):
        dc_accelerate.install(fake, None, graph="sometimes")


# --- the docs' example ------------------------------------------------------------------------------------------


@pytest.mark.dist
def test_docs_example_runs_under_torchrun(tmp_path):
    run = run_under_torchrun(docs_example("Accelerate"), tmp_path)
    for rank in range(2):
        assert f"rank {rank}: 4 steps, parameters identical on all ranks: True" in run.stdout, run.stdout[-2000:]


# --- what Accelerate gives without distckpt (docs/integrations.md's table) ---------------------------------------

_FINISHED = "Expected to have finished reduction"
_TWICE = "Expected to mark a variable ready only once"
_NO_GRAD_FN = "element 0 of tensors does not require grad"
_DOT_GRAD = "incompatible with .grad()"


def _verdict(out, name) -> str:
    """ "exact", "silent" (trains, differs from the reference) or the error's first line (the same on both ranks)."""
    o0, o1 = out[0][name], out[1][name]
    if o0[0] == "error" or o1[0] == "error":
        assert o0 == o1, (name, o0, o1)
        return o0[2]
    try:
        assert_matches([o0[1][:2], o1[1][:2]], reference_of(name, steps=af.STEPS))
    except AssertionError:
        return "silent"
    return "exact"


def _expect(exact, silent=(), **errors):
    table = dict.fromkeys(exact, "exact") | dict.fromkeys(silent, "silent")
    for words, names in errors.values():
        table |= dict.fromkeys(names, words)
    assert sorted(table) == sorted(PATTERNS), sorted(set(PATTERNS) ^ set(table))
    return table


_STATIC = ("all_heads", "dpo", "dpo_frozen_ref")
_OWN_TABLE = {
    "torch": _expect(
        (*_STATIC, "lora", "lora_two_forwards", "frozen_embed", "grad_penalty"),
        twice=(_TWICE, ("interleaved_sync", "interleaved_109191")),
        unused=(
            _FINISHED,
            (
                "two_forwards",
                "unused_output",
                "zero_weight",
                "by_step",
                "by_rank",
                "sampled",
                "heads_inside",
                "loss_only_param",
                "accumulate",
                "moe",
                "grad_no_write",
                "grad_params",
                "eval_between",
                "interleaved_accumulate",
            ),
        ),
    ),
    "torch_reentrant": _expect(
        ("all_heads",),
        twice=(_TWICE, ("two_forwards", "dpo", "dpo_frozen_ref", "interleaved_sync", "interleaved_109191")),
        lora=(_NO_GRAD_FN, ("lora", "lora_two_forwards")),
        grad=(_DOT_GRAD, ("grad_penalty", "grad_no_write")),
        unused=(
            _FINISHED,
            (
                "unused_output",
                "zero_weight",
                "by_step",
                "by_rank",
                "sampled",
                "heads_inside",
                "frozen_embed",
                "loss_only_param",
                "accumulate",
                "moe",
                "grad_params",
                "eval_between",
                "interleaved_accumulate",
            ),
        ),
    ),
    "torch_fup": _expect(
        (
            *_STATIC,
            "unused_output",
            "zero_weight",
            "by_step",
            "by_rank",
            "sampled",
            "heads_inside",
            "lora",
            "lora_two_forwards",
            "frozen_embed",
            "accumulate",
            "moe",
            "grad_penalty",
            "grad_no_write",
            "grad_params",
            "interleaved_accumulate",
        ),
        twice=(_TWICE, ("two_forwards", "loss_only_param", "interleaved_sync", "interleaved_109191")),
        unused=(_FINISHED, ("eval_between",)),
    ),
}


@pytest.mark.slow  # measurements of Accelerate itself, not of distckpt (whose cases run by default above)
@pytest.mark.dist
@pytest.mark.parametrize("own", af.OWN)
def test_accelerate_own_checkpointing_table(dist_pool, own):
    out = dist_pool.run(af.sweep, list(PATTERNS), own=own, guard_every=0, timeout=600)
    got = {name: _verdict(out, name) for name in PATTERNS}
    want = _OWN_TABLE[own]
    assert all(w == got[n] or (w not in ("exact", "silent") and w in got[n]) for n, w in want.items()), got


@pytest.mark.dist
def test_a_forward_one_rank_runs_alone_with_a_buffer(dist_pool):
    """A constant buffer and a second forward on rank 1 only: Accelerate's DDP would broadcast the buffer at every
    forward and hang; install turns the broadcast off (no running statistics): exact."""
    from patterns import RANK_FORWARDS

    out = dist_pool.run(af.rank_forwards, timeout=120)
    assert_matches(out, reference(RANK_FORWARDS, world_size=2, steps=af.STEPS))
