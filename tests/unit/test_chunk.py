"""chunk_feed_forward: exact, names unchanged, and a lower training peak for a wide MLP (MemTracker)."""

from __future__ import annotations

import copy

import pytest
import torch
from models import GPT, MLP, GPTConfig, batch
from torch.distributed._tools.mem_tracker import MemTracker

import distckpt
from distckpt import ConfigError, chunk_feed_forward
from distckpt.apply.chunk import is_chunked, unchunk_feed_forward

CPU = torch.device("cpu")


def _peak_and_grads(module: torch.nn.Module, x: torch.Tensor):
    x = x.detach().clone().requires_grad_()
    mt = MemTracker()
    mt.track_external(module, x)
    with mt:
        module(x).sum().backward()
    return mt.get_tracker_snapshot("peak")[CPU]["Total"], [x.grad, *(p.grad for p in module.parameters())]


@pytest.mark.parametrize("checkpoint", [True, False])
def test_exact_in_float64(checkpoint):
    torch.manual_seed(0)
    ref = MLP(8, 64).double()
    chunked = chunk_feed_forward(copy.deepcopy(ref), 5, dim=1, checkpoint=checkpoint)  # 5 does not divide 23
    assert [n for n, _ in chunked.named_parameters()] == [n for n, _ in ref.named_parameters()]
    x = torch.randn(3, 23, 8, dtype=torch.float64)
    with torch.no_grad():
        # Smaller matmuls may round differently: equal to float64 precision, not bitwise.
        torch.testing.assert_close(ref(x), chunked(x), rtol=1e-13, atol=1e-13)
    _, g_ref = _peak_and_grads(ref, x)
    _, g = _peak_and_grads(chunked, x)
    for a, b in zip(g_ref, g):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_lower_training_peak_for_wide_mlp():
    torch.manual_seed(0)
    ref = MLP(32, 1024)
    x = torch.randn(2, 256, 32)
    peak_ref, g_ref = _peak_and_grads(ref, x)
    peak, g = _peak_and_grads(chunk_feed_forward(copy.deepcopy(ref), 32), x)
    hidden = 2 * 256 * 1024 * 4  # one (batch, seq, hidden) fp32 activation
    # Unchunked, backward holds the hidden pre- and post-GELU plus their gradients; chunked holds
    # an eighth of that at a time.
    assert peak <= peak_ref - 2 * hidden
    for a, b in zip(g_ref, g):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_inside_checkpointed_blocks_and_undo():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=64, seq=32, dim=16, heads=2, layers=2)
    ref = GPT(cfg).double()
    model = copy.deepcopy(ref)
    for block in model.h:
        chunk_feed_forward(block.mlp, 8)
    distckpt.wrap(model, "full")  # nested: the block's recompute runs the chunked MLP again
    assert model.state_dict().keys() == ref.state_dict().keys()
    inputs = batch(cfg, 2)
    ref(*inputs).backward()
    model(*inputs).backward()
    for (n, a), b in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12, msg=n)
    assert is_chunked(model.h[0].mlp)
    unchunk_feed_forward(model.h[0].mlp)
    assert type(model.h[0].mlp) is MLP
    with pytest.raises(ConfigError, match="chunk_size >= 1"):
        chunk_feed_forward(model.h[0].mlp, 0)
