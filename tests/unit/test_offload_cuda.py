"""The "offload" mode on CUDA (skipped without a device): pinned host memory, which the device's
allocator does not count, so the predicted device peak of placements mixing offload with other modes
is checked against ``torch.cuda.max_memory_allocated`` within 3%; gradients bitwise equal to no
checkpointing; the exchange rate measured once per device; and a budget plan offloading blocks fits."""

from __future__ import annotations

import copy

import pytest
import torch
from models import GPT, GPTConfig, batch

import distckpt
from distckpt.select.blocks import find_blocks
from distckpt.select.budget import plan_budget, predicted_peak
from distckpt.select.policies import Placement
from distckpt.select.profile import profile_model

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
KW = dict(strategy="none", optimizer="none")


def _gpt() -> tuple[torch.nn.Module, tuple]:
    # tests/models.py's GPT (GPT-2's layout) rather than HF's: a GPU machine's own python may lack transformers.
    cfg = GPTConfig(vocab=2048, seq=256, dim=256, heads=4, layers=6)
    torch.manual_seed(0)
    return GPT(cfg).cuda().train(), batch(cfg, 8, device="cuda")


def _peak(model: torch.nn.Module, inputs: tuple) -> int:
    for _ in range(2):  # the second step is measured: the first one's allocator warm-up left behind
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        model(*inputs).backward()
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def test_cuda_offload_peak_predicted_within_three_percent_and_exact():
    base, inputs = _gpt()
    mp = profile_model(base, find_blocks(base), inputs, modes=("full", "offload"))
    n = len(mp.blocks)
    assert all(b.offload_bytes > 0 and b.offload_held_bytes >= 0 for b in mp.blocks)
    for modes in (
        ("offload",) * n,
        tuple(("offload", "full", "none")[i % 3] for i in range(n)),
        tuple(("none", "offload")[i % 2] for i in range(n)),
    ):
        model = distckpt.wrap(copy.deepcopy(base), Placement(modes))
        predicted, measured = predicted_peak(mp, modes, **KW), _peak(model, inputs)
        assert abs(predicted - measured) <= 0.03 * measured, (modes, predicted, measured)
    # Bitwise: the values are copied, not recomputed.
    ref = copy.deepcopy(base)
    model = distckpt.wrap(copy.deepcopy(base), Placement(("offload",) * n))
    ref(*inputs).backward()
    model(*inputs).backward()
    for (name, a), b in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad), name


def test_cuda_budget_offers_offload_and_fits():
    from distckpt.select.profile import transfer

    base, inputs = _gpt()
    mp = profile_model(base, find_blocks(base), inputs, modes=("full", "offload"))
    ratio = transfer.flops_per_byte(mp, torch.device("cuda"))
    assert ratio > 0 and transfer.flops_per_byte(mp, torch.device("cuda")) == ratio  # cached per device
    n = len(mp.blocks)
    budget = (predicted_peak(mp, [], **KW) + predicted_peak(mp, range(n), **KW)) // 2
    plan = plan_budget(mp, budget, offload_flops_per_byte=1e-6, selective=False, **KW)  # bytes nearly free
    assert plan.offloaded and plan.recompute_flops == 0
    offered = distckpt.Budget(budget, selective=False, offload_flops_per_byte="auto", **KW)
    model = distckpt.wrap(copy.deepcopy(base), offered, example_inputs=inputs)
    assert _peak(model, inputs) <= budget
