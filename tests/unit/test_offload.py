"""offload="cpu": exact with every policy, and what it moves is exactly the checkpointed blocks'
inputs (the tensors checkpoint keeps), seen through a spy on the host store its hooks use (the "offload"
mode's: one copy rule for both)."""

from __future__ import annotations

import copy

import pytest
import torch
from models import GPT, GPTConfig, batch
from torch.distributed._tools.mem_tracker import MemTracker

import distckpt
from distckpt import Budget
from distckpt.apply.wrap import is_checkpointed
from distckpt.runtime import recompute
from tests.offload_store import use_numpy_store

CFG = GPTConfig(vocab=64, seq=16, dim=16, heads=2, layers=4, dropout=0.1)
POLICIES = ["full", "every:2", "first:1", "fraction:0.5", "selective", "budget"]


@pytest.fixture
def packed(monkeypatch):
    """Record every tensor the offload hooks hand the host store (the library's own, which still keeps it)."""
    seen: list[torch.Tensor] = []
    store = recompute.PinnedHostStore()
    real = store.to_host
    store.to_host = lambda t: seen.append(t) or real(t)
    monkeypatch.setattr(recompute, "host_store", lambda: store)
    return seen


def _wrap(model: torch.nn.Module, policy: str, inputs, **kw) -> torch.nn.Module:
    if policy == "budget":
        from distckpt.select.budget import predicted_peak
        from distckpt.select.profile import profile_model

        mp = profile_model(model, [(f"h.{i}", b) for i, b in enumerate(model.h)], inputs)
        policy = Budget((predicted_peak(mp, range(4)) + predicted_peak(mp, [])) // 2)
    return distckpt.wrap(model, policy, example_inputs=inputs, **kw)


@pytest.mark.parametrize("policy,reentrant", [(p, False) for p in POLICIES] + [("full", True)])
def test_exact_and_moves_exactly_the_block_inputs(policy, reentrant, packed):
    torch.manual_seed(0)
    ref = GPT(CFG)
    inputs = batch(CFG, 2)
    model = _wrap(copy.deepcopy(ref), policy, inputs, offload="cpu", reentrant=reentrant)
    assert distckpt.checkpointed(model)
    block_inputs: list[torch.Tensor] = []
    for b in model.h:
        if is_checkpointed(b):
            b.register_forward_pre_hook(lambda m, a: block_inputs.append(a[0]))
    torch.manual_seed(1)
    ref(*inputs).backward()
    torch.manual_seed(1)
    loss = model(*inputs)
    # pack saw exactly one tensor per checkpointed block: the block's input, not an inner activation.
    assert [t.untyped_storage().data_ptr() for t in packed] == [t.untyped_storage().data_ptr() for t in block_inputs]
    assert all(t.shape == (2, CFG.seq, CFG.dim) for t in packed)
    loss.backward()
    for (n, a), b in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad), n


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_test_store_sees_exactly_the_block_inputs_once(reentrant):
    """Through the test store (which copies CPU tensors, as the pinned store copies CUDA ones) the bytes moved
    are the checkpointed blocks' inputs, each once though a block takes it twice, and gradients stay exact."""

    class Twice(torch.nn.Module):  # its input passed twice: checkpoint saves it twice
        def __init__(self, d: int) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(d, d)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return x + torch.tanh(self.fc(y))

    class Net(torch.nn.Module):
        def __init__(self, d: int = 16, n: int = 3) -> None:
            super().__init__()
            self.inp = torch.nn.Linear(d, d)
            self.blocks = torch.nn.ModuleList(Twice(d) for _ in range(n))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.inp(x)
            for b in self.blocks:
                x = b(x, x)
            return x.square().mean()

    torch.manual_seed(0)
    ref, x = Net(), torch.randn(8, 16)
    model = distckpt.wrap(copy.deepcopy(ref), "full", offload="cpu", reentrant=reentrant)
    ref(x).backward()
    with use_numpy_store() as store:
        model(x).backward()
    assert store.packs == store.unpacks == 3 and store.bytes == 3 * x.numel() * 4, (store.packs, store.bytes)
    for (n, a), b in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad), n


def test_cpu_tensors_are_not_copied():
    """On the CPU offload must cost nothing: same peak as without it (save_on_cpu would copy)."""
    torch.manual_seed(0)
    base = GPT(CFG)
    inputs = batch(CFG, 2)
    peaks = []
    for offload in (None, "cpu"):
        model = distckpt.wrap(copy.deepcopy(base), "full", offload=offload)
        mt = MemTracker()
        mt.track_external(model, *inputs)
        with mt:
            model(*inputs).backward()
        peaks.append(mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])
    assert peaks[0] == peaks[1]
    with pytest.raises(distckpt.ConfigError, match="offload"):
        distckpt.wrap(copy.deepcopy(base), "full", offload="nvme")


@pytest.mark.cuda
def test_cuda_offload_moves_inputs_to_host_and_lowers_device_memory():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=256, seq=256, dim=256, heads=4, layers=8)
    ref = GPT(cfg).cuda()
    inputs = batch(cfg, 8, device="cuda")
    peaks, grads = [], []
    for offload in (None, "cpu"):
        model = distckpt.wrap(copy.deepcopy(ref), "full", offload=offload)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        model(*inputs).backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        grads.append([p.grad for p in model.parameters()])
    boundary = 8 * cfg.seq * cfg.dim * 4
    assert peaks[1] <= peaks[0] - (cfg.layers - 2) * boundary
    for a, b in zip(*grads):
        assert torch.equal(a, b)
