"""distckpt.apply.wrap: block choice, names, double wrapping, and exact gradients against no checkpointing."""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import hf_checkpointing_enable

import distckpt
from distckpt import ConfigError
from distckpt.apply.wrap import is_checkpointed
from distckpt.select.profile import flop_counter


class Block(nn.Module):
    def __init__(self, d: int = 16, dropout: float = 0.0, bn: bool = False):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(dropout)
        self.bn = nn.BatchNorm1d(d) if bn else None
        self.calls = 0  # forward executions, recomputes included

    def forward(self, x):
        self.calls += 1
        h = self.fc2(F.gelu(self.fc1(self.ln(x))))
        if self.bn is not None:
            h = self.bn(h)
        return x + self.drop(h)


class Net(nn.Module):
    def __init__(self, n: int = 8, d: int = 16, dropout: float = 0.0, bn: bool = False):
        super().__init__()
        self.embed = nn.Linear(4, d)
        self.layers = nn.ModuleList([Block(d, dropout, bn) for _ in range(n)])
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def step(model, x, seed=1):
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    out = model(x)
    loss = out.float().pow(2).mean()
    loss.backward()
    return loss.detach(), grads(model)


def assert_same(ref, got, exact=True):
    (lr, gr), (lo, go) = ref, got
    assert gr.keys() == go.keys()
    if exact:
        assert torch.equal(lr, lo)
        for k in gr:
            assert torch.equal(gr[k], go[k]), k
    else:
        torch.testing.assert_close(lo, lr)
        for k in gr:
            torch.testing.assert_close(go[k], gr[k], msg=k)


# --- policies ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec,expected",
    [
        ("full", list(range(8))),
        ("every:2", [0, 2, 4, 6]),
        ("every:3", [0, 3, 6]),
        ("first:3", [0, 1, 2]),
        ("first:20", list(range(8))),
        ("fraction:0.5", [1, 3, 5, 7]),
        ("fraction:0", []),
        ("fraction:1", list(range(8))),
        ("none", []),
    ],
)
def test_policy_selection(spec, expected):
    model = Net()
    distckpt.wrap(model, spec)
    assert distckpt.checkpointed(model) == [f"layers.{i}" for i in expected]


@pytest.mark.parametrize(
    "spec",
    [
        "every:0",
        "every:x",
        "first:-1",
        "fraction:1.5",
        "fraction:nan",
        "budget:lots",
        "budget:0",
        "bogus",
        "full:2",
        "every",
        3.5,
    ],
)
def test_bad_policy_names_valid_forms(spec):
    with pytest.raises(ConfigError, match="every:N"):
        distckpt.wrap(Net(), spec)


def test_policy_objects_and_sizes():
    assert distckpt.parse_policy("every:2") == distckpt.EveryN(2)
    assert distckpt.parse_policy("none") is None
    assert distckpt.parse_policy("budget:2GiB") == distckpt.Budget(2 * 2**30)
    assert distckpt.parse_policy("budget:512MB") == distckpt.Budget(512 * 10**6)
    assert distckpt.parse_policy("budget:auto") == distckpt.Budget(None)
    model = Net()
    distckpt.wrap(model, distckpt.FirstN(2))
    assert distckpt.checkpointed(model) == ["layers.0", "layers.1"]


# --- blocks --------------------------------------------------------------------------------------


def test_blocks_by_class_predicate_and_glob():
    for spec in (Block, [Block], lambda m: isinstance(m, Block), "layers.*", ["layers.*"]):
        model = Net()
        distckpt.wrap(model, blocks=spec)
        assert distckpt.checkpointed(model) == [f"layers.{i}" for i in range(8)], spec
    model = Net()
    distckpt.wrap(model, blocks=["layers.1", "head"])
    assert distckpt.checkpointed(model) == ["layers.1", "head"]
    model = Net()
    distckpt.wrap(model, blocks="layers.*")  # outermost matches only: never layers.0.fc1 inside layers.0
    assert not any(is_checkpointed(m) for m in model.layers[0].children())


def test_blocks_errors():
    with pytest.raises(ConfigError, match="matches no module.*try blocks=Block"):
        distckpt.wrap(Net(), blocks="decoder.*")
    with pytest.raises(ConfigError, match="not an nn.Module"):
        distckpt.wrap(Net(), blocks=int)
    with pytest.raises(ConfigError, match="no repeated blocks"):
        distckpt.wrap(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))


def test_auto_blocks_ambiguous():
    class EncDec(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = nn.ModuleList([Block() for _ in range(3)])
            self.dec = nn.ModuleList([nn.TransformerDecoderLayer(16, 2, 32) for _ in range(3)])

    with pytest.raises(ConfigError, match=r"cannot tell.*Pass blocks=\[") as e:
        distckpt.wrap(EncDec())
    assert "TransformerDecoderLayer" in str(e.value) and "Block (3 blocks" in str(e.value)


def test_auto_blocks_prefers_finer_nested_blocks_and_resnet_stages():
    class Stage(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Block() for _ in range(3)])
            self.down = nn.Linear(16, 16, bias=False)

    class Bottleneck(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.conv = nn.Conv2d(c, c, 3, padding=1)
            self.bn = nn.BatchNorm2d(c)

        def forward(self, x):
            return x + self.bn(self.conv(x))

    class ResNetLike(nn.Module):  # torchvision's layout: layerN = Sequential of same-class blocks
        def __init__(self):
            super().__init__()
            self.stem = nn.Conv2d(3, 8, 3)
            self.layer1 = nn.Sequential(Bottleneck(8), Bottleneck(8))
            self.layer2 = nn.Sequential(Bottleneck(8), Bottleneck(8), Bottleneck(8))
            self.fc = nn.Linear(8, 10)

    model = nn.Sequential(*[Stage() for _ in range(2)])
    distckpt.wrap(model)
    assert distckpt.checkpointed(model) == [f"{s}.blocks.{i}" for s in range(2) for i in range(3)]
    model = ResNetLike()
    distckpt.wrap(model)
    assert distckpt.checkpointed(model) == ["layer1.0", "layer1.1", "layer2.0", "layer2.1", "layer2.2"]


def test_auto_blocks_in_a_module_dict_keyed_by_layer_numbers():
    class Titan(nn.Module):  # torchtitan keeps layers in a ModuleDict "0", "1", ... (FQNs survive a pipeline split)
        def __init__(self, keys=range(4)):
            super().__init__()
            self.embed = nn.Linear(4, 16)
            self.layers = nn.ModuleDict({str(i): Block() for i in keys})
            # Task heads keyed by name, larger than the layers together: never taken for blocks.
            self.heads = nn.ModuleDict({t: nn.Linear(16, 2000) for t in ("lm", "cls")})

        def forward(self, x):
            h = self.embed(x)
            for layer in self.layers.values():
                h = layer(h)
            return sum(head(h).sum() for head in self.heads.values())

    model = Titan()
    assert sum(p.numel() for p in model.heads.parameters()) > sum(p.numel() for p in model.layers.parameters())
    ref = copy.deepcopy(model)
    distckpt.wrap(model, "full")
    assert distckpt.checkpointed(model) == [f"layers.{i}" for i in range(4)]
    x = torch.randn(3, 4)
    model(x).backward()
    ref(x).backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=n)
    stage = Titan(keys=range(2, 4))  # a pipeline stage keeps the layers it runs under their numbers
    distckpt.wrap(stage, "full")
    assert distckpt.checkpointed(stage) == ["layers.2", "layers.3"]


def test_auto_blocks_hf_gpt2_and_llama():
    transformers = pytest.importorskip("transformers")
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    )
    distckpt.wrap(gpt2)
    assert distckpt.checkpointed(gpt2) == ["transformer.h.0", "transformer.h.1", "transformer.h.2"]
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            num_hidden_layers=2,
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=2,
            num_key_value_heads=2,
            vocab_size=64,
            max_position_embeddings=16,
        )
    )
    distckpt.wrap(llama, "every:2")
    assert distckpt.checkpointed(llama) == ["model.layers.0"]


# --- names ---------------------------------------------------------------------------------------


def test_names_and_state_dict_unchanged():
    plain = Net(bn=True)
    wrapped = copy.deepcopy(plain)
    distckpt.wrap(wrapped, "full")
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in wrapped.named_parameters()]
    assert [n for n, _ in plain.named_buffers()] == [n for n, _ in wrapped.named_buffers()]
    assert list(plain.state_dict()) == list(wrapped.state_dict())
    other = Net(bn=True)
    other.load_state_dict(wrapped.state_dict())  # loads both ways, strict
    wrapped.load_state_dict(plain.state_dict())
    isinstance(wrapped.layers[0], Block)  # still an instance of the user's class
    assert isinstance(wrapped.layers[0], Block)
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    assert list(get_model_state_dict(wrapped)) == list(get_model_state_dict(plain))


# --- double wrapping ------------------------------------------------------------------------------


def _calls_in_step(model, x):
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    for b in blocks:
        b.calls = 0
    model(x).sum().backward()
    return [b.calls for b in blocks]


def test_wrap_twice_replaces_never_recomputes_twice():
    model = Net(n=4)
    x = torch.randn(5, 4)
    distckpt.wrap(model, "full")
    distckpt.wrap(model, "full")
    assert _calls_in_step(model, x) == [2, 2, 2, 2]  # one forward + one recompute
    distckpt.wrap(model, "every:2")
    assert distckpt.checkpointed(model) == ["layers.0", "layers.2"]
    assert _calls_in_step(model, x) == [2, 1, 2, 1]
    distckpt.wrap(model, "none")
    assert distckpt.checkpointed(model) == [] and type(model.layers[0]) is Block


def test_wrap_refuses_nested_and_torch_checkpoint_wrapper():
    model = Net(n=2)
    distckpt.wrap(model, blocks="layers.0")
    with pytest.raises(ConfigError, match="nested"):
        distckpt.wrap(model, blocks="layers.0.fc1")
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    model = Net(n=2)
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    with pytest.raises(ConfigError, match="checkpoint_wrapper.*Remove apply_activation_checkpointing"):
        distckpt.wrap(model)


def test_wrap_replaces_hf_gradient_checkpointing():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    model = transformers.GPT2LMHeadModel(cfg)
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    model.train()
    counts = {}
    for i, blk in enumerate(model.transformer.h):
        blk.attn.register_forward_hook(lambda *a, i=i: counts.__setitem__(i, counts.get(i, 0) + 1))
    with pytest.warns(UserWarning, match="Hugging Face gradient checkpointing"):
        distckpt.wrap(model)
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    ids = torch.randint(0, 64, (2, 8))
    model(ids, labels=ids).loss.backward()
    assert counts == {0: 2, 1: 2}  # forward + one recompute, not two


def test_wrap_refuses_parallel_models(dist_pool):
    dist_pool.run(_wrap_after_ddp)


def _wrap_after_ddp(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(Net(n=2))
    with pytest.raises(ConfigError, match="before distckpt.parallelize"):
        distckpt.wrap(ddp)


# --- exactness ------------------------------------------------------------------------------------


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("policy", ["full", "every:3"])
def test_dropout_exact(policy, reentrant):
    plain = Net(dropout=0.3)
    wrapped = copy.deepcopy(plain)
    distckpt.wrap(wrapped, policy, reentrant=reentrant)
    x = torch.randn(6, 4)
    assert_same(step(plain, x), step(wrapped, x))


def test_dropout_without_preserved_rng_is_not_exact():
    """The check above can fail: without the RNG state the recompute draws another mask."""
    plain = Net(dropout=0.3)
    wrapped = copy.deepcopy(plain)
    distckpt.wrap(wrapped, "full", preserve_rng_state=False)
    x = torch.randn(6, 4)
    (_, g0), (_, g1) = step(plain, x), step(wrapped, x)
    assert any(not torch.equal(g0[k], g1[k]) for k in g0)


@pytest.mark.parametrize("reentrant", [False, True])
def test_batchnorm_running_stats_updated_once(reentrant):
    plain = Net(n=3, bn=True)
    wrapped = copy.deepcopy(plain)
    distckpt.wrap(wrapped, "full", reentrant=reentrant)
    x = torch.randn(6, 4)
    for _ in range(3):
        assert_same(step(plain, x), step(wrapped, x))
    for (n, a), (_, b) in zip(plain.named_buffers(), wrapped.named_buffers()):
        assert torch.equal(a, b), n
    assert int(wrapped.layers[0].bn.num_batches_tracked) == 3


def test_batchnorm_two_forwards_one_backward():
    plain = Net(n=2, bn=True)
    wrapped = copy.deepcopy(plain)
    distckpt.wrap(wrapped, "full")
    x1, x2 = torch.randn(6, 4), torch.randn(6, 4)
    for m in (plain, wrapped):
        (m(x1).sum() + m(x2).pow(2).sum()).backward()
    for (n, a), (_, b) in zip(plain.named_buffers(), wrapped.named_buffers()):
        assert torch.equal(a, b), n
    for (n, a), (_, b) in zip(plain.named_parameters(), wrapped.named_parameters()):
        assert torch.equal(a.grad, b.grad), n


@pytest.mark.parametrize("reentrant", [False, True])
def test_autocast_bf16_cpu_exact(reentrant):
    plain = Net(dropout=0.1)
    wrapped = copy.deepcopy(plain)
    distckpt.wrap(wrapped, "full", reentrant=reentrant)
    x = torch.randn(6, 4)
    results = []
    for m in (plain, wrapped):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            results.append(step(m, x))
    assert_same(*results)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert wrapped(x).dtype == torch.bfloat16


def test_no_grad_and_eval_run_plainly():
    plain = Net(dropout=0.3, bn=True)
    wrapped = copy.deepcopy(plain)
    distckpt.wrap(wrapped, "full")
    x = torch.randn(6, 4)
    for m in (plain, wrapped):
        m.eval()
    with torch.no_grad():
        assert torch.equal(plain(x), wrapped(x))
    with torch.inference_mode():
        assert torch.equal(plain(x), wrapped(x))
    assert_same(step(plain, x), step(wrapped, x))  # eval with grad: still exact
    assert all(b.calls == 0 or b.calls % 1 == 0 for b in wrapped.layers)


class KwBlock(nn.Module):
    """Takes tensors by keyword, returns a dict and a dataclass."""

    @dataclasses.dataclass
    class Out:
        hidden: torch.Tensor
        aux: torch.Tensor

    def __init__(self, d=8):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x, *, mask=None, scale=1.0, as_dict=True):
        h = torch.tanh(self.fc(x)) * scale
        if mask is not None:
            h = h * mask
        if as_dict:
            return {"hidden": x + h, "aux": h.sum(-1)}
        return KwBlock.Out(x + h, h.sum(-1))


class KwNet(nn.Module):
    def __init__(self, as_dict=True):
        super().__init__()
        self.layers = nn.ModuleList([KwBlock() for _ in range(3)])
        self.as_dict = as_dict

    def forward(self, x, mask):
        aux = 0
        for layer in self.layers:
            out = layer(x, mask=mask, scale=0.5, as_dict=self.as_dict)
            x, a = (out["hidden"], out["aux"]) if self.as_dict else (out.hidden, out.aux)
            aux = aux + a.sum()
        return x.pow(2).sum() + aux


@pytest.mark.parametrize("as_dict", [True, False])
def test_kwargs_and_structured_outputs(as_dict):
    plain = KwNet(as_dict)
    wrapped = copy.deepcopy(plain)
    distckpt.wrap(wrapped, "full")
    x = torch.randn(4, 8, requires_grad=True)
    mask = torch.rand(4, 8, requires_grad=True)  # a tensor passed by keyword that needs grad
    res = []
    for m in (plain, wrapped):
        m.zero_grad()
        x.grad = mask.grad = None
        loss = m(x, mask)
        loss.backward()
        res.append((loss.detach(), {**grads(m), "x": x.grad.clone(), "mask": mask.grad.clone()}))
    assert_same(*res)


# --- reentrant: exact or refused ----------------------------------------------------------------


def test_reentrant_frozen_input_is_exact():
    """Frozen embedding: no block input requires grad, yet the block parameters must get gradients."""
    plain = Net(n=3)
    plain.embed.requires_grad_(False)
    wrapped = copy.deepcopy(plain)
    distckpt.wrap(wrapped, "full", reentrant=True)
    x = torch.randn(6, 4)
    ref, got = step(plain, x), step(wrapped, x)
    assert "layers.0.fc1.weight" in got[1]
    assert_same(ref, got)


def test_reentrant_refuses_tensor_kwargs_and_nested_outputs():
    model = KwNet()
    distckpt.wrap(model, "full", reentrant=True)
    with pytest.raises(ConfigError, match="reentrant=False"):
        model(torch.randn(4, 8, requires_grad=True), torch.rand(4, 8))

    class DictOut(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    class DictBlock(nn.Linear):
        def forward(self, x):
            return {"h": super().forward(x)}

    m = nn.ModuleList([DictBlock(4, 4), DictBlock(4, 4)])
    distckpt.wrap(m, "full", reentrant=True)
    with pytest.raises(ConfigError, match="inside a dict.*reentrant=False"):
        m[0](torch.randn(2, 4, requires_grad=True))
    # the same block without reentrant is fine and exact
    m2 = nn.ModuleList([DictBlock(4, 4), DictBlock(4, 4)])
    distckpt.wrap(m2, "full")
    x = torch.randn(2, 4, requires_grad=True)
    m2[0](x)["h"].sum().backward()
    assert m2[0].weight.grad is not None


def test_offload_requires_known_target():
    with pytest.raises(ConfigError, match="offload"):
        distckpt.wrap(Net(), offload="disk")


def test_instance_forward_is_refused():
    model = Net(n=2)
    model.layers[0].forward = lambda x: x
    with pytest.raises(ConfigError, match="instance"):
        distckpt.wrap(model)


# --- cost ----------------------------------------------------------------------------------------


def _flops(model, x):
    model.zero_grad(set_to_none=True)
    with flop_counter() as fc:
        model(x).pow(2).sum().backward()
    return fc.get_total_flops()


@pytest.mark.parametrize("policy,n_ckpt", [("full", 8), ("every:2", 4), ("first:3", 3)])
def test_recompute_flops_at_most_one_forward_and_like_torch(policy, n_ckpt):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    x = torch.randn(32, 4)
    plain = Net()
    base = _flops(plain, x)
    with flop_counter() as fc, torch.no_grad():
        h = plain.embed(x)
        plain.layers[0](h)
    block_fwd = fc.get_total_flops()
    ours = copy.deepcopy(plain)
    distckpt.wrap(ours, policy)
    chosen = {int(n.split(".")[1]) for n in distckpt.checkpointed(ours)}
    assert len(chosen) == n_ckpt
    theirs = copy.deepcopy(plain)
    apply_activation_checkpointing(
        theirs,
        checkpoint_wrapper_fn=lambda m: checkpoint_wrapper(m, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, Block) and any(m is plain_b for plain_b in [theirs.layers[i] for i in chosen]),
    )
    recompute = _flops(ours, x) - base
    assert 0 < recompute <= n_ckpt * block_fwd  # never more than one forward of the checkpointed blocks
    assert _flops(ours, x) <= _flops(theirs, x)


def test_full_lowers_peak_memory():
    from torch.distributed._tools.mem_tracker import MemTracker

    def peak(model):
        x = torch.randn(256, 4)
        mt = MemTracker()
        mt.track_external(model, x)
        with mt:
            model(x).pow(2).sum().backward()
        return mt.get_tracker_snapshot("peak")[torch.device("cpu")]

    plain = Net(n=8, d=64)
    wrapped = copy.deepcopy(plain)
    distckpt.wrap(wrapped, "full")
    p0, p1 = peak(plain), peak(wrapped)
    assert p1["Total"] < 0.5 * p0["Total"], (p0, p1)
    assert p1["Activation"] < 0.25 * p0["Activation"], (p0, p1)


def test_hf_gpt2_exact():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        n_layer=3, n_embd=32, n_head=2, vocab_size=64, n_positions=16, resid_pdrop=0.1, attn_pdrop=0.1, embd_pdrop=0.1
    )
    torch.manual_seed(0)
    plain = transformers.GPT2LMHeadModel(cfg).train()
    wrapped = copy.deepcopy(plain)
    distckpt.wrap(wrapped)
    ids = torch.randint(0, 64, (2, 12))
    res = []
    for m in (plain, wrapped):
        torch.manual_seed(3)
        loss = m(ids, labels=ids).loss
        loss.backward()
        res.append((loss.detach(), grads(m)))
    assert_same(*res, exact=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wrapped.eval()
        with torch.no_grad():
            wrapped(ids)


@pytest.mark.cuda
@pytest.mark.parametrize("reentrant", [False, True])
def test_dropout_exact_cuda(reentrant):
    plain = Net(dropout=0.3).cuda()
    plain.embed.requires_grad_(False)  # reentrant + frozen input: the dummy input must sit on CUDA
    wrapped = copy.deepcopy(plain)
    distckpt.wrap(wrapped, "full", reentrant=reentrant)
    x = torch.randn(6, 4, device="cuda")
    assert_same(step(plain, x), step(wrapped, x))


@pytest.mark.cuda
def test_offload_cpu_cuda_exact_and_saves_device_memory():
    plain = Net(n=6, d=256).cuda()
    wrapped = copy.deepcopy(plain)
    offloaded = copy.deepcopy(plain)
    distckpt.wrap(wrapped, "full")
    distckpt.wrap(offloaded, "full", offload="cpu")
    x = torch.randn(4096, 4, device="cuda")

    def peak(model):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = step(model, x)
        torch.cuda.synchronize()
        return out, torch.cuda.max_memory_allocated() - base

    (ref, _), (got, p_ckpt), (off, p_off) = peak(plain), peak(wrapped), peak(offloaded)
    assert_same(ref, got, exact=False)
    assert_same(ref, off, exact=False)
    assert p_off < p_ckpt


def test_pickle_and_deepcopy_keep_checkpointing(tmp_path):
    model = Net(n=3, dropout=0.2, bn=True)
    distckpt.wrap(model, "every:2")
    torch.save(model, tmp_path / "m.pt")
    for other in (torch.load(tmp_path / "m.pt", weights_only=False), copy.deepcopy(model)):
        assert distckpt.checkpointed(other) == ["layers.0", "layers.2"]
        assert isinstance(other.layers[0], Block) and other.layers[0]._distckpt_options.preserve_rng_state
        assert other.layers[0]._distckpt_norms == [other.layers[0].bn]  # the copy's own BatchNorm
        x = torch.randn(5, 4)
        assert_same(step(model, x), step(other, x))


def test_checkpointed_names_through_ddp_and_fsdp(dist_pool):
    names = dist_pool.run(_names_under_wrappers)
    assert names[0] == names[1] == {s: ["layers.0", "layers.2"] for s in ("ddp", "fsdp", "fsdp2")}


def _names_under_wrappers(rank, world_size):
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.nn.parallel import DistributedDataParallel

    out = {}
    model = distckpt.wrap(Net(n=3), "every:2")
    out["ddp"] = distckpt.checkpointed(DistributedDataParallel(model))
    model = distckpt.wrap(Net(n=3), "every:2")
    fsdp = FullyShardedDataParallel(
        model,
        auto_wrap_policy=lambda module, recurse, **kw: recurse or is_checkpointed(module),
        device_id=torch.device("cpu"),
        use_orig_params=True,
    )
    out["fsdp"] = distckpt.checkpointed(fsdp)
    model = distckpt.wrap(Net(n=3), "every:2")
    for layer in model.layers:
        fully_shard(layer)
    out["fsdp2"] = distckpt.checkpointed(fully_shard(model))
    return out


def _tiny_decoder(family: str, **extra):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if family == "gpt2":  # passes its cache to the block positionally
        cfg = transformers.GPT2Config(
            n_layer=2,
            n_embd=32,
            n_head=2,
            vocab_size=64,
            n_positions=16,
            resid_pdrop=0.1,
            attn_pdrop=0.1,
            embd_pdrop=0.1,
            **extra,
        )
        return transformers.GPT2LMHeadModel(cfg).train()
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
        attention_dropout=0.1,
        **extra,
    )
    return transformers.LlamaForCausalLM(cfg).train()


def _padded_batch():
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # a padded row: with a cache written twice, attention shapes no longer match
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _hf_step(model, batch, seed=3):
    torch.manual_seed(seed)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), grads(model)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("reentrant", [False, True])
def test_hf_padded_batch_cache_off_in_training_exact(family, reentrant, monkeypatch):
    """use_cache=True (the config default) with a padded batch: the checkpointed layers run without
    a cache (the recompute would write it twice), with one warning, and gradients stay bitwise equal.
    reentrant=True works too: position_ids and rotary cos/sin need no gradient.

    The reference runs without a cache, as the checkpointed layers do: with the cache on, GPT-2's
    attention reads keys back from the cache, which moves gradients by float rounding (<= 6e-8,
    measured; HF's own checkpointing turns the cache off too)."""
    import sys

    monkeypatch.setattr(sys.modules["distckpt.runtime.recompute"], "_WARNED_CACHE", set())
    plain = _tiny_decoder(family)
    wrapped = copy.deepcopy(plain)
    distckpt.wrap(wrapped, reentrant=reentrant)
    batch = _padded_batch()
    ref = _hf_step(plain, {**batch, "use_cache": False})
    with pytest.warns(UserWarning, match="without a KV cache") as rec:
        got = _hf_step(wrapped, batch)
        _hf_step(wrapped, batch)
    assert sum("without a KV cache" in str(w.message) for w in rec) == 1  # once per layer class
    assert_same(ref, got, exact=True)


def test_hf_cache_turned_off_is_said_with_warnings_ignored(monkeypatch, caplog):
    """The cache turned off is said on the ``distckpt`` logger (rank 0's log under the launcher) even with every
    warning ignored, as PYTHONWARNINGS=ignore does in many training scripts; once per layer class."""
    import sys

    monkeypatch.setattr(sys.modules["distckpt.runtime.recompute"], "_WARNED_CACHE", set())
    model = distckpt.wrap(_tiny_decoder("gpt2"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _hf_step(model, _padded_batch())
        _hf_step(model, _padded_batch())
    said = [r for r in caplog.records if r.name == "distckpt" and "without a KV cache" in r.getMessage()]
    assert len(said) == 1 and said[0].levelname == "WARNING", caplog.messages


def test_hf_cache_notice_waits_for_training_after_a_profile(monkeypatch, caplog):
    """A profile (a budget's, at wrap) runs every block checkpointed: it says nothing, and the first training
    step says it. Before, the profile's forward took the one notice and silenced it: a budget's run never said it."""
    import sys

    from distckpt.select.blocks import find_blocks
    from distckpt.select.profile import profile_model

    monkeypatch.setattr(sys.modules["distckpt.runtime.recompute"], "_WARNED_CACHE", set())
    model, batch = _tiny_decoder("gpt2"), _padded_batch()
    profile_model(model, find_blocks(model, None), batch, modes=("full",))
    assert not [m for m in caplog.messages if "without a KV cache" in m]
    distckpt.wrap(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _hf_step(model, batch)
    assert len([m for m in caplog.messages if "without a KV cache" in m]) == 1, caplog.messages


def test_hf_generation_keeps_its_cache():
    """Under no_grad (generation) a checkpointed layer runs as is: the cache is written and used."""
    plain = _tiny_decoder("llama").eval()
    wrapped = copy.deepcopy(plain)
    distckpt.wrap(wrapped)
    ids = _padded_batch()["input_ids"][:1]
    outs = []
    for m in (plain, wrapped):
        with torch.no_grad():
            outs.append(m.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0))
    assert torch.equal(outs[0], outs[1])
    with torch.no_grad():
        cache = wrapped(ids, use_cache=True).past_key_values
    assert cache is not None and cache.get_seq_length() == ids.shape[1]


def test_reentrant_refuses_only_kwargs_that_require_grad():
    class KwBlock(nn.Linear):
        def forward(self, x, *, bias=None):
            return super().forward(x) + (0 if bias is None else bias)

    m = nn.ModuleList([KwBlock(4, 4), KwBlock(4, 4)])
    distckpt.wrap(m, "full", reentrant=True)
    x = torch.randn(2, 4, requires_grad=True)
    m[0](x, bias=torch.ones(4)).sum().backward()  # no grad needed: fine
    assert m[0].weight.grad is not None
    with pytest.raises(ConfigError, match="bias.*require grad.*reentrant=False"):
        m[0](x, bias=torch.ones(4, requires_grad=True))


def test_peft_after_hf_gradient_checkpointing_removes_input_require_grads_hook():
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    def build():
        return get_peft_model(_tiny_decoder("llama"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))

    plain = build()
    wrapped = build()
    wrapped.load_state_dict(plain.state_dict())
    hf_checkpointing_enable(wrapped, use_reentrant=True)
    assert any(getattr(m, "_require_grads_hook", None) is not None for m in wrapped.modules())
    with pytest.warns(UserWarning, match="Hugging Face gradient checkpointing"):
        distckpt.wrap(wrapped)
    assert not any(getattr(m, "_require_grads_hook", None) is not None for m in wrapped.modules())
    batch = _padded_batch()
    ref, got = _hf_step(plain, batch), _hf_step(wrapped, batch)
    assert_same(ref, got, exact=True)
