"""GradSyncGuard in one process: the no-gradient check, argument validation, fingerprints."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import distckpt
from distckpt.check.sync_guard import GradSyncGuard, NoGradientError, _fingerprint, _weights, _wnorm


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 1)
        self.aux = nn.Linear(8, 1)  # trainable, but the loss never uses it
        self.frozen = nn.Linear(8, 1).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = torch.relu(b(x))
        return self.head(x)


def _step(model: nn.Module) -> None:
    model.zero_grad(set_to_none=False)  # aux keeps a zero gradient after the first step
    model(torch.randn(4, 8)).sum().backward()


def test_single_process_reports_global_norm():
    model = distckpt.wrap(TwoHeads(), "full")
    guard = GradSyncGuard(model)
    _step(model)
    report = guard.check()
    expected = torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]).norm()
    assert report.grads_checked and report.params_checked and report.step == 0
    assert report.grad_norm == pytest.approx(float(expected), rel=1e-6)
    assert report.no_grad == []


def test_no_gradient_raises_after_k_steps():
    model = distckpt.wrap(TwoHeads(), "full")
    guard = GradSyncGuard(model, no_grad_steps=3, on_no_grad="raise")
    for _ in range(2):
        _step(model)
        assert guard.check().no_grad == []
    _step(model)
    with pytest.raises(NoGradientError, match=r"aux\.weight, aux\.bias") as e:
        guard.check()
    assert "frozen" not in str(e.value).split("Likely cause")[0]  # requires_grad=False is not reported
    assert e.value.__class__ is distckpt.NoGradientError and not isinstance(e.value, distckpt.GradDesyncError)


def test_no_gradient_warns_once_and_reports():
    model = distckpt.wrap(TwoHeads(), "full")
    guard = GradSyncGuard(model, no_grad_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            _step(model)
            report = guard.check()
    assert report.no_grad == ["aux.weight", "aux.bias"]
    assert len([w for w in caught if "got no gradient" in str(w.message)]) == 1


def test_every_skips_steps():
    model = TwoHeads()
    guard = GradSyncGuard(model, every=2, on_no_grad="ignore")
    checked = []
    for _ in range(4):
        _step(model)
        checked.append(guard.check().grads_checked)
    assert checked == [True, False, True, False]


@pytest.mark.parametrize(
    "kwargs", [{"every": 0}, {"params_every": -1}, {"no_grad_steps": 0}, {"on_no_grad": "log"}, {"rtol": -1.0}]
)
def test_bad_arguments(kwargs):
    with pytest.raises(distckpt.ConfigError):
        GradSyncGuard(nn.Linear(2, 2), **kwargs)


@pytest.mark.parametrize("n", [7, 4096, 3 * 4096 + 5])
def test_fingerprint_sees_permutations_and_norms(n):
    g = torch.randn(n)
    sumsq, proj = _fingerprint(g)
    wnorm = _wnorm(n)
    assert wnorm == pytest.approx(
        float(
            torch.stack(
                [
                    _weights(g.device, 0, 4096)[i % 4096]
                    * (_weights(g.device, 1, n // 4096 + 1)[i // 4096] if n > 4096 else 1.0)
                    for i in range(n)
                ]
            )
            .double()
            .norm()
        ),
        rel=1e-6,
    )
    assert float(sumsq) == pytest.approx(float(g.double().pow(2).sum()), rel=1e-5)
    swapped = g.clone()
    swapped[[0, n - 1]] = swapped[[n - 1, 0]]
    s2, p2 = _fingerprint(swapped)
    assert float(s2) == pytest.approx(float(sumsq), rel=1e-6) and abs(float(p2) - float(proj)) > 1e-6 * wnorm
    assert _fingerprint(g.bfloat16())[0].dtype == torch.float32


def test_weights_prefix_does_not_depend_on_first_length():
    a = _weights(torch.device("cpu"), 1, 10).clone()
    b = _weights(torch.device("cpu"), 1, 5 * 4096)
    assert torch.equal(a, b[: a.numel()])


def test_params_every_counts_checked_steps():
    model = TwoHeads()
    guard = GradSyncGuard(model, every=3, params_every=2, on_no_grad="ignore")
    flags = []
    for _ in range(12):
        _step(model)
        r = guard.check()
        flags.append((r.grads_checked, r.params_checked))
    assert [i for i, (g, _) in enumerate(flags) if g] == [0, 3, 6, 9]
    assert [i for i, (_, p) in enumerate(flags) if p] == [0, 6]
