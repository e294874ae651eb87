"""The "offload" mode per block (issue 10): a block that is not recomputed, whose saved tensors go to
host memory in its forward and come back in its backward. Exact (bitwise) against no checkpointing on
GPT and HF GPT-2, with autocast too; its hooks run on the CPU and skip parameters (and views of them);
the budget prices it in FLOPs per byte moved. On the CPU the host store of tests/offload_store.py
(numpy memory: invisible to MemTracker and the CPU allocator, as pinned memory is to a CUDA device's
tracker) lets the accounting be measured: mixed placements predicted within 3%, the program choosing
offload when bytes are cheap and recompute when they are dear."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn
from models import GPT, GPTConfig, batch

import distckpt
from distckpt import Budget, ConfigError
from distckpt.apply.wrap import checkpoint_mode, is_checkpointed
from distckpt.runtime import recompute
from distckpt.select.blocks import find_blocks
from distckpt.select.budget import offload_offered, plan_budget, predicted_peak
from distckpt.select.policies import Placement
from distckpt.select.profile import memory_tracker, profile_model, scalar_loss
from tests.offload_store import NumpyStore, use_numpy_store

CPU = torch.device("cpu")
CFG = GPTConfig(vocab=64, seq=16, dim=32, heads=2, layers=4, dropout=0.1)  # dropout: its mask is offloaded too
KW = dict(strategy="none", optimizer="none")


def _hf_gpt2() -> tuple[nn.Module, dict]:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=96, n_positions=32, n_embd=32, n_layer=4, n_head=2, resid_pdrop=0.1, attn_pdrop=0.1, embd_pdrop=0.1
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    model.train()
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}


def _grads_equal(ref: nn.Module, model: nn.Module, run) -> None:
    torch.manual_seed(1)
    ref_loss = run(ref)
    ref_loss.backward()
    torch.manual_seed(1)
    loss = run(model)
    loss.backward()
    assert torch.equal(loss, ref_loss)
    for (n, a), b in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad), n


@pytest.mark.parametrize("which", ["gpt", "hf-gpt2"])
def test_offload_is_exact_and_moves_no_parameter(which):
    if which == "gpt":
        torch.manual_seed(0)
        ref, inputs = GPT(CFG), batch(CFG, 2)
        run = lambda m: m(*inputs)  # noqa: E731
    else:
        ref, inputs = _hf_gpt2()
        run = lambda m: m(**inputs).loss  # noqa: E731
    modes = ("offload", "full", "offload", "none")
    model = distckpt.wrap(copy.deepcopy(ref), Placement(modes))
    blocks = [m for m in model.modules() if is_checkpointed(m)]
    assert [checkpoint_mode(b) for b in blocks] == ["offload", "full", "offload"]
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with use_numpy_store() as store:
        moved: list[torch.Tensor] = []
        real = store.to_host
        store.to_host = lambda t: moved.append(t) or real(t)
        _grads_equal(ref, model, run)
    assert store.packs == len(moved) > 0 and store.unpacks == store.packs  # every saved tensor came back
    assert not any(t.untyped_storage().data_ptr() in storages for t in moved)  # weights and their views stay


def test_offload_hooks_run_on_the_cpu_and_copy_nothing(monkeypatch):
    """With the library's own store on the CPU, the hooks run (counted) and keep every tensor where it is."""
    calls = []  # per pack: whether the store kept the tensor itself (no tensor kept here: it would hold memory)
    pinned = recompute.PinnedHostStore()
    real = pinned.to_host
    pinned.to_host = lambda t: calls.append(real(t) is t) or t
    monkeypatch.setattr(recompute, "host_store", lambda: pinned)
    torch.manual_seed(0)
    ref, inputs = GPT(CFG), batch(CFG, 2)
    model = distckpt.wrap(copy.deepcopy(ref), Placement(("offload",) * 4))
    _grads_equal(ref, model, lambda m: m(*inputs))
    assert len(calls) > 0 and all(calls)
    calls.clear()
    # MemTracker sees the same peak as without the mode: nothing was copied.
    peaks = []
    for m in (ref, model):
        m.zero_grad(set_to_none=True)
        mt = memory_tracker(m, *inputs)
        with mt:
            m(*inputs).backward()
        peaks.append(mt.get_tracker_snapshot("peak")[CPU]["Total"])
    assert peaks[0] == peaks[1]


def test_offload_under_autocast_is_exact():
    torch.manual_seed(0)
    ref, inputs = GPT(CFG), batch(CFG, 2)
    model = distckpt.wrap(copy.deepcopy(ref), Placement(("none", "offload", "offload", "full")))

    def run(m):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return m(*inputs)

    with use_numpy_store() as store:
        _grads_equal(ref, model, run)
    assert store.packs > 0


class _Gated(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        return x + self.fc2(torch.nn.functional.gelu(h) * torch.sigmoid(h))


class _Stack(nn.Module):
    # An input layer, so that the first block's input requires grad (the profile's tail window, what runs
    # after the last block input's gradient, then holds no block's backward).
    def __init__(self, d: int = 32, n: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList(_Gated(d) for _ in range(n))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x).square().mean()


def _peak(model: nn.Module, inputs) -> int:
    """MemTracker's peak of forward and backward (no optimizer), the parameters and batch included."""
    args, kwargs = (inputs, {}) if isinstance(inputs, tuple) else ((), inputs)
    mt = memory_tracker(model, *args, *kwargs.values())
    with mt:
        scalar_loss(model(*args, **kwargs)).backward()
    model.zero_grad(set_to_none=True)
    return mt.get_tracker_snapshot("peak")[CPU]["Total"]


def _profile(base: nn.Module, inputs) -> object:
    blocks = find_blocks(base)
    with use_numpy_store():
        mp = profile_model(base, blocks, inputs, modes=("full", "offload"))
    # MemTracker does not see the CPU RNG state each checkpointed block saves (the plan counts it).
    return dataclasses.replace(mp, rng_state_bytes=0)


@pytest.mark.parametrize("which", ["gpt", "stack", "saved-twice", "hf-gpt2"])
def test_mixed_placements_with_offload_predicted_within_three_percent(which):
    torch.manual_seed(0)
    if which == "gpt":
        base, inputs = GPT(CFG), batch(CFG, 4)
    elif which == "stack":
        base, inputs = _Stack(), (torch.randn(256, 32),)
    elif which == "saved-twice":  # one device tensor back for two saves, held from the first use to the last
        base, inputs = _TwiceStack(32, 4), (torch.randn(256, 32),)
    else:
        base, inputs = _hf_gpt2()
    mp = _profile(base, inputs)
    assert all(b.offload_held_bytes >= 0 and b.offload_bytes > 0 for b in mp.blocks)
    placements = [
        ("offload",) * 4,
        ("offload", "none", "full", "offload"),
        ("none", "offload", "offload", "full"),
        ("full", "offload", "none", "none"),
        ("none",) * 4,
        ("full",) * 4,
    ]
    with use_numpy_store():
        for modes in placements:
            model = distckpt.wrap(copy.deepcopy(base), Placement(modes))
            predicted, measured = predicted_peak(mp, modes, **KW), _peak(model, inputs)
            assert abs(predicted - measured) <= 0.03 * measured, (modes, predicted, measured)
    # Offloading every block holds less than keeping them (the activations left the device).
    assert predicted_peak(mp, ("offload",) * 4, **KW) < predicted_peak(mp, ("none",) * 4, **KW)


def test_steady_step_with_offload_predicted_within_three_percent():
    from peaks import steady_peak

    torch.manual_seed(0)
    base, inputs = GPT(CFG), batch(CFG, 4)
    mp = _profile(base, inputs)
    for modes in (("offload", "none", "full", "offload"), ("offload",) * 4):
        with use_numpy_store():
            measured = steady_peak(distckpt.wrap(copy.deepcopy(base), Placement(modes)), inputs)
        predicted = predicted_peak(mp, modes, strategy="none", optimizer="adamw")
        assert abs(predicted - measured) <= 0.03 * measured, (modes, predicted, measured)


def test_the_ratio_decides_between_offload_and_recompute():
    torch.manual_seed(0)
    base, inputs = _Stack(), (torch.randn(256, 32),)
    mp = _profile(base, inputs)
    n = len(mp.blocks)
    full_peak, none_peak = predicted_peak(mp, range(n), **KW), predicted_peak(mp, [], **KW)
    budget = (full_peak + none_peak) // 2
    recompute_only = plan_budget(mp, budget, selective=False, **KW)
    assert "offload" not in recompute_only.modes and recompute_only.moved_bytes == 0  # no ratio: not offered
    # A byte costs far less than a FLOP: the blocks the recompute plan checkpointed are offloaded instead.
    cheap = plan_budget(mp, budget, selective=False, offload_flops_per_byte=1e-3, **KW)
    assert cheap.recompute_flops == 0 and cheap.offloaded and cheap.peak_bytes <= budget, cheap
    assert cheap.moved_bytes == 2 * sum(mp.blocks[i].offload_bytes for i in cheap.offloaded)
    assert cheap.transfer_flops == sum(round(2 * mp.blocks[i].offload_bytes * 1e-3) for i in cheap.offloaded)
    # A byte costs more than the whole recompute of its block: the plan is the one without offload.
    dear = plan_budget(mp, budget, selective=False, offload_flops_per_byte=1e6, **KW)
    assert dear.modes == recompute_only.modes and dear.moved_bytes == 0 and dear.peak_bytes <= budget
    off = plan_budget(mp, budget, selective=False, offload_flops_per_byte=float("inf"), **KW)
    assert off.modes == recompute_only.modes and off.offload_flops_per_byte is None
    changed = [i for i in range(n) if cheap.modes[i] != dear.modes[i]]
    assert changed and all(cheap.modes[i] == "offload" and dear.modes[i] == "full" for i in changed), (cheap, dear)
    with pytest.raises(ConfigError, match="positive"):
        plan_budget(mp, budget, offload_flops_per_byte=0.0, **KW)
    with pytest.raises(ConfigError, match="positive"):
        Budget(budget, offload_flops_per_byte=-1.0)


def test_offload_offered_only_on_cuda_or_with_a_test_store_and_a_ratio(monkeypatch):
    assert offload_offered("cuda", "auto") and offload_offered("cuda", 10.0)
    assert not offload_offered("cuda", None)  # asked for only, until offload is measured on a GPU
    assert not offload_offered("cpu", None) and not offload_offered("cpu", 10.0)
    assert not offload_offered("cpu", "auto")  # host memory is the step's own
    monkeypatch.setattr(recompute, "host_store", lambda: NumpyStore())
    assert offload_offered("cpu", 10.0) and not offload_offered("cpu", None)
    # An infinite price turns it off everywhere (no offload sample step, no pinned host memory).
    assert not offload_offered("cuda", float("inf")) and not offload_offered("cpu", float("inf"))
    assert Budget(2**20, offload_flops_per_byte=float("inf")).offload_flops_per_byte == float("inf")
    with pytest.raises(ConfigError, match="positive"):
        Budget(2**20, offload_flops_per_byte=float("nan"))
    assert Budget(2**20, offload_flops_per_byte="auto").offload_flops_per_byte == "auto"
    with pytest.raises(ConfigError, match="'auto'"):
        Budget(2**20, offload_flops_per_byte="fast")


def test_budget_policy_plans_offload_on_the_cpu_with_the_test_store():
    torch.manual_seed(0)
    base, inputs = _Stack(), (torch.randn(256, 32),)
    mp = _profile(base, inputs)
    budget = (predicted_peak(mp, range(4), **KW) + predicted_peak(mp, [], **KW)) // 2
    with use_numpy_store():
        model = distckpt.wrap(
            copy.deepcopy(base),
            Budget(budget, offload_flops_per_byte=1e-3, selective=False, **KW),
            example_inputs=inputs,
        )
        modes = distckpt.checkpointed(model, modes=True)
        assert "offload" in modes.values(), modes
        assert _peak(model, inputs) <= budget
    # Without the test store the same budget is planned with recompute only (nothing to gain on the CPU).
    model = distckpt.wrap(
        copy.deepcopy(base), Budget(budget, offload_flops_per_byte=1e-3, selective=False, **KW), example_inputs=inputs
    )
    assert "offload" not in distckpt.checkpointed(model, modes=True).values()


def test_offload_placement_needs_a_measured_profile():
    torch.manual_seed(0)
    base, inputs = _Stack(), (torch.randn(256, 32),)
    mp = profile_model(base, find_blocks(base), inputs, modes=("full",))
    assert all(b.offload_held_bytes == -1 for b in mp.blocks)  # not measured unless asked
    with pytest.raises(ConfigError, match="no offload measurement"):
        predicted_peak(mp, ("offload",) * 4, **KW)


def test_near_optimal_against_measured_placements_with_offload():
    """Every placement of none, full and offload over 4 heterogeneous blocks (3**4 = 81), its peak measured
    by the CPU allocator (the numpy host memory outside it, the RNG state inside), and its cost measured:
    recompute FLOPs (FlopCounterMode, a pass of its own) plus the bytes the store moved, each way, at the
    ratio. At each budget the plan fits and costs within 5% of the best measured placement that fits."""
    import itertools

    from test_budget_measured import Chain, _flops, _is_block, _peak

    torch.manual_seed(0)
    base, x = Chain((16, 128, 32, 96, 24)), torch.randn(256, 8)
    # Per block, offload is the cheaper saving on two blocks, full on two: recompute FLOPs over bytes moved each
    # way are 23, 11, 19 and 9 (an MLP block moves its input and each activation once, the one fc2 reads too).
    n, ratio = len(base.blocks), 15.0
    modes_of = ("none", "full", "offload")

    def wrapped(modes: tuple[str, ...]) -> nn.Module:
        return distckpt.wrap(copy.deepcopy(base), Placement(modes), blocks=_is_block)

    def moved(model: nn.Module) -> int:
        with use_numpy_store() as store:
            model(x).backward()
        model.zero_grad(set_to_none=True)
        return store.bytes

    with use_numpy_store():
        peaks = {modes: _peak(wrapped(modes), x) for modes in itertools.product(modes_of, repeat=n)}
    no_recompute = _flops(base, x)
    alone = {}  # a block's cost depends on its own mode only: recompute stops inside it, its saved tensors are its own
    for i in range(n):
        alone[i, "full"] = _flops(wrapped(tuple("full" if j == i else "none" for j in range(n))), x) - no_recompute
        offloaded = wrapped(tuple("offload" if j == i else "none" for j in range(n)))
        alone[i, "offload"] = round(2 * moved(offloaded) * ratio)
    cost = {modes: sum(alone.get((i, m), 0) for i, m in enumerate(modes)) for modes in peaks}
    none_peak, full_peak = peaks[("none",) * n], peaks[("full",) * n]
    used = set()
    model = copy.deepcopy(base)
    for frac in (0.1, 0.3, 0.5, 0.7, 0.9):
        budget = int(full_peak + frac * (none_peak - full_peak))
        best = min(c for modes, c in cost.items() if peaks[modes] <= budget)
        with use_numpy_store():
            distckpt.wrap(
                model,
                Budget(budget, strategy="none", optimizer="none", selective=False, offload_flops_per_byte=ratio),
                blocks=_is_block,
                example_inputs=(x,),
            )
        chosen = tuple(checkpoint_mode(b) for b in model.blocks)
        used.update(chosen)
        assert peaks[chosen] <= budget, (frac, chosen, peaks[chosen], budget)
        assert cost[chosen] <= 1.05 * best, (frac, chosen, cost[chosen], best)
    assert {"full", "offload"} <= used, used  # both kinds of saving are used, not only offered


def test_transfer_probe_is_shaped_like_the_blocks_and_cuda_only():
    from distckpt.select.profile import transfer

    torch.manual_seed(0)
    cfg = GPTConfig(vocab=64, seq=64, dim=128, heads=2, layers=2)
    base, inputs = GPT(cfg), batch(cfg, 8)
    mp = _profile(base, inputs)
    (m, k, n), nbytes = transfer.probe_shapes(mp, torch.float32)
    assert (k, n) == (128, 512)  # a GPT block holds 12 * width**2 parameters (and biases): width 128
    # The block's tokens (8 x 64) from its forward FLOPs over its parameters, attention's FLOPs on top.
    assert 512 <= m <= 640
    assert nbytes == max(2**20, max(b.offload_bytes for b in mp.blocks))
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="offload_flops_per_byte"):
            transfer.flops_per_byte(mp, CPU)


def test_offloaded_blocks_are_not_reentrant_checkpoints():
    """With wrap(reentrant=True) an offloaded block still runs no checkpoint (parallelize's reentrant
    rules are about checkpoints), and the reentrant full blocks next to it stay exact."""
    torch.manual_seed(0)
    ref, inputs = GPT(CFG), batch(CFG, 2)
    model = distckpt.wrap(copy.deepcopy(ref), Placement(("offload", "full", "offload", "full")), reentrant=True)
    assert [b._distckpt_options.reentrant for b in model.h] == [False, True, False, True]
    with use_numpy_store() as store:
        _grads_equal(ref, model, lambda m: m(*inputs))
    assert store.packs > 0


@pytest.mark.slow
def test_offload_under_torch_compile_runs_eagerly_with_its_hooks():
    """Slow (dynamo + AOT autograd: ~1-2 min on a shared CPU); the default run keeps the eager exactness
    tests above. A compiled model's offloaded blocks run eagerly (a graph break), their hooks moving
    what they save; gradients equal no checkpointing's up to the compiled graph's float rounding."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=64, seq=16, dim=16, heads=2, layers=4)
    ref, inputs = GPT(cfg), batch(cfg, 2)
    model = distckpt.wrap(copy.deepcopy(ref), Placement(("offload", "full", "none", "offload")))
    compiled = torch.compile(model, backend="aot_eager")
    ref(*inputs).backward()
    with use_numpy_store() as store:
        compiled(*inputs).backward()
    assert store.packs > 0 and store.unpacks == store.packs
    for (n, a), b in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=n)


class _SavedTwice(nn.Module):
    """A block whose forward saves each of three tensors twice: ``h`` (by ``pow`` and the first ``mul``, an
    RMSNorm written out as Llama's is), ``r`` (``rsqrt``'s output and the first ``mul``'s other operand) and
    ``n`` (both operands of ``n * n``); ``x`` once (the linear layer's input), its weight's transpose not at all."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        n = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return x + n * n


class _TwiceStack(nn.Module):
    def __init__(self, d: int, n: int) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList(_SavedTwice(d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return x.square().mean()


def test_a_tensor_saved_twice_is_moved_once_each_way():
    torch.manual_seed(0)
    rows, d, n = 64, 32, 3
    ref, x = _TwiceStack(d, n), torch.randn(rows, d)
    model = distckpt.wrap(copy.deepcopy(ref), Placement(("offload",) * n))
    with use_numpy_store() as store:
        _grads_equal(ref, model, lambda m: m(x))
    # Per block: x, h and n (rows x d floats) and r (rows floats), each packed once and brought back once.
    per_block = 4 * (3 * rows * d + rows)
    assert store.packs == store.unpacks == 4 * n, (store.packs, store.unpacks)
    assert store.bytes == n * per_block, store.bytes
    # The profile counts what goes through the store: each byte once too, so the plan's moved bytes are the step's.
    mp = _profile(ref, (x,))
    assert [b.offload_bytes for b in mp.blocks] == [per_block] * n


def test_the_shared_copies_keep_no_device_tensor_and_a_retained_graph_backwards_twice():
    """The per-forward memo holds no device tensor (each one moved out is freed when the forward is over),
    the device tensor shared by two unpacks is let go once both have run, and a second backward of a
    retained graph brings the copies back again: gradients twice those of one backward, bitwise."""
    import weakref

    torch.manual_seed(0)
    rows, d, n = 64, 32, 2
    ref, x = _TwiceStack(d, n), torch.randn(rows, d)
    model = distckpt.wrap(copy.deepcopy(ref), Placement(("offload",) * n))
    out_refs, back_refs = [], []
    with use_numpy_store() as store:
        to_host, to_device = store.to_host, store.to_device
        store.to_host = lambda t: out_refs.append(weakref.ref(t)) or to_host(t)
        store.to_device = lambda p: (lambda t: back_refs.append(weakref.ref(t)) or t)(to_device(p))
        loss = model(x)
        assert len(out_refs) == 4 * n and all(r() is None for r in out_refs)
        loss.backward(retain_graph=True)
        assert len(back_refs) == 4 * n and all(r() is None for r in back_refs)
        loss.backward()
    assert store.packs == 4 * n and store.unpacks == 8 * n
    ref_loss = ref(x)
    ref_loss.backward(retain_graph=True)
    ref_loss.backward()
    for (name, a), b in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad), name
