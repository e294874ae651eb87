"""``budget:auto`` plans on the estimator of ``distckpt plan`` (fake tensors, no real sample step): the same
plan as the measured profile on CPU when forced with an explicit budget, and on CUDA no activation memory."""

from __future__ import annotations

import copy

import pytest
import torch
from models import GPT, GPTConfig, batch, hf_gpt2

import distckpt
from distckpt import ConfigError
from distckpt.select.budget import budget_profile, plan_budget, predicted_peak
from distckpt.select.budget import planner as budget_mod
from distckpt.select.policies import Candidates
from distckpt.select.profile import profile_model

CFG = GPTConfig(vocab=64, seq=32, dim=32, heads=2, layers=5)  # 5 blocks, 3 traced: two are stretched


def _subject(kind: str):
    torch.manual_seed(0)
    model = GPT(CFG) if kind == "gpt" else hf_gpt2(CFG)  # HF GPT-2 ties its embedding and LM head
    blocks = (
        [(f"h.{i}", b) for i, b in enumerate(model.h)]
        if kind == "gpt"
        else [(f"transformer.h.{i}", b) for i, b in enumerate(model.transformer.h)]
    )
    inputs = batch(CFG, 4)
    return model, blocks, inputs if kind == "gpt" else {"input_ids": inputs[0], "labels": inputs[1]}


@pytest.mark.parametrize("kind", ["gpt", "hf_gpt2"])
def test_estimator_path_plans_as_the_measured_profile(kind):
    if kind == "hf_gpt2":
        pytest.importorskip("transformers")
    model, blocks, inputs = _subject(kind)
    before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    measured = profile_model(model, blocks, inputs)
    none, full = predicted_peak(measured, []), predicted_peak(measured, range(len(blocks)))
    # HF GPT-2 on fake tensors: transformers takes them for tracing (is_tracing: is_fake_tensor) and builds the
    # causal mask that SDPA's is_causal skips on real ones: each block's input gains it (a few KiB here).
    sizes = (full, (full + none) // 2, none) if kind == "gpt" else ((full + none) // 2, none)
    for size in sizes:
        est, got = budget_profile(Candidates(model, blocks, inputs), "cpu", size, estimate=True)
        assert got == size and est.device == "cpu"
        plan, want = plan_budget(est, size), plan_budget(measured, size)
        real = predicted_peak(measured, plan.placement)  # the plan's mode per block (none, ..., full; KeepOps)
        assert abs(plan.peak_bytes / real - 1) < 0.05 and real <= size, (size, plan, real)
        if kind == "gpt":
            assert plan.placement == want.placement, (size, plan, want)
    # The real tensors are put back untouched: the same objects, values, no gradients, not fake.
    for n, p in model.named_parameters():
        assert p is before[n][0] and torch.equal(p, before[n][1]) and p.grad is None, n
        assert type(p) is torch.nn.Parameter


def test_estimate_is_traced_once_per_model_blocks_and_input_shapes(monkeypatch):
    # budget:auto plans at wrap and again at parallelize: the fake-tensor trace (seconds) runs once per
    # (model, blocks, input shapes), as profile_model's measure does; other shapes trace again.
    from distckpt.select.profile import fake_profile

    cfg = GPTConfig(vocab=16, seq=8, dim=8, heads=1, layers=2)  # what is cached does not depend on the size
    torch.manual_seed(0)
    model = GPT(cfg)
    blocks = [(f"h.{i}", b) for i, b in enumerate(model.h)]
    traced = []
    real_trace = fake_profile.profile_cut
    monkeypatch.setattr(fake_profile, "profile_cut", lambda *a, **k: traced.append(1) or real_trace(*a, **k))
    first = fake_profile.estimate_profile(model, blocks, batch(cfg, 4))
    assert fake_profile.estimate_profile(model, blocks, batch(cfg, 4)) is first and len(traced) == 1
    no_second_trace = lambda *a, **k: traced.append(1) or (first, [0, 1])
    monkeypatch.setattr(fake_profile, "profile_cut", no_second_trace)
    assert fake_profile.estimate_profile(model, blocks, batch(cfg, 2)) is first and len(traced) == 2  # a miss


def test_budget_auto_goes_through_the_estimator_not_a_real_step(monkeypatch):
    model, blocks, inputs = _subject("gpt")
    measured = profile_model(model, blocks, inputs)
    none, full = predicted_peak(measured, []), predicted_peak(measured, range(len(blocks)))
    size = full + (none - full) // 4  # a mix of modes (at the midpoint pointwise everywhere fits: no FLOPs)
    want = plan_budget(measured, size).modes
    assert len(set(want)) > 1, want
    seen = []
    monkeypatch.setattr(budget_mod, "auto_budget", lambda device: seen.append(device) or size)

    def no_real_step(self):
        raise AssertionError("budget:auto ran a real sample step")

    monkeypatch.setattr(Candidates, "model_profile", no_real_step)
    wrapped = distckpt.wrap(
        copy.deepcopy(model), "budget:auto", blocks=[f"h.{i}" for i in range(5)], example_inputs=inputs
    )
    assert seen == ["cpu"]
    assert distckpt.checkpointed(wrapped, modes=True) == {f"h.{i}": m for i, m in enumerate(want) if m != "none"}


def test_budget_auto_off_cuda_names_the_fix():
    model, blocks, inputs = _subject("gpt")
    with pytest.raises(ConfigError, match="budget:auto needs a CUDA device"):
        budget_profile(Candidates(model, blocks, inputs), "cpu", None)


@pytest.mark.cuda
def test_budget_auto_on_cuda_plans_on_fake_tensors_and_fits():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=256, seq=256, dim=256, heads=4, layers=6)
    model = GPT(cfg).cuda()
    inputs = batch(cfg, 16, device="cuda")
    blocks = [(f"h.{i}", b) for i, b in enumerate(model.h)]
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    est, auto = budget_profile(Candidates(model, blocks, inputs), "cuda", None)
    torch.cuda.synchronize()
    # The estimator allocates no activations on the device (a real step of this model takes > 100 MiB).
    assert torch.cuda.max_memory_allocated() - held < 2**20
    assert est.device == "cuda" and auto >= held
    free, _ = torch.cuda.mem_get_info()
    assert abs(auto - (free + torch.cuda.memory_allocated())) < 2**26  # free memory + what this process holds
    measured = profile_model(model, blocks, inputs)
    for sel in ([], range(6)):  # the estimator (CUDA kernels on fake tensors) against a real CUDA step
        assert abs(predicted_peak(est, sel) / predicted_peak(measured, sel) - 1) < 0.05, sel
    wrapped = distckpt.wrap(copy.deepcopy(model), "budget:auto", example_inputs=inputs)
    assert distckpt.checkpointed(wrapped) == [blocks[i][0] for i in plan_budget(est, auto).selected]


def test_estimator_refuses_blocks_that_run_out_of_order():
    # The estimator cuts one container to a few blocks and stretches the profile back in container order;
    # blocks that run in another order (here reversed) are refused, naming budget:SIZE (which measures them).
    from distckpt.select.profile import fake_profile

    class Reversed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in reversed(self.layers):
                x = torch.relu(layer(x))
            return x.sum()

    model = Reversed()
    blocks = [(f"layers.{i}", m) for i, m in enumerate(model.layers)]
    assert profile_model(model, blocks, (torch.randn(4, 8),)).run_order == (2, 1, 0)
    with pytest.raises(ConfigError, match="budget:SIZE"):
        fake_profile.estimate_profile(model, blocks, (torch.randn(4, 8),))
