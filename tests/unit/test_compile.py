"""torch.compile with distckpt, one process: per-block compile (distckpt.apply.compile) and a whole compiled model give
the loss and gradients of the eager model and of the model without checkpointing, bitwise (backend aot_eager: dynamo
and AOT autograd run the same aten ops, no C++ build), for every policy, with dropout on; graph breaks are counted.

Every test resets dynamo (an autouse fixture) so that no compiled graph or cache entry leaks into the next."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import distckpt
from distckpt import ConfigError
from distckpt import _torch_compat as compat
from distckpt.apply.compile import compile_blocks, compile_options, compiled_blocks
from distckpt.apply.wrap import checkpoint_mode, is_checkpointed
from distckpt.select.policies import Placement

BACKEND = "aot_eager"


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch.compiler.reset()
    yield
    torch.compiler.reset()


class Block(nn.Module):
    """A pre-norm MLP block without Python side effects (a counter in forward would break dynamo's checkpoint
    graph: "HOP: Non-nullified side effect", and run the checkpoint eagerly)."""

    def __init__(self, d: int = 16, dropout: float = 0.2, bn: bool = False, as_dict: bool = False):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(dropout)
        self.bn = nn.BatchNorm1d(d) if bn else None
        self.as_dict = as_dict

    def forward(self, x):
        x = x["h"] if isinstance(x, dict) else x
        h = self.fc2(F.gelu(self.fc1(self.ln(x))))
        if self.bn is not None:
            h = self.bn(h)
        out = x + self.drop(h)
        return {"h": out} if self.as_dict else out


class Net(nn.Module):
    def __init__(self, n: int = 4, d: int = 16, **block):
        super().__init__()
        self.embed = nn.Linear(4, d)
        self.layers = nn.ModuleList([Block(d, **block) for _ in range(n)])
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h["h"] if isinstance(h, dict) else h)


def _step(model, x, seed=1):
    torch.manual_seed(seed)  # the same dropout masks in every model
    model.zero_grad(set_to_none=True)
    loss = model(x).pow(2).mean()
    loss.backward()
    return loss.detach()


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_bitwise(ref, got, what):
    (lr, gr), (lg, gg) = ref, got
    assert torch.equal(lr, lg), what
    assert gr.keys() == gg.keys(), what
    for k in gr:
        assert torch.equal(gr[k], gg[k]), f"{what}: {k}"


def _compare(policy, *, how, steps=2, wrap_kw=None, rows=6, **block):
    """Train the model without checkpointing, the wrapped model eagerly, and the wrapped model compiled (``how``:
    "blocks" = compile_blocks, "model" = torch.compile of the whole model) on the same batches; assert the three
    agree bitwise at each step (buffers too) and return dynamo's counts, the warnings of the compiled run and the
    wrapped model."""
    plain = Net(**block)
    eager = distckpt.wrap(copy.deepcopy(plain), policy, **(wrap_kw or {}))
    wrapped = distckpt.wrap(copy.deepcopy(plain), policy, **(wrap_kw or {}))
    compiled = compile_blocks(wrapped, backend=BACKEND) if how == "blocks" else torch.compile(wrapped, backend=BACKEND)
    with compat.compile_counts() as counts, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s in range(steps):
            x = torch.randn(rows, 4, generator=torch.Generator().manual_seed(s))
            ref = (_step(plain, x), _grads(plain))
            _assert_bitwise(ref, (_step(eager, x), _grads(eager)), f"eager {policy} step {s}")
            _assert_bitwise(ref, (_step(compiled, x), _grads(wrapped)), f"compiled {policy} step {s}")
    for (n, a), b in zip(plain.named_buffers(), wrapped.buffers()):
        assert torch.equal(a, b), n  # BatchNorm statistics: updated once per forward, never by a recompute
    return counts, [str(w.message) for w in caught if "distckpt" in str(w.message)], wrapped


_BIG = 256  # rows per batch for the budget: activations then outweigh parameters, so the plan mixes every mode


@pytest.mark.parametrize(
    "policy",
    [
        "full",
        "selective",
        # Slow: the budget's plan mixes these modes already (full, selective, pointwise and a block left out).
        pytest.param(Placement(("pointwise",) * 4), id="pointwise", marks=pytest.mark.slow),
        pytest.param("every:2", marks=pytest.mark.slow),
        # Slow: choosing per block, the plan mixes full, selective, pointwise and a block left out.
        pytest.param(distckpt.Budget(600_000, per_op=False), id="budget-per-block", marks=pytest.mark.slow),
        # With the per-op choice (issue 35) the same size keeps named op outputs ("ops") in some blocks.
        pytest.param(distckpt.Budget(600_000), id="budget"),
    ],
    ids=str,
)
def test_compile_blocks_exact_without_graph_breaks(policy):
    """The budget has no example_inputs: it plans at the first forward, and the blocks are compiled after the plan,
    each in its planned mode."""
    budget = isinstance(policy, distckpt.Budget)
    counts, warned, model = _compare(policy, how="blocks", rows=_BIG if budget else 6)
    assert counts["breaks"] == {} and not warned
    # One graph per kind of block (checkpointed in one mode, or not checkpointed), shared by the blocks of a kind.
    kinds = {checkpoint_mode(m) for m in model.layers}
    assert counts["graphs"] == len(kinds), (counts, kinds)
    if budget and policy.per_op:
        assert "ops" in kinds, kinds
    elif budget:
        assert kinds == {"full", "selective", "pointwise", "none"}, kinds


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_whole_model_compile_exact_without_graph_breaks(policy):
    # selective: its per-block reach (a Python object) used to break the graph and run the checkpoint eagerly.
    counts, warned, _ = _compare(policy, how="model")
    assert counts["breaks"] == {} and counts["graphs"] >= 1 and not warned


def test_compiled_graphs_save_what_each_mode_keeps():
    """The compiled modes differ where they should: the compiled forward saves for backward the block's inputs under
    full, also the kept matmul outputs under selective, every activation without checkpointing (counted as elements
    passing the saved-tensor hooks, which see the compiled graph's saves)."""

    def saved(policy):
        torch.compiler.reset()
        model = compile_blocks(distckpt.wrap(Net(n=1, dropout=0.0), policy, blocks="layers.*"), backend=BACKEND)
        h = model.embed(torch.randn(6, 4))
        n = [0]

        def pack(t):
            n[0] += t.numel()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.layers[0](h)
        return n[0]

    full, selective, none = saved("full"), saved("selective"), saved("none")
    assert full < selective < none, (full, selective, none)


@pytest.mark.parametrize(
    ("case", "block", "wrap_kw"),
    [
        ("batchnorm", {"bn": True}, {}),
        ("reentrant", {}, {"reentrant": True}),
        ("offload_cpu", {}, {"offload": "cpu"}),
        ("offload_mode", {}, None),
    ],
)
@pytest.mark.parametrize("how", ["blocks", "model"])
def test_untraceable_checkpointing(case, block, wrap_kw, how):
    """Checkpointing dynamo cannot trace faithfully (recompute.eager_reason). Per block: the forward is compiled
    inside an eager checkpoint, exact, no graph break, no warning. Whole model: the checkpoint runs eagerly, a graph
    break at each such block (all of them the deliberate one), and one warning naming the reason and the fix."""
    policy = Placement(("offload", "full", "none", "offload")) if wrap_kw is None else "full"
    counts, warned, _ = _compare(policy, how=how, wrap_kw=wrap_kw, **block)
    if how == "blocks":
        assert counts["breaks"] == {} and counts["graphs"] >= 1 and not warned
        return
    assert counts["breaks"] and all("compiler.disable" in r for r in counts["breaks"]), counts["breaks"]
    assert len(warned) == 1 and "compile_blocks" in warned[0], warned
    assert {"batchnorm": "BatchNorm", "reentrant": "reentrant", "offload_cpu": "offload", "offload_mode": "offload"}[
        case
    ] in warned[0]


def test_reentrant_stays_reentrant_when_compiled_per_block():
    # Dynamo would trace a reentrant checkpoint as a non-reentrant one; per block, the checkpoint stays reentrant
    # (its nested backward) and only the forward inside it is compiled.
    model = compile_blocks(distckpt.wrap(Net(), "full", reentrant=True), backend=BACKEND)
    out = model.layers[0](model.embed(torch.randn(6, 4)))
    node = out.grad_fn  # under wrap's guard against passes reentrant blocks cannot run (autograd.grad)
    assert type(node).__name__ == "_ReentrantGuardBackward"
    assert type(node.next_functions[0][0]).__name__ == "CheckpointFunctionBackward"


def test_block_returning_a_dict():
    counts, _, _ = _compare("full", how="blocks", as_dict=True)
    assert counts["breaks"] == {}


class _DataDependent(nn.Module):
    def __init__(self, d: int = 16):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        h = self.fc(x)
        if h.sum().item() > 0:  # control flow on a value: no single graph
            h = h * 2
        return x + torch.tanh(h)


class _DataNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_DataDependent() for _ in range(2)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_fullgraph_refuses_a_block_it_cannot_trace_and_names_the_fix():
    model = compile_blocks(distckpt.wrap(_DataNet(), "full"), backend=BACKEND)
    with pytest.raises(ConfigError, match=r"_DataDependent in one graph.*'fullgraph': False"):
        model(torch.randn(3, 16)).sum().backward()
    # fullgraph=False: dynamo runs the untraceable part between graphs (counted), and the gradients stay exact.
    torch.compiler.reset()
    ref, x = _DataNet(), torch.randn(3, 16)
    model = compile_blocks(distckpt.wrap(copy.deepcopy(ref), "full"), backend=BACKEND, fullgraph=False)
    with compat.compile_counts() as counts:
        _assert_bitwise((_step(ref, x), _grads(ref)), (_step(model, x), _grads(model)), "fullgraph=False")
    assert counts["breaks"]


class _Counting(Block):
    def __init__(self, d: int = 16):
        super().__init__(d)
        self.calls = 0

    def forward(self, x):
        self.calls += 1  # a Python side effect inside the checkpointed function (forward executions)
        return super().forward(x)


def test_a_block_with_a_python_side_effect():
    """Dynamo cannot keep a side effect inside the checkpoint's graph by default. A whole compiled model then breaks
    the graph there and runs that checkpoint eagerly, which distckpt cannot see (torch's choice: counted here). Per
    block, distckpt traces the checkpoint with the forward and lets the side effect run once per forward, as without
    checkpointing (transformers >= 5.25 sets a context variable in every attention forward): one graph, exact
    gradients, and the counter counts forwards (the eager checkpoint's recompute counts each one twice)."""
    plain = Net()
    plain.layers = nn.ModuleList([_Counting(16) for _ in range(4)])
    model = distckpt.wrap(copy.deepcopy(plain), "full")
    with compat.compile_counts() as counts:
        torch.compile(model, backend=BACKEND)(torch.randn(6, 4)).sum().backward()
    assert any("side effect" in r for r in counts["breaks"]), counts
    eager = distckpt.wrap(copy.deepcopy(plain), "full")
    model = compile_blocks(distckpt.wrap(copy.deepcopy(plain), "full"), backend=BACKEND)
    x = torch.randn(6, 4)
    with compat.compile_counts() as counts:
        _assert_bitwise((_step(plain, x), _grads(plain)), (_step(model, x), _grads(model)), "side effect")
    assert counts["breaks"] == {} and counts["graphs"] == 1, counts
    _step(eager, x)
    assert [b.calls for b in plain.layers] == [b.calls for b in model.layers] == [1] * 4
    assert [b.calls for b in eager.layers] == [2] * 4


def test_names_state_dict_copies_and_eval():
    model = distckpt.wrap(Net(), "every:2")
    names = [n for n, _ in model.named_parameters()]
    keys = list(model.state_dict())
    compile_blocks(model, backend=BACKEND)
    assert compiled_blocks(model) == [f"layers.{i}" for i in range(4)]  # checkpointed or not
    assert [n for n, _ in model.named_parameters()] == names and list(model.state_dict()) == keys
    x = torch.randn(6, 4)
    with torch.no_grad():  # forwards without grad run the compiled forward (no checkpoint)
        expected = model.eval()(x)
    for other in (copy.deepcopy(model), _reload(model)):
        assert compiled_blocks(other) == compiled_blocks(model)
        assert distckpt.checkpointed(other) == ["layers.0", "layers.2"]
        with torch.no_grad():
            assert torch.equal(other(x), expected)
        _step(other.train(), x)  # the copy's blocks compute with the copy's own parameters
        assert all(p.grad is None for p in model.parameters())
        assert all(p.grad is not None for p in other.parameters())


def _reload(model):
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def test_wrap_again_compiles_the_new_modes():
    plain = Net()
    model = compile_blocks(distckpt.wrap(copy.deepcopy(plain), "full"), backend=BACKEND)
    distckpt.wrap(model, "every:2")  # compiled again, in the new modes
    assert distckpt.checkpointed(model) == ["layers.0", "layers.2"] and len(compiled_blocks(model)) == 4
    x = torch.randn(6, 4)
    _assert_bitwise((_step(plain, x), _grads(plain)), (_step(model, x), _grads(model)), "rewrapped")
    # A budget waiting for its first forward: nothing is compiled until its plan has chosen the blocks' modes.
    distckpt.wrap(model, "budget:460000")
    assert compiled_blocks(model) == []


def test_verify_recompute_checks_the_checkpointing_of_compiled_blocks():
    # Its op recording cannot be traced: it runs the blocks uncompiled, then they are compiled again.
    model = compile_blocks(distckpt.wrap(Net(), "every:2"), backend=BACKEND)
    x = torch.randn(6, 4)
    report = distckpt.verify_recompute(model, lambda m: m(x).pow(2).mean())
    assert report.ok and report.blocks == ["layers.0", "layers.2"], report
    assert len(compiled_blocks(model)) == 4


def test_refusals():
    with pytest.raises(ConfigError, match="found no blocks to compile"):
        compile_blocks(nn.Sequential(nn.Linear(2, 2)), backend=BACKEND)
    model = distckpt.wrap(Net(), "every:2")
    model.layers[1].forward = lambda x: x  # a patched forward (accelerate hooks) would be bypassed
    with pytest.raises(ConfigError, match="layers.1 has a forward set on the instance"):
        compile_blocks(model, backend=BACKEND)
    with pytest.raises(ConfigError, match="unknown keys"):
        compile_options({"backend": BACKEND, "model": None})
    with pytest.raises(ConfigError, match="compile= takes True, False, or a dict"):
        compile_options("inductor")
    with pytest.raises(ConfigError, match="hashable values"):
        compile_options({"options": {"a": [1]}})
    with pytest.raises(ConfigError, match="not valid for torch.compile: Invalid backend: 'nope'"):
        compile_blocks(distckpt.wrap(Net(), "full"), backend="nope")
    with pytest.raises(ConfigError, match="Either mode or options"):
        compile_blocks(distckpt.wrap(Net(), "full"), mode="max-autotune", options={"a": 1})
    assert compile_options(None) is None and compile_options(False) is None
    assert compile_options(True).fullgraph is True


@pytest.mark.filterwarnings("ignore:distckpt.*KV cache")
@pytest.mark.parametrize(
    ("family", "use_cache"), [pytest.param("gpt2", True, marks=pytest.mark.slow), ("llama", False)]
)  # slow: GPT-2 (a second model's compile, 17 s on a loaded CPU); the cache-on path is eager code either way
def test_hf_decoder_layers(family, use_cache):
    """HF decoder layers built from their configs, padded batch, dropout on, fullgraph=True: exact and no graph
    break. GPT-2 with the cache on (the default): the checkpointed layers drop it eagerly (its warning stays outside
    the compiled code); Llama with it off."""
    from zoo import FAMILIES

    fam = FAMILIES[family]
    plain = fam.build()
    plain.config.use_cache = use_cache
    model = compile_blocks(distckpt.wrap(copy.deepcopy(plain), "full"), backend=BACKEND)
    assert all(is_checkpointed(m) for n, m in model.named_modules() if n in compiled_blocks(model))
    with compat.compile_counts() as counts:
        for s in range(2):
            batch = fam.batch(s)
            got = []
            for m in (plain, model):
                torch.manual_seed(3)
                m.zero_grad(set_to_none=True)
                loss = fam.loss(m, batch)
                loss.backward()
                got.append((loss.detach(), _grads(m)))
            _assert_bitwise(*got, f"{family} step {s}")
    assert counts["breaks"] == {} and counts["graphs"] == 1


@pytest.mark.slow
def test_inductor_per_block():
    """Slow (inductor builds C++ kernels: 80 s on a loaded 2-core CPU); the default run keeps aot_eager. Inductor
    fuses kernels, so the gradients match eager to float rounding (1e-7 measured), not bitwise; no dropout, whose
    masks inductor draws with its own generator."""
    plain = Net(dropout=0.0)
    model = compile_blocks(distckpt.wrap(copy.deepcopy(plain), "full"))  # backend="inductor", the default
    with compat.compile_counts() as counts:
        for _ in range(2):
            x = torch.randn(6, 4)
            (lr, gr), (lm, gm) = (_step(plain, x), _grads(plain)), (_step(model, x), _grads(model))
            torch.testing.assert_close(lm, lr, rtol=1e-5, atol=1e-6)
            for k in gr:
                torch.testing.assert_close(gm[k], gr[k], rtol=1e-5, atol=1e-6, msg=k)
    assert counts["breaks"] == {} and counts["graphs"] == 1
