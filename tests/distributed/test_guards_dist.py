"""GradSyncGuard on 2 gloo ranks: injected desyncs are caught and named (rank, parameter, size);
many normal DDP / FSDP / FSDP2 steps in fp32 and bf16 raise nothing, and training matches a
single-process model without checkpointing on the same global batch."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from harness import RankError

import distckpt
from distckpt import GradSyncGuard

pytestmark = pytest.mark.dist

D = 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, 2 * D)
        self.fc2 = nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _model(ckpt: bool = True) -> Net:
    torch.manual_seed(0)  # same init on every rank and in the reference
    model = Net()
    return distckpt.wrap(model, "full") if ckpt else model


def _batch(step: int, rank: int | None = None, world: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(8, D, generator=g), torch.randn(8, 1, generator=g)
    if rank is None:
        return x, y  # the global batch
    n = 8 // world
    return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


def _ddp_step(rank: int, model: nn.Module, step: int = 0) -> None:
    x, y = _batch(step, rank)
    nn.functional.mse_loss(model(x), y).backward()


def _parallel(model: nn.Module, strategy: str) -> nn.Module:
    # Built here with plain settings (not distckpt.parallelize) so the test pins what it checks.
    if strategy == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    if strategy == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        return FSDP(
            model, auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True, device_id=torch.device("cpu")
        )
    from torch.distributed.fsdp import fully_shard

    for b in model.blocks:
        fully_shard(b)
    fully_shard(model)
    return model


# --- injected faults -----------------------------------------------------------------------------


def _desync_message(guard: GradSyncGuard) -> str:
    """Run one check; the GradDesyncError message, or "no error"."""
    try:
        guard.check()
    except distckpt.GradDesyncError as e:
        return str(e)
    return "no error"


def _fault(rank: int, world: int, fault: str) -> str:
    model = _parallel(_model(), "ddp")
    guard = GradSyncGuard(model, params_every=1)
    _ddp_step(rank, model)
    guard.check()  # clean step: nothing raised
    model.zero_grad()
    _ddp_step(rank, model, 1)
    p = model.module.blocks[1].fc1.weight
    if rank == 1:
        with torch.no_grad():
            if fault == "scale":
                p.grad[0, 0] *= 1.01  # one element, 1%
            elif fault == "swap":  # a permutation: same sum and norm
                a, b = p.grad[0, 0].clone(), p.grad[3, 5].clone()
                p.grad[0, 0], p.grad[3, 5] = b, a
            elif fault == "none":
                p.grad = None
            elif fault == "param":
                model.module.head.bias += 1e-3
    return _desync_message(guard)


@pytest.mark.parametrize("fault", ["scale", "swap", "none"])
def test_grad_perturbed_on_one_rank_is_caught_and_named(dist_pool, fault):
    msgs = dist_pool.run(_fault, fault)
    for msg in msgs:  # every rank raises the same error: no rank is left in a collective
        assert "blocks.1.fc1.weight (gradient)" in msg or "blocks.1.fc1.weight: gradient present" in msg, msg
        assert "GradSyncGuard, step 1: 1 parameter(s)" in msg
    if fault == "none":
        assert "present on ranks [0] but None on ranks [1]" in msgs[0]
    else:
        assert "ranks [1] differ from rank 0 by about" in msgs[0]
    assert msgs[0] == msgs[1]


def test_param_desync_is_caught(dist_pool):
    msgs = dist_pool.run(_fault, "param")
    assert "head.bias (parameter): ranks [1] differ from rank 0" in msgs[0], msgs[0]
    assert "blocks" not in msgs[0].split("Likely cause")[0]  # only the perturbed parameter is named


# --- no false alarms, and training matches the single-process reference -------------------------


def _train(rank: int, world: int, strategy: str, precision: str, steps: int) -> tuple[list[float], list[float]]:
    model, ref = _model(), _model(ckpt=False)
    if precision == "bf16-params":  # gradients in bf16 as well, all-reduced in bf16
        model, ref = model.bfloat16(), ref.bfloat16()
    model = _parallel(model, strategy)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    guard = GradSyncGuard(model, params_every=5, on_no_grad="raise")
    norms, ref_norms = [], []
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)

    def forward(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = x.bfloat16() if precision == "bf16-params" else x
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            return nn.functional.mse_loss(m(x).float(), y)

    for step in range(steps):
        forward(model, *_batch(step, rank)).backward()
        report = guard.check()
        norms.append(report.grad_norm)
        opt.step()
        opt.zero_grad()
        forward(ref, *_batch(step)).backward()
        ref_norms.append(float(torch.stack([p.grad.double().norm() for p in ref.parameters()]).norm()))
        ref_opt.step()
        ref_opt.zero_grad()
    return norms, ref_norms


@pytest.mark.parametrize(
    "strategy,precision,steps",
    [
        ("ddp", "fp32", 40),
        ("ddp", "bf16", 40),
        ("ddp", "fp16", 20),
        ("ddp", "bf16-params", 20),
        ("fsdp", "fp32", 10),
        ("fsdp2", "fp32", 10),
        ("fsdp2", "bf16", 10),
    ],
)
def test_no_false_alarm_and_matches_reference(dist_pool, strategy, precision, steps):
    results = dist_pool.run(_train, strategy, precision, steps, timeout=120)
    (norms, ref_norms), (norms1, _) = results
    assert norms == norms1  # the global gradient norm is the same number on every rank
    tol = {"fp32": 1e-5, "bf16": 2e-2, "fp16": 5e-3, "bf16-params": 5e-2}[precision]
    assert norms == pytest.approx(ref_norms, rel=tol)  # and it is the reference's, step after step


def _sharded_missing(rank: int, world: int) -> str:
    model = _parallel(_model(), "fsdp2")
    guard = GradSyncGuard(model)
    _ddp_step(rank, model)
    if rank == 1:
        model.blocks[2].fc2.weight.grad = None  # this rank's shard lost its gradient
    return _desync_message(guard)


def test_fsdp2_missing_shard_gradient_is_caught(dist_pool):
    msgs = dist_pool.run(_sharded_missing)
    assert "blocks.2.fc2.weight: gradient present on ranks [0] but None on ranks [1]" in msgs[0], msgs[0]


def _one_collective(rank: int, world: int) -> int:
    model = _parallel(_model(), "ddp")
    guard = GradSyncGuard(model, params_every=1)
    _ddp_step(rank, model)
    calls = []
    name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    orig = getattr(dist, name)

    def counting(out, inp, *a, **k):
        calls.append(inp.numel())
        return orig(out, inp, *a, **k)

    setattr(dist, name, counting)
    try:
        guard.check()
    finally:
        setattr(dist, name, orig)
    n_params = len(list(model.parameters()))
    assert calls == [n_params * 7], calls  # one small tensor: 7 float64 per parameter
    return calls[0]


def test_one_small_collective(dist_pool):
    assert dist_pool.run(_one_collective) == [7 * 14, 7 * 14]


def _every(rank: int, world: int) -> list[bool]:
    model = _parallel(_model(), "ddp")
    guard = GradSyncGuard(model, every=3)
    out = []
    for step in range(6):
        _ddp_step(rank, model, step)
        if rank == 1 and step == 4:
            model.module.head.weight.grad.mul_(2)  # on a step that is not checked: not seen
        out.append(guard.check().grads_checked)
        model.zero_grad()
    return out


def test_every(dist_pool):
    assert dist_pool.run(_every) == [[True, False, False, True, False, False]] * 2


def test_rank_error_surface(dist_pool):
    # A desync raised on the ranks reaches the test as the library's error type.
    with pytest.raises(RankError) as e:
        dist_pool.run(_raise_desync)
    assert e.value.kinds() == {"GradDesyncError"}


def _raise_desync(rank: int, world: int) -> None:
    msg = _fault(rank, world, "scale")
    raise distckpt.GradDesyncError(msg)


# --- verify_recompute on parallel models ----------------------------------------------------------


def _verify_parallel(rank: int, world: int, strategy: str, preserve: bool) -> tuple[bool, str, float, float]:
    torch.manual_seed(0)
    model = Net()
    for b in model.blocks:
        b.fc1 = nn.Sequential(b.fc1, nn.Dropout(0.3))
    ref = Net()
    ref.load_state_dict({k.replace("fc1.0.", "fc1."): v for k, v in model.state_dict().items()})
    distckpt.wrap(model, "full", preserve_rng_state=preserve)
    pmodel = _parallel(model, strategy)
    x, y = _batch(0, rank)
    report = distckpt.verify_recompute(pmodel, lambda m: nn.functional.mse_loss(m(x), y), raise_on_mismatch=False)
    ref.eval()  # the reference without dropout and checkpointing: the loss of the eval forward
    pmodel.eval()
    with torch.no_grad():
        ref_loss = float(nn.functional.mse_loss(ref(x), y))
        loss = float(nn.functional.mse_loss(pmodel(x), y))
    first = report.mismatches[0] if report.mismatches else None
    return report.ok, f"{first.module} {first.kind}" if first else "", loss, ref_loss


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_verify_recompute_on_parallel_models(dist_pool, strategy):
    for ok, _, loss, ref_loss in dist_pool.run(_verify_parallel, strategy, True):
        assert ok and loss == pytest.approx(ref_loss, rel=1e-6)
    for ok, first, _, _ in dist_pool.run(_verify_parallel, strategy, False):
        assert not ok and first == "blocks.0.fc1.1 rng"


# --- real desyncs, not injected ------------------------------------------------------------------


def _real_desync(rank: int, world: int, case: str) -> tuple[str, bool]:
    model, ref = _model(), _model(ckpt=False)
    if case == "lora":
        # Every trainable parameter inside reentrant-checkpointed blocks, two forwards before one
        # backward: DDP's reducer misses the second forward's gradients (pytorch#121594).
        model = distckpt.wrap(_model(ckpt=False), "full", reentrant=True)
        for m in (model, ref):
            for n, p in m.named_parameters():
                p.requires_grad_(n.startswith("blocks.") and n.endswith("fc2.bias"))
    ddp = nn.parallel.DistributedDataParallel(model)
    guard = GradSyncGuard(ddp)
    try:
        if case == "no_sync":  # a micro-batch's context left on for the synchronizing step
            with ddp.no_sync():
                nn.functional.mse_loss(ddp(_batch(0, rank)[0]), _batch(0, rank)[1]).backward()
        else:
            sum(nn.functional.mse_loss(ddp(_batch(s, rank)[0]), _batch(s, rank)[1]) for s in (0, 1)).backward()
        msg = "no error"
        guard.check()
    except distckpt.GradDesyncError as e:
        msg = str(e)
    # The single-process reference on the global batches: what the gradients should have been.
    steps = (0,) if case == "no_sync" else (0, 1)
    sum(nn.functional.mse_loss(ref(_batch(s)[0]), _batch(s)[1]) for s in steps).backward()
    same = all(
        torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7)
        for p, q in zip(model.parameters(), ref.parameters())
        if q.grad is not None
    )
    return msg, same


@pytest.mark.parametrize("case", ["no_sync", "lora"])
def test_real_silent_desync_is_caught(dist_pool, case):
    (msg0, same0), (msg1, same1) = dist_pool.run(_real_desync, case)
    assert not (same0 and same1)  # the gradients really are wrong on some rank (vs the reference)
    assert msg0 == msg1 and "differ across ranks after synchronization" in msg0, msg0
    named = (
        "blocks.0.fc2.bias (gradient): ranks [1] differ from rank 0"
        if case == "lora"
        else "blocks.0.fc1.weight (gradient): ranks [1] differ from rank 0"
    )
    assert named in msg0


def _different_models(rank: int, world: int) -> str:
    model = _model(ckpt=False)
    if rank == 1:
        model.extra = nn.Linear(2, 2)  # this rank built another model
    guard = GradSyncGuard(model)
    return _desync_message(guard)


def test_different_parameter_lists_raise_instead_of_hanging(dist_pool):
    msgs = dist_pool.run(_different_models, timeout=30)
    assert all("different numbers of parameter tensors" in m and "same model on every rank" in m for m in msgs), msgs
