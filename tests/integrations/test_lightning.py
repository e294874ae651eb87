"""distckpt.integrations.lightning on 2 gloo ranks: every pattern of tests/patterns.py inside Lightning's
``Trainer.fit`` against the single-process reference without checkpointing (AdamW, 3 steps), gradient reductions
per micro-batch under ``accumulate_grad_batches``, a desync injected on one rank, and the docs' example.

Each strategy's patterns run in ONE call on the test pool's ranks (tests/integrations/lightning_fit.py): Lightning
costs its import and a fit per pattern, no launch.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from docs_example import docs_example  # noqa: E402
from patterns import PATTERNS, MultiTask, assert_matches, reference_of

import distckpt

# Lightning (with torchmetrics, scipy, transformers: ~4 s of CPU) is imported by the tests that use it, not at
# collection, which every pytest-xdist worker does: lightning_fit (tests/integrations/) and
# distckpt.integrations.lightning are imported inside the tests.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="needs lightning")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def _one_worker():
    """Module-scoped: tests/conftest.py's scheduler keeps this file's tests on one xdist worker, so Lightning is
    imported by one pair of pool ranks, not two."""
    yield


def _reference(name):
    import lightning_fit as lf

    return reference_of(name, steps=lf.STEPS)


def _check(out, name, refused=None):
    """Both ranks exact (and equal), or both refused with a ConfigError containing one of ``refused``'s words."""
    o0, o1 = out[0][name], out[1][name]
    if refused is None:
        assert o0[0] == o1[0] == "ok", (name, o0[:3], o1[:3])
        assert_matches([o0[1][:2], o1[1][:2]], _reference(name))
        return o0[1][2], o1[1][2]
    assert all(o[0] == "refused" and o[1] == "ConfigError" and any(w in o[2] for w in refused) for o in (o0, o1)), (
        name,
        o0,
        o1,
    )
    return None


def _accumulation_syncs_once_per_window(reductions):
    """accumulate_grad_batches=2: no gradient reduction on the first micro-batch of a window, some on the last."""
    import lightning_fit as lf

    assert len(reductions) == 2 * lf.STEPS, reductions
    assert reductions[0::2] == [0] * lf.STEPS and all(n > 0 for n in reductions[1::2]), reductions


# Manual optimization (the schedules with several backwards) under FSDP1: refused by the strategy; autograd.grad
# through FSDP1 units: refused by parallelize as without Lightning (tests/distributed/test_parallel.py).
_FSDP_REFUSED = {
    "grad_penalty": ("create_graph",),
    "grad_no_write": ("fsdp2",),
    "interleaved_sync": ("DistckptDDPStrategy",),
    "interleaved_109191": ("DistckptDDPStrategy",),
    "interleaved_accumulate": ("DistckptDDPStrategy",),
}


@pytest.mark.dist
def test_every_pattern_under_lightning_ddp(dist_pool):
    """All 23 patterns: exact, GradSyncGuard at every step; the interleaved schedules through manual_backward."""
    import lightning_fit as lf

    out = dist_pool.run(lf.sweep, list(PATTERNS), "ddp", timeout=600)
    for name in PATTERNS:
        reductions, _ = _check(out, name)
        if name == "accumulate":
            _accumulation_syncs_once_per_window(reductions)
        elif name == "interleaved_sync":
            assert reductions == [2] * lf.STEPS  # each manual_backward outside toggle_model syncs (exact)
        else:
            assert all(n > 0 for n in reductions), (name, reductions)


@pytest.mark.dist
def test_every_pattern_under_lightning_fsdp(dist_pool):
    """FSDP1 (DistckptFSDPStrategy, CPU): exact, or refused with a ConfigError naming the fix. loss_only_param's
    scalar parameter is one FSDP1 cannot shard (torch's ValueError)."""
    import lightning_fit as lf

    names = [n for n in PATTERNS if n != "loss_only_param"]
    out = dist_pool.run(lf.sweep, names, "fsdp", timeout=600)
    for name in names:
        got = _check(out, name, _FSDP_REFUSED.get(name))
        if name == "accumulate":
            _accumulation_syncs_once_per_window(got[0])


@pytest.mark.dist
def test_reentrant_under_lightning_ddp(dist_pool):
    """reentrant=True: the seed's two forwards with LoRA (pytorch#121594) exact; accumulation refused (DDP's
    static graph, which reentrant blocks need, cannot skip a sync)."""
    import lightning_fit as lf

    names = ["two_forwards", "lora_two_forwards", "accumulate"]
    out = dist_pool.run(lf.sweep, names, "ddp", reentrant=True, timeout=300)
    _check(out, "two_forwards")
    _check(out, "lora_two_forwards")
    _check(out, "accumulate", ("reentrant=False",))


@pytest.mark.dist
def test_desync_on_one_rank_is_caught_on_every_rank_naming_the_parameter(dist_pool):
    import lightning_fit as lf

    bad = "net.blocks.0.fc1.weight"
    out = dist_pool.run(lf.outcome, "by_rank", "ddp", callbacks=(lf.PerturbGrad(1, bad),), timeout=120)
    for o in out:
        assert o[0] == "refused" and o[1] == "GradDesyncError", o
        assert "blocks.0.fc1.weight" in o[2] and "\n" not in o[2], o[2]


def test_options_are_checked_when_the_strategy_is_built():
    from patterns import Block

    from distckpt.integrations.lightning import DistckptDDPStrategy, DistckptFSDPStrategy

    with pytest.raises(distckpt.ConfigError, match="activation_checkpointing_policy"):
        DistckptFSDPStrategy(activation_checkpointing_policy={Block})
    with pytest.raises(distckpt.ConfigError, match="auto_wrap_policy"):
        DistckptFSDPStrategy(auto_wrap_policy={Block})
    with pytest.raises(distckpt.ConfigError, match="guard_every"):
        DistckptDDPStrategy(guard_every=-1)
    with pytest.raises(distckpt.ConfigError, match="graph"):
        DistckptDDPStrategy(graph="sometimes")


def test_policy_and_a_model_already_wrapped_is_refused():
    from distckpt.integrations.lightning import DistckptDDPStrategy

    model = distckpt.wrap(MultiTask(), "full", blocks=PATTERNS["all_heads"].blocks)
    with pytest.raises(distckpt.ConfigError, match="policy=None"):
        DistckptDDPStrategy("full")._checkpoint(model)
    DistckptDDPStrategy(None)._checkpoint(model)  # policy=None keeps the model's own choice
    assert distckpt.checkpointed(model) == ["blocks.0", "blocks.1"]


# --- the docs' example ------------------------------------------------------------------------------------------


def _run_example(rank, world, code):
    import contextlib
    import io
    import os

    env = dict(os.environ)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, "docs/integrations.md", "exec"), {"__name__": "__main__"})
    finally:
        os.environ.clear()
        os.environ.update(env)
    return out.getvalue()


@pytest.mark.dist
def test_docs_example_runs_on_2_ranks(dist_pool):
    # The pool's ranks are set up as torchrun's are: the example runs as `torchrun --nproc_per_node=2 example.py`.
    outs = dist_pool.run(_run_example, docs_example("Lightning"), timeout=300)
    assert all(f"rank {r}: 4 steps, parameters identical on all ranks: True" in o for r, o in enumerate(outs)), outs


@pytest.mark.slow  # the default case runs the same code on the pool's ranks (test_docs_example_runs_on_2_ranks)
def test_docs_example_runs_with_python_as_a_user_would(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(docs_example("Lightning"))
    run = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600, env=_env()
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "4 steps, parameters identical on all ranks: True" in run.stdout, run.stdout[-2000:]


def _env():
    import os

    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


# --- what Lightning gives without distckpt (docs/integrations.md's table) ---------------------------------------


def _own(rank, world, name, strategy, own, reentrant=False):
    """Lightning's own strategy and checkpointing: ("ok", grads, params, reductions) or ("error", type, first line)."""
    import lightning_fit as lf

    try:
        return ("ok", *lf.fit(rank, world, name, strategy, own=own, reentrant=reentrant, guard_every=0))
    except Exception as e:  # noqa: BLE001 - what Lightning raises is the measurement
        return ("error", type(e).__name__, str(e).strip().splitlines()[0])


def _differs(out, name):
    with pytest.raises(AssertionError):
        assert_matches([o[1:3] for o in out], _reference(name))


@pytest.mark.slow  # measurements of Lightning itself, not of distckpt (whose cases run by default above)
@pytest.mark.dist
def test_lightning_own_checkpointing_table(dist_pool):
    run = dist_pool.run
    # DDPStrategy() + checkpoint_wrapper: a head unused on some rank stops the run at the next step.
    out = run(_own, "by_rank", "ddp", "ddp", timeout=120)
    assert all(o[0] == "error" and "not used in producing the loss" in o[2] for o in out), out
    # find_unused_parameters=True: exact with non-reentrant blocks; with reentrant ones, an error or no gradient.
    out = run(_own, "two_forwards", "ddp", "ddp_find_unused_parameters_true", timeout=120)
    assert_matches([o[1:3] for o in out], _reference("two_forwards"))
    out = run(_own, "two_forwards", "ddp", "ddp_find_unused_parameters_true", True, timeout=120)
    assert all(o[0] == "error" and "mark a variable ready only once" in o[2] for o in out), out
    out = run(_own, "frozen_embed", "ddp", "ddp_find_unused_parameters_true", True, timeout=120)
    assert out[0][0] == "ok" and out[0][1][0]["blocks.0.fc1.weight"] is None  # silently no gradient
    # FSDPStrategy's own checkpointing: zero gradients where a single process has none (silently wrong with AdamW),
    # wrong values with a gradient penalty. Its accumulate_grad_batches does skip the sync (no_sync, as distckpt's).
    for name in ("sampled", "grad_penalty"):
        out = run(_own, name, "fsdp", "fsdp", timeout=120)
        assert all(o[0] == "ok" for o in out), out
        _differs(out, name)
    out = run(_own, "accumulate", "fsdp", "fsdp", timeout=120)
    _accumulation_syncs_once_per_window(out[0][3])
