"""selective: op-level checkpointing is exact and saves >= 40% activation memory at <= 10% extra
FLOPs on a transformer block (MemTracker, FlopCounterMode)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as tuc
from models import GPT, Block, GPTConfig, batch
from torch.distributed._tools.mem_tracker import MemTracker

import distckpt
from distckpt import ConfigError, Selective
from distckpt.runtime.selective import resolve_ops, selective_context_fn
from distckpt.select.profile import flop_counter

CPU = torch.device("cpu")


def _block_step(block: nn.Module, x: torch.Tensor, context_fn=None, checkpoint=True):
    """Activation bytes held after the forward, FLOPs of forward+backward, and the gradients."""
    x = x.detach().clone().requires_grad_()
    mt = MemTracker()
    mt.track_external(block, x)
    with flop_counter() as counter, mt:
        before = mt.get_tracker_snapshot()[CPU]["Activation"]
        if not checkpoint:
            y = block(x)
        else:
            y = tuc.checkpoint(block, x, use_reentrant=False, context_fn=context_fn or tuc.noop_context_fn)
        held = mt.get_tracker_snapshot()[CPU]["Activation"] - before - y.untyped_storage().nbytes()
        y.sum().backward()
    return held, counter.get_total_flops(), [x.grad, *(p.grad for p in block.parameters())]


def test_transformer_block_saves_40_percent_at_10_percent_flops():
    torch.manual_seed(0)
    cfg = GPTConfig(dim=64, heads=4, seq=128)
    block = Block(cfg)
    x = torch.randn(2, cfg.seq, cfg.dim)
    ref_bytes, ref_flops, ref_grads = _block_step(copy.deepcopy(block), x, checkpoint=False)
    sel_bytes, sel_flops, sel_grads = _block_step(copy.deepcopy(block), x, selective_context_fn())
    full_bytes, full_flops, _ = _block_step(copy.deepcopy(block), x)
    assert sel_bytes <= 0.6 * ref_bytes
    assert sel_flops <= 1.10 * ref_flops
    assert full_bytes < sel_bytes and full_flops > sel_flops  # between none and full, as it should be
    for a, b in zip(ref_grads, sel_grads):
        assert torch.equal(a, b)


def test_op_list_is_configurable():
    torch.manual_seed(0)
    cfg = GPTConfig(dim=32, heads=2, seq=32)
    block = Block(cfg)
    x = torch.randn(2, cfg.seq, cfg.dim)
    nothing, _, _ = _block_step(copy.deepcopy(block), x, selective_context_fn(save_ops=()))
    full, _, _ = _block_step(copy.deepcopy(block), x)
    mm_only, _, _ = _block_step(
        copy.deepcopy(block), x, selective_context_fn(save_ops=["aten.mm", "addmm"], every_other_matmul=False)
    )
    default, _, grads = _block_step(copy.deepcopy(block), x, selective_context_fn())
    via_policy, _, _ = _block_step(copy.deepcopy(block), x, Selective(("mm", "addmm"), False).context_fn())
    assert via_policy == mm_only
    assert nothing == full  # saving no op is full recompute
    assert full < default < mm_only  # every-other-matmul keeps less than every matmul
    assert resolve_ops([torch.ops.aten.mm.default, "bmm"]) == {torch.ops.aten.mm, torch.ops.aten.bmm}
    with pytest.raises(ConfigError, match="aten ops"):
        resolve_ops([3.0])


def test_wrap_selective_gradients_equal_no_checkpointing():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=64, seq=32, dim=32, heads=2, layers=3, dropout=0.1)
    ref = GPT(cfg)
    model = distckpt.wrap(copy.deepcopy(ref), "selective")
    assert distckpt.checkpointed(model) == ["h.0", "h.1", "h.2"]
    inputs = batch(cfg, 2)
    torch.manual_seed(1)
    ref(*inputs).backward()
    torch.manual_seed(1)
    model(*inputs).backward()  # dropout replays the same mask in the recompute
    for (n, a), b in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad), n


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)))


def test_selective_with_batchnorm_keeps_running_stats_exact():
    torch.manual_seed(0)
    ref = nn.Sequential(ConvBN(), ConvBN())
    model = distckpt.wrap(copy.deepcopy(ref), Selective(save_ops=("convolution",)), blocks=ConvBN)
    x = torch.randn(2, 4, 8, 8)
    ref(x).sum().backward()
    model(x).sum().backward()
    for (n, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), n  # running stats updated once, not twice
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad)
    with pytest.raises(ConfigError, match="reentrant=False"):
        distckpt.wrap(copy.deepcopy(ref), "selective", blocks=ConvBN, reentrant=True)


class PostNorm(nn.Module):
    """A block whose last matmul's output is read by the recompute: the LayerNorm after it saves its input."""

    def __init__(self, dim: int):
        super().__init__()
        self.fc1, self.fc2, self.norm = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim), nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.fc2(torch.nn.functional.gelu(self.fc1(x))))


def _steps(model: nn.Module, x: torch.Tensor, n: int) -> list[tuple[int, list[torch.Tensor]]]:
    """Per step: activation bytes left alive by the forward (MemTracker) and the gradients."""
    out = []
    for _ in range(n):
        mt = MemTracker()
        mt.track_external(model)
        with mt:
            before = mt.get_tracker_snapshot()[CPU]["Activation"]
            y = model(x)
            held = mt.get_tracker_snapshot()[CPU]["Activation"] - before
            y.float().pow(2).mean().backward()
        out.append((held, [p.grad.clone() for p in model.parameters()]))
        model.zero_grad(set_to_none=True)
    return out


def _recompute_flops(model: nn.Module, x: torch.Tensor) -> int:
    with flop_counter() as counter:
        model(x).float().pow(2).mean().backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


@pytest.mark.parametrize("every_other", [False, True])
def test_outputs_beyond_the_recompute_are_not_kept_after_the_first_step(every_other):
    # pointwise keeps every matmul output; the MLP's output projection is the last op whose output a
    # block's recompute never reads (nothing after it saves a tensor: checkpoint stops before it). From
    # the second step on it is no longer kept: exactly its output less per block, gradients bitwise
    # those of no checkpointing, the same recompute FLOPs. selective already recomputes it (2nd, 4th
    # matmul): nothing changes.
    torch.manual_seed(0)
    cfg = GPTConfig(dim=32, heads=2, seq=16, layers=2, vocab=64)
    plain = GPT(cfg)
    idx, _ = batch(cfg, 2)
    wrapped = distckpt.wrap(copy.deepcopy(plain), Selective(every_other_matmul=every_other))
    ref = _steps(plain, idx, 1)[0][1]
    flops = [_recompute_flops(copy.deepcopy(wrapped), idx)]
    steps = _steps(wrapped, idx, 3)
    flops.append(_recompute_flops(wrapped, idx))
    for _, grads in steps:
        for a, b in zip(ref, grads):
            assert torch.equal(a, b)
    last_output = 2 * cfg.seq * cfg.dim * 4  # (batch, seq, dim) fp32, per block
    drop = 0 if every_other else cfg.layers * last_output
    assert [held for held, _ in steps] == [steps[0][0], steps[0][0] - drop, steps[0][0] - drop]
    assert flops[0] == flops[1]


def test_an_output_the_recompute_reads_stays_kept():
    torch.manual_seed(0)
    model = nn.Sequential(PostNorm(16), PostNorm(16))
    x = torch.randn(4, 16)
    plain = copy.deepcopy(model)
    distckpt.wrap(model, Selective(every_other_matmul=False), blocks=lambda m: isinstance(m, PostNorm))
    ref = _steps(plain, x, 1)[0][1]
    steps = _steps(model, x, 2)
    assert steps[0][0] == steps[1][0] > 0
    for _, grads in steps:
        for a, b in zip(ref, grads):
            assert torch.equal(a, b)


def test_a_copy_keeps_what_the_block_learned():
    # The reach lives on the block: a deepcopy (or pickle) after one step holds the trimmed bytes from its
    # first step, as a budget's profile hands what it learned on to training.
    torch.manual_seed(0)
    cfg = GPTConfig(dim=32, heads=2, seq=16, layers=2, vocab=64)
    idx, _ = batch(cfg, 2)
    model = distckpt.wrap(GPT(cfg), Selective(every_other_matmul=False))
    first, second = (held for held, _ in _steps(model, idx, 2))
    assert second < first
    assert _steps(copy.deepcopy(model), idx, 1)[0][0] == second
