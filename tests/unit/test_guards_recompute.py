"""verify_recompute: exact models pass; dropout without preserved RNG, a flag changed before
backward and a BatchNorm updated twice are caught and named; the model is left as it was."""

from __future__ import annotations

import contextlib
import dataclasses
import sys as _sys

import pytest
import torch
import torch.nn as nn

import distckpt
from distckpt.check.recompute import verify_recompute


class Block(nn.Module):
    def __init__(self, d: int = 16, p: float = 0.2, bn: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.norm = nn.BatchNorm1d(2 * d) if bn else nn.Identity()
        self.drop = nn.Dropout(p)
        self.fc2 = nn.Linear(2 * d, d)
        self.flag = False  # read inside the block: a task switch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.norm(self.fc1(x))))
        if self.flag:
            h = h * 2
        return x + self.fc2(h)


class Net(nn.Module):
    def __init__(self, n: int = 3, p: float = 0.2, bn: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(p=p, bn=bn) for _ in range(n))
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


X = torch.randn(8, 16)


def loss_fn(model: nn.Module) -> torch.Tensor:
    return model(X).pow(2).mean()


@pytest.mark.parametrize("reentrant", [False, True])
def test_exact_model_passes_and_leaves_model_as_before(reentrant):
    model = distckpt.wrap(Net(bn=True), "full", reentrant=reentrant)
    loss_fn(model).backward()  # some grads and BN statistics already there
    grads = {n: p.grad for n, p in model.named_parameters()}
    grad_values = {n: g.clone() for n, g in grads.items()}
    bufs = {n: b.clone() for n, b in model.named_buffers()}
    rng = torch.get_rng_state()
    report = verify_recompute(model, loss_fn)
    assert report.ok and report.mismatches == []
    assert report.blocks == ["blocks.0", "blocks.1", "blocks.2"]
    assert report.loss[0] == report.loss[1] and report.max_grad_diff == 0.0  # bitwise on CPU
    for n, p in model.named_parameters():
        assert p.grad is grads[n] and torch.equal(p.grad, grad_values[n])
    for n, b in model.named_buffers():
        assert torch.equal(b, bufs[n]), n
    assert torch.equal(torch.get_rng_state(), rng)


def test_grads_none_stay_none():
    model = distckpt.wrap(Net(), "full")
    assert verify_recompute(model, loss_fn).ok
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("reentrant", [False, True])
def test_dropout_without_preserved_rng_is_caught(reentrant):
    model = distckpt.wrap(Net(), "full", preserve_rng_state=False, reentrant=reentrant)
    with pytest.raises(distckpt.RecomputeMismatchError) as e:
        verify_recompute(model, loss_fn)
    first = e.value.report.mismatches[0]
    assert first.module.startswith("blocks.0"), first
    assert "preserve_rng_state" in str(e.value)
    if not reentrant:  # op level: the dropout mask itself is named
        assert first.kind == "rng" and first.module == "blocks.0.drop" and "bernoulli" in first.detail
    # the same report without raising
    report = verify_recompute(model, loss_fn, raise_on_mismatch=False)
    assert not report.ok and report.mismatches[0].module == first.module


def test_dropout_with_preserved_rng_passes():
    model = distckpt.wrap(Net(p=0.5), "full", preserve_rng_state=True)
    assert verify_recompute(model, loss_fn).ok


def test_flag_changed_before_backward_is_caught():
    model = distckpt.wrap(Net(p=0.0), "full")

    def switching_loss(m: nn.Module) -> torch.Tensor:
        m.blocks[1].flag = True
        loss = m(X).pow(2).mean()
        m.blocks[1].flag = False  # changed between forward and backward: the recompute sees False
        return loss

    with pytest.raises(distckpt.RecomputeMismatchError) as e:
        verify_recompute(model, switching_loss)
    first = e.value.report.mismatches[0]
    assert first.module.startswith("blocks.1") and first.kind in ("control_flow", "state")
    assert "between forward and backward" in str(e.value)


def test_batchnorm_double_update_is_caught(monkeypatch):
    model = distckpt.wrap(Net(bn=True), "full")
    assert verify_recompute(model, loss_fn).ok  # distckpt's fix in place
    runtime = _sys.modules["distckpt.runtime.recompute"]
    monkeypatch.setattr(runtime, "_keep_running_stats", lambda norms: contextlib.nullcontext())
    with pytest.raises(distckpt.RecomputeMismatchError) as e:
        verify_recompute(model, loss_fn)
    kinds = {(m.module, m.kind) for m in e.value.report.mismatches}
    assert ("blocks.0.norm", "batchnorm") in kinds
    assert "pytorch#96136" in str(e.value)


def test_loss_must_be_scalar():
    model = distckpt.wrap(Net(), "full")
    with pytest.raises(distckpt.ConfigError, match="scalar"):
        verify_recompute(model, lambda m: m(X))


def test_bf16_autocast_with_batchnorm_passes():
    model = distckpt.wrap(Net(p=0.3, bn=True), "full")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = verify_recompute(model, loss_fn)
    assert report.ok and report.max_grad_diff == 0.0


def test_selective_policy_passes_and_is_checked():
    assert verify_recompute(distckpt.wrap(Net(p=0.3), "selective"), loss_fn).ok
    report = verify_recompute(
        distckpt.wrap(Net(p=0.3), "selective", preserve_rng_state=False), loss_fn, raise_on_mismatch=False
    )
    assert report.mismatches[0].kind == "rng"


def test_offloaded_blocks_are_not_reported_as_recomputed_but_their_gradients_are_checked():
    from distckpt.select.policies import Placement

    model = distckpt.wrap(Net(p=0.3), Placement(("offload", "full", "offload")))
    report = verify_recompute(model, loss_fn)
    assert report.ok and report.blocks == ["blocks.1"], report  # the one block that recomputes
    # The gradient comparison covers the offloaded blocks: break one's saved-tensor round trip and it fails.
    import distckpt.runtime.recompute as recompute

    class Corrupting(recompute.PinnedHostStore):
        def to_host(self, t):
            return (t.device, t * 2)

        def to_device(self, packed):
            return packed[1]

    model._modules["blocks"][0]._distckpt_options = dataclasses.replace(
        model.blocks[0]._distckpt_options, store=Corrupting()
    )
    bad = verify_recompute(model, loss_fn, raise_on_mismatch=False)
    assert not bad.ok and any(m.module.startswith("blocks.0") for m in bad.mismatches), bad


class Narrowing(nn.Module):
    """Uses the first ``k`` features: a shape that depends on state read inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.k = 16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.pad(torch.relu(self.fc(x)[:, : self.k]), (0, 16 - self.k))


def test_state_dependent_shape_is_caught_and_model_restored():
    model = distckpt.wrap(nn.Sequential(Narrowing(), Narrowing()), "full", blocks=Narrowing)

    def narrowing_loss(m: nn.Module) -> torch.Tensor:
        m[1].k = 8
        loss = m(X).sum()
        m[1].k = 16
        return loss

    with pytest.raises(distckpt.RecomputeMismatchError) as e:
        verify_recompute(model, narrowing_loss)
    kinds = [(m.module, m.kind) for m in e.value.report.mismatches]
    assert kinds[0][0] == "1" and kinds[0][1] in ("control_flow", "shape")
    assert ("1", "checkpoint_error") in kinds  # torch's own metadata check fired too, and was turned into a report
    assert all(p.grad is None for p in model.parameters())


def test_nan_loss_is_not_verified():
    """A loss that is nan with and without checkpointing: equal nans are no proof the recompute is exact."""
    model = distckpt.wrap(Net(p=0.0), "full")
    report = verify_recompute(model, lambda m: loss_fn(m) * float("nan"), raise_on_mismatch=False)
    assert not report.ok
    assert [(m.module, m.kind, m.detail) for m in report.mismatches] == [
        ("", "nonfinite", "the loss is not finite with and without checkpointing")
    ]
    with pytest.raises(distckpt.RecomputeMismatchError, match="not finite"):
        verify_recompute(model, lambda m: loss_fn(m) * float("nan"))


class _NanGradInRecompute(nn.Module):
    """Finite forward; the recompute (a second call) returns inf, so one gradient is nan only with checkpointing."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        scale = torch.tensor(float("inf") if self.calls == 2 else 1.0)
        return x + self.fc(x) * scale


def test_nan_gradient_difference_fails_and_is_reported_as_nan():
    net = Net(p=0.0)
    net.blocks[1] = _NanGradInRecompute()
    model = distckpt.wrap(net, "full", blocks=["blocks.1"])
    report = verify_recompute(model, loss_fn, raise_on_mismatch=False)
    assert not report.ok
    assert any(m.kind == "nonfinite" and m.detail.endswith("not finite with checkpointing") for m in report.mismatches)
    assert report.max_grad_diff != report.max_grad_diff  # nan, not the 0.0 that max(0.0, nan) gave


def test_op_values_inf_against_finite_differ():
    """An op output that is inf in the forward and finite in the recompute is a difference (the tolerance
    bounds are inf there, and inf > inf is false)."""
    from distckpt.check.op_record import _values_differ

    f32 = torch.float32
    inf = float("inf")
    assert _values_differ(((4,), f32, inf, inf), ((4,), f32, 1.0, 1.0), 1e-5)
    assert _values_differ(((4,), f32, float("nan"), inf), ((4,), f32, 1.0, 1.0), 1e-5)
    assert not _values_differ(((4,), f32, inf, inf), ((4,), f32, inf, inf), 1e-5)
    assert not _values_differ(((4,), f32, 1.0, 1.0), ((4,), f32, 1.0, 1.0), 1e-5)
