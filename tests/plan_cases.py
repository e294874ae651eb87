"""``distckpt plan``'s cases against measurement: model factories (the doctor's contract: ``() -> (model,
loss_fn, batch_fn)``), each policy's planned peak beside MemTracker's peak of a real steady-state AdamW step, on
one process (:func:`compare`) and per rank under ``distckpt.parallelize`` (:func:`compare_dist`). Shared by
tests/unit/test_plan.py and benchmarks/plan_accuracy.py.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import peaks
import torch
import torch.nn as nn

import distckpt
from distckpt.cli.plan import plan_at_scale
from distckpt.select.policies import Placement
from distckpt.select.profile import memory_tracker


def _gpt_batch(step: int, rank: int, world: int) -> dict[str, torch.Tensor]:
    return {"tokens": torch.randint(0, 256, (4, 64)), "label": torch.randint(0, 4, (4,))}


def _sum_losses(m: nn.Module, b: Any) -> torch.Tensor:
    return sum(m(b).values())


def _make_gpt(n_layer: int) -> tuple:
    from distckpt.train.models import MultiTaskGPT

    return MultiTaskGPT(vocab_size=256, seq_len=64, d_model=64, n_layer=n_layer, n_head=4), _sum_losses, _gpt_batch


def gpt_factory(n_layer: int = 6) -> Callable[[], tuple]:
    """The launcher's MultiTaskGPT (distckpt/train/models.py), the doctor's contract (picklable)."""
    return functools.partial(_make_gpt, n_layer)


def mlp_factory(n_layer: int = 6) -> Callable[[], tuple]:
    """The launcher's MultiTaskMLP."""

    def make() -> tuple:
        from distckpt.train.models import MultiTaskMLP

        model = MultiTaskMLP(in_features=32, hidden=256, n_layer=n_layer)

        def batch(step: int, rank: int, world: int) -> dict[str, torch.Tensor]:
            n = 1024
            return {"x": torch.randn(n, 32), "y_a": torch.randint(0, 10, (n,)), "y_b": torch.randint(0, 2, (n,))}

        return model, lambda m, b: sum(m(b).values()), batch

    return make


def hf_factory(family: str) -> Callable[[], tuple]:
    """A Hugging Face model of tests/zoo.py at its small size (no padding mask: see docs/plan.md)."""

    def make() -> tuple:
        from zoo import FAMILIES

        fam = FAMILIES[family]
        model = fam.make()
        ids = torch.randint(3, 128, (2, 32))

        def batch(step: int, rank: int, world: int) -> dict[str, Any]:
            return {"input_ids": ids, "labels": ids, "use_cache": False}

        return model, lambda m, b: m(**b).loss, batch

    return make


def measured_peak(factory: Callable[[], tuple], policy: Any, blocks: list[str] | None = None) -> int:
    """MemTracker's peak of a steady-state AdamW step (the first step creates the optimizer state)."""
    torch.manual_seed(0)
    model, loss_fn, batch_fn = factory()
    model.train()
    if policy != "none":
        distckpt.wrap(model, policy, blocks=blocks)
    return _steady_peak(model, loss_fn, batch_fn(0, 0, 1))


def compare(factory: Callable[[], tuple], budget_frac: float = 0.5) -> dict[str, tuple[int, int]]:
    """``{policy: (predicted, measured)}`` at one rank without a strategy (full replicas, no DDP)."""
    torch.manual_seed(0)
    r = plan_at_scale(factory, strategy="none", world_size=1)
    none, full = r.policy("none").peak_bytes, r.policy("full").peak_bytes
    r = r.with_budget(int(full + budget_frac * (none - full)))
    out = {}
    for p in r.policies:
        if not p.checkpointed or p.policy == "full":
            out[p.policy] = (p.peak_bytes, measured_peak(factory, p.policy if p.checkpointed else "none"))
            continue
        # The estimate's own mode per block: op-level where its profile ran the mode, else full.
        placement = Placement(dict(zip(r.blocks, p.modes)))
        out[p.policy] = (p.peak_bytes, measured_peak(factory, placement, list(r.blocks)))
    return out


FACTORIES = {"gpt": gpt_factory, "mlp": mlp_factory, "hf": hf_factory}  # picklable names for spawned ranks


def _rank_peaks(
    rank: int, world: int, kind: str, arg: Any, jobs: list[tuple[str, list[tuple[str, dict[str, str] | None]]]]
) -> list[list[int]]:
    """This rank's MemTracker peak of a steady-state AdamW step under ``parallelize(strategy)`` per
    ``(policy, {block: mode})`` (the plan's own mode per block, ``None`` for none/full; DDP's C++ buckets
    tracked from the step's start: peaks.ddp_buckets), for each ``(strategy, runs)`` of ``jobs``."""

    out = []
    for strategy, runs in jobs:
        peaks = []
        for policy, modes in runs:
            torch.manual_seed(0)
            model, loss_fn, batch_fn = FACTORIES[kind](arg)()
            model.train()
            if modes is not None:
                distckpt.wrap(model, Placement(modes), blocks=list(modes))
            elif policy != "none":
                distckpt.wrap(model, policy)
            batch = batch_fn(0, rank, world)
            peaks.append(_steady_peak(distckpt.parallelize(model, strategy), loss_fn, batch, ddp_buckets=True))
        out.append(peaks)
    return out


def _steady_peak(
    pm: nn.Module, loss_fn: Callable[..., torch.Tensor], batch: dict[str, Any], *, ddp_buckets: bool = False
) -> int:
    """MemTracker's peak of a steady-state AdamW step of ``pm`` (the first step creates the optimizer
    state); ``ddp_buckets``: a second step first, whose DDP gradient buckets (allocated in C++) are tracked."""
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-3)

    def step() -> None:
        loss_fn(pm, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    buckets = peaks.ddp_buckets(step) if ddp_buckets else []  # the second step: DDP rebuilds its buckets in its forward
    tracker = memory_tracker(pm, opt, *buckets, *[t for t in batch.values() if isinstance(t, torch.Tensor)])
    with tracker:
        step()
    return max(d.get("Total", 0) for d in tracker.get_tracker_snapshot("peak").values())


def compare_dist(
    kind: str,
    arg: Any,
    strategies: tuple[str, ...] = ("ddp", "fsdp2"),
    world: int = 2,
    budget_frac: float = 0.5,
    *,
    run_ranks: Callable[..., dict[int, Any]],
) -> dict[str, dict[str, tuple[int, int]]]:
    """``{strategy: {policy: (predicted, measured)}}`` per rank on ``world`` gloo ranks (the largest rank's
    measure), for a factory of :data:`FACTORIES` named ``kind`` with argument ``arg``: every strategy in one
    call of ``run_ranks(target, world, *args) -> {rank: result}`` (the benchmark spawns its ranks:
    benchmarks/ranks.py; a test runs them on its pool)."""
    factory = FACTORIES[kind](arg)
    reports, jobs = [], []
    for strategy in strategies:
        torch.manual_seed(0)
        r = plan_at_scale(factory, strategy=strategy, world_size=world)
        none, full = r.policy("none").peak_bytes, r.policy("full").peak_bytes
        r = r.with_budget(int(full + budget_frac * (none - full)))
        # Every block of the plan is a candidate with its mode ("none" for a kept one): parallelize shards the
        # candidates as FSDP units, and a kept block left out would sit unsharded in the root unit (measured:
        # the gpt2 FSDP2 budget row 5.4% "under" with only the checkpointed blocks as candidates).
        runs = [
            (p.policy, None)
            if p.policy == "full"
            else ("none", None)
            if not p.checkpointed
            else (p.policy, dict(zip(r.blocks, p.modes)))
            for p in r.policies
        ]
        reports.append(r)
        jobs.append((strategy, runs))
    measured = run_ranks(_rank_peaks, world, kind, arg, jobs)
    return {
        s: {p.policy: (p.peak_bytes, max(m[k][i] for m in measured.values())) for i, p in enumerate(r.policies)}
        for k, (s, r) in enumerate(zip(strategies, reports))
    }


make_gpt = gpt_factory(4)  # `distckpt plan --factory plan_cases:make_gpt` (tests/unit/test_plan.py)


def make_llama_70b() -> tuple:
    """A Llama-3-70B-shaped model (80 layers, hidden 8192, FFN 28672, 64 heads, 8 KV heads, vocab 128256),
    bf16, one sequence of 4096 tokens per rank (``distckpt plan --factory benchmarks.plan_accuracy:make_llama_70b``).
    Only ever built on fake tensors (140 GB of parameters)."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=128256,
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        max_position_embeddings=8192,
    )
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # .to(bfloat16) cannot swap fake parameters
    try:
        model = transformers.LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)

    def batch(step: int, rank: int, world: int) -> dict[str, Any]:
        ids = torch.zeros(1, 4096, dtype=torch.long)
        return {"input_ids": ids, "labels": ids, "use_cache": False}

    return model, lambda m, b: m(**b).loss, batch
