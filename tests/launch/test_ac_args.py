"""One builder from the ``ac`` group to ``distckpt.wrap``'s arguments (launch/ac.py): validation, training,
``distckpt doctor`` and ``distckpt plan`` see the same policy, blocks, options and budget facts for every
file in ``conf/ac/`` crossed with ``optim=sgd|adamw`` and ``trainer.grad_accum=1|2``.

Measured before the builder: the doctor wrapped with the ``ac.policy`` string (a budget planned for AdamW
without accumulation under whatever strategy, whatever the config said) and dropped ``ac.offload``; its
budget profiled the whole per-rank batch where training profiles one micro-batch.
"""

from __future__ import annotations

import pytest
import torch
from launchkit import ROOT, compose
from omegaconf import OmegaConf

import distckpt
import distckpt.train.data
import launch.run
from distckpt import Budget
from distckpt.errors import ConfigError
from launch.ac import BudgetFacts, wrap_args
from launch.build import build_data, build_model
from launch.config import check_model
from launch.subject import build_subject

AC_FILES = sorted(p.stem for p in (ROOT / "conf" / "ac").glob("*.yaml"))
SMALL = ["model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.seq_len=16", "data.batch_size=8", "data.n=64"]
WORLD = 2


def _overrides(ac: str, optim: str, accum: int) -> list[str]:
    size = ["ac.size=1GiB"] if ac == "budget" else []  # budget:auto is CUDA's free memory
    return [f"ac={ac}", *size, f"optim={optim}", f"trainer.grad_accum={accum}", *SMALL]


class _Recorder:
    """Stands in for distckpt.wrap: what each call site passes, nothing applied."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, model, policy="full", *, example_inputs=None, **kw):
        shapes = None
        if example_inputs is not None:
            shapes = {k: tuple(v.shape) for k, v in example_inputs[0].items() if isinstance(v, torch.Tensor)}
        self.calls.append(dict(policy=policy, example=shapes, **kw))
        return model

    def take(self) -> list[dict]:
        calls, self.calls = self.calls, []
        return calls


def _sites(overrides: list[str], monkeypatch) -> dict[str, list[dict]]:
    """The wrap calls of validation, training and the doctor for ``overrides`` on WORLD ranks."""
    rec = _Recorder()
    monkeypatch.setattr(distckpt, "wrap", rec)
    # Training's view of a WORLD-rank job (rank 0), without a process group.
    monkeypatch.setattr(launch.run, "rank_world", lambda: (0, WORLD))
    monkeypatch.setattr(distckpt.train.data, "rank_world", lambda group=None: (0, WORLD))
    cfg = compose(overrides)
    check_model(cfg, WORLD)  # validation: on a meta model
    validation = [{k: v for k, v in c.items() if k != "preserve_rng_state"} for c in rec.take()]
    torch.manual_seed(cfg.trainer.seed)
    data = build_data(cfg.data, cfg.model)
    launch.run._wrap(build_model(cfg.model, cfg.data), cfg, data.example(cfg.trainer.grad_accum))  # as train() does
    training = rec.take()
    build_subject(tuple(overrides), True, WORLD, True)  # the doctor's factory, on one of its ranks
    return {"validation": validation, "training": training, "doctor": rec.take()}


@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("optim", ["sgd", "adamw"])
@pytest.mark.parametrize("ac", AC_FILES)
def test_validation_training_doctor_and_plan_get_the_same_arguments(ac, optim, accum, monkeypatch):
    overrides = _overrides(ac, optim, accum)
    seen = _sites(overrides, monkeypatch)
    assert seen["doctor"] == seen["training"], seen
    (checked,) = seen["validation"]
    if ac == "none":  # training and the doctor call nothing; validation matches ac.blocks on the model
        assert seen["training"] == [] and checked["policy"] is None
    else:
        (trained,) = seen["training"]
        assert {k: v for k, v in checked.items() if k != "example"} == {
            k: v for k, v in trained.items() if k not in ("example", "preserve_rng_state")
        }
        batch = 8 // WORLD // accum  # one rank's micro-batch
        assert trained["example"]["tokens"][0] == batch, trained["example"]
    policy = checked["policy"]
    expected = distckpt.parse_policy(OmegaConf.to_container(compose(overrides).ac, resolve=True)["policy"])
    facts = BudgetFacts("ddp", "sgd_momentum" if optim == "sgd" else "adamw", accum > 1, None)
    if ac == "budget":  # the run's facts, not the defaults (AdamW, no accumulation)
        assert policy == Budget(2**30, strategy="ddp", optimizer=facts.optimizer, grad_accumulation=accum > 1)
    else:  # the group's own policy, built from its typed fields, is what its ac.policy spec says
        assert policy == expected
    # distckpt plan counts the same facts (launch/plan.py's flags default to them).
    got = {}
    monkeypatch.setattr("distckpt.cli.run_plan", lambda args: got.update(vars(args)) or 0)
    from launch.plan import main as launch_plan

    assert launch_plan([*overrides, "--world-size", str(WORLD)]) == 0
    assert (got["strategy"], got["optimizer"], got["grad_accumulation"]) == (
        facts.strategy,
        facts.optimizer,
        facts.grad_accumulation,
    )


def test_doctor_keeps_offload_blocks_reentrant_and_the_strategy_flag(monkeypatch):
    """ac.offload and ac.blocks reach the doctor's wrap; --strategy reaches its budget as it reaches parallelize."""
    over = ["ac=full", "ac.offload=true", "ac.reentrant=true", "ac.blocks=[blocks.0]", *SMALL]
    (call,) = _sites(over, monkeypatch)["doctor"]
    assert (call["offload"], call["blocks"], call["reentrant"]) == ("cpu", ["blocks.0"], True)
    rec = _Recorder()
    monkeypatch.setattr(distckpt, "wrap", rec)
    build_subject(("ac=budget", "ac.size=1GiB", *SMALL), True, WORLD, True, "fsdp2")
    (call,) = rec.take()
    assert call["policy"].strategy == "fsdp2"  # else parallelize("fsdp2") refuses a plan made for ddp


def test_each_field_is_read_once_and_named_when_bad():
    cfg = compose(["ac=budget", "ac.size=2GiB"])
    assert OmegaConf.is_interpolation(cfg.ac, "policy")  # the group's own spec: built from ac.size
    args = wrap_args(cfg, 1)
    assert args.policy.bytes == 2 * 2**30 and args.spec == "budget:2GiB" and args.offload is None
    assert wrap_args(compose(["ac=budget", "ac.size=1GiB", "ac.policy=every:3"]), 1).policy == distckpt.EveryN(3)
    with pytest.raises(ConfigError, match=r"^ac.size=lots: 'lots' is not a size"):
        wrap_args(compose(["ac=budget", "ac.size=lots"]), 1)
    with pytest.raises(ConfigError, match=r"^ac.policy=sometimes: unknown checkpoint policy"):
        wrap_args(compose(["ac.policy=sometimes"]), 1)
