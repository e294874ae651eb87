"""The launcher hands its run-level facts to the budget planner (issue 10): ``ac=budget ac.size=...``
becomes a Budget with the config's strategy, shard size, optimizer and gradient accumulation, and
those facts change the plan (SGD keeps less state than AdamW, so fewer blocks are checkpointed)."""

from __future__ import annotations

import copy
import dataclasses

import torch
from launchkit import compose
from models import GPT, GPTConfig, batch

import distckpt
from distckpt import Budget
from distckpt.select.budget import predicted_peak, static_bytes
from distckpt.select.profile import profile_model
from launch.ac import wrap_args


def ac_policy(cfg, world: int):
    return wrap_args(cfg, world).policy


def test_budget_gets_strategy_optimizer_and_accumulation():
    cfg = compose(["strategy=fsdp2", "ac=budget", "ac.size=20GiB", "optim=sgd", "trainer.grad_accum=2"])
    assert ac_policy(cfg, 2) == Budget(20 * 2**30, strategy="fsdp2", optimizer="sgd_momentum", grad_accumulation=True)
    cfg = compose(["strategy=hsdp", "strategy.shard_size=2", "ac=budget", "ac.size=1GiB"])
    assert ac_policy(cfg, 4) == Budget(2**30, strategy="hsdp", optimizer="adamw", shard_size=2)
    cfg = compose(["ac=budget", "ac.size=1GiB", "optim=sgd", "optim.momentum=0"])
    assert ac_policy(cfg, 1).optimizer == "sgd"
    assert ac_policy(compose(["ac=full"]), 1) == distckpt.Full()


def test_sgd_plans_less_optimizer_state_than_adamw():
    torch.manual_seed(0)
    gcfg = GPTConfig(vocab=64, seq=16, dim=32, heads=2, layers=4)
    base = GPT(gcfg)
    inputs = batch(gcfg, 2)
    mp = profile_model(base, [(f"h.{i}", b) for i, b in enumerate(base.h)], inputs)
    sgd_cfg = compose(["strategy=none", "ac=budget", "ac.size=1GiB", "optim=sgd", "optim.momentum=0"])
    adamw_cfg = compose(["strategy=none", "ac=budget", "ac.size=1GiB", "optim=adamw"])
    sgd, adamw = ac_policy(sgd_cfg, 1), ac_policy(adamw_cfg, 1)
    assert (
        static_bytes(mp, optimizer=sgd.optimizer)[0] + 2 * mp.trainable_bytes
        <= static_bytes(mp, optimizer=adamw.optimizer)[0]
    )  # AdamW: exp_avg and exp_avg_sq per parameter
    # Midway between AdamW's peaks with every block and with none checkpointed.
    kw = dict(strategy="none", optimizer="adamw")
    size = (predicted_peak(mp, range(gcfg.layers), **kw) + predicted_peak(mp, [], **kw)) // 2
    chosen = {}
    for name, pol in (("sgd", sgd), ("adamw", adamw)):
        model = copy.deepcopy(base)
        distckpt.wrap(model, dataclasses.replace(pol, bytes=size), example_inputs=inputs)
        chosen[name] = distckpt.checkpointed(model)
    assert len(chosen["sgd"]) < len(chosen["adamw"])


def test_launcher_plan_counts_the_configs_optimizer(capsys):
    """`launch/plan.py` (`distckpt plan <overrides>`) plans the run's own optimizer (launch.ac.wrap_args),
    not the flag's default AdamW, unless --optimizer says."""
    from launch.plan import main as launch_plan

    over = ["model=gpt", "model.n_layer=2", "optim=sgd", "optim.momentum=0"]
    assert launch_plan(over) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].endswith(", sgd") and "optimizer state            0 B" in out, out
    assert launch_plan([*over, "--optimizer", "adamw"]) == 0
    assert capsys.readouterr().out.splitlines()[0].endswith(", adamw")


def test_summary_says_each_blocks_mode():
    from launch.run import _checkpointed_by_mode

    modes = {
        "h.0": "full",
        "h.1": "selective",
        "h.2": "full",
        **{f"g.{i}": "selective" for i in range(5)},
        "h.3": "pointwise",
    }
    assert _checkpointed_by_mode(modes) == (
        "full: h.0, h.2; selective: h.1, g.0, g.1, g.2, ... (6 blocks); pointwise: h.3"
    )
    assert _checkpointed_by_mode({}) == ""


def test_budget_gets_the_offload_price():
    cfg = compose(["ac=budget", "ac.size=1GiB", "ac.offload_flops_per_byte=50"])
    assert ac_policy(cfg, 1).offload_flops_per_byte == 50.0
    assert ac_policy(compose(["ac=budget", "ac.size=1GiB"]), 1).offload_flops_per_byte is None  # not offered
