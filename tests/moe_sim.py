"""Simulated routing non-determinism for mixture-of-experts models (issue 34): routers whose recompute picks
other experts than their forward while every value moves by about 1e-6.

Two things make a router's second run (the recompute) route differently, as GPU kernels, bf16 ties and
router noise do in the field:

- two experts' router rows are tied (equal weights, and biases), so their scores are equal for every token;
- a tiny call-dependent perturbation (``EPS`` relative, per score) is added to the router logits, from
  ``"counter"``: a Python counter outside torch's RNG (the perturbation is a function of the counter, the
  expert and the score itself, so a token gets the same one in a rank's shard and in the global batch), or
  ``"generator"``: a module-owned ``torch.Generator``, which checkpointing's RNG preservation does not restore.

The reference is the model without checkpointing, run with the forward's perturbation: a twin built from the
same seed, its noise reset to the same state (:func:`reset_noise`) before the step.

Models (``MODELS``), each tiny, built from config classes (no download), dropout 0, in train mode:
``mixtral_grouped`` (transformers' default ``experts_implementation="grouped_mm"``: sort by expert, one grouped
matmul), ``mixtral_eager`` (``experts_implementation="eager"``: a Python loop over the experts hit),
``qwen2_moe`` (a shared expert beside the routed ones), ``olmoe``, and ``handmade`` (router, ``topk``,
``index_add``).

API::

    build(name, seed=0, noise=None) -> nn.Module   # noise: None, "counter" or "generator"
    batch(name, seed=0, tokens=TOKENS) -> dict     # keyword arguments of one forward (input_ids, labels)
    loss(model, batch) -> Tensor                   # the causal-LM loss
    routers(model) -> list[(fqn, module)]          # the modules whose first linear gives the router logits
    reset_noise(model, state=0); set_noise(model, on)
    routing_flips(model, batch) -> (changed, tokens, moved)  # tokens that change experts between two forwards
    step_grads(model, batch) -> (loss, {fqn: grad})
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from distckpt import _torch_compat as compat

__all__ = [
    "EPS",
    "SOURCES",
    "MODELS",
    "HF_MODELS",
    "TOKENS",
    "batch",
    "build",
    "loss",
    "rel_diff",
    "reset_noise",
    "routers",
    "routing_flips",
    "set_noise",
    "step_grads",
]

MODELS = ("mixtral_grouped", "mixtral_eager", "qwen2_moe", "olmoe", "handmade")
HF_MODELS = MODELS[:4]
EPS = 1e-5  # the perturbation, relative to each router logit
SOURCES = ("counter", "generator", "kernel")
VOCAB, HIDDEN, LAYERS, EXPERTS, TOP_K = 64, 32, 2, 4, 2
TOKENS = 512  # per batch: 8 rows of 64
_ROWS = 8

# --- the perturbation ----------------------------------------------------------------------------


_KERNEL_CALLS = [0]  # the "kernel" source's state: global, as a GPU kernel's non-determinism is


@torch.library.custom_op("moe_sim::jitter", mutates_args=())
def _jitter(x: torch.Tensor) -> torch.Tensor:
    """An opaque op (torch.compile cannot see inside, and recomputes it in a compiled backward) whose result
    depends on how often it ran: a non-deterministic kernel."""
    _KERNEL_CALLS[0] += 1
    phase = _KERNEL_CALLS[0] * 0.618 + torch.arange(x.shape[-1], dtype=x.dtype, device=x.device) * 1.37
    return torch.sin(x * 1e3 + phase)


@_jitter.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class _Noise:
    """A router's perturbation: ``logits * EPS * n`` with ``n`` in [-1, 1] per score, drawn anew at each call."""

    def __init__(self, source: str, seed: int) -> None:
        if source not in SOURCES:
            raise ValueError(f"noise source must be one of {SOURCES}, got {source!r}")
        self.source, self.seed, self.on = source, seed, True
        self.calls = 0
        self.gen = torch.Generator().manual_seed(seed) if source == "generator" else None

    def reset(self, state: int = 0) -> None:
        self.calls = state
        if self.source == "kernel":
            _KERNEL_CALLS[0] = state
        if self.gen is not None:
            self.gen.manual_seed(self.seed + state)

    def draw(self, logits: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        x = logits.detach()
        if self.source == "kernel":
            n = torch.ops.moe_sim.jitter(x)
        elif self.gen is not None:  # the module's own generator: its state advances at every call
            n = torch.rand(x.shape, generator=self.gen, dtype=x.dtype).mul_(2).sub_(1).to(x.device)
        else:  # a function of the Python counter, the expert and the score itself (no torch RNG)
            phase = self.calls * 0.618 + torch.arange(x.shape[-1], dtype=x.dtype, device=x.device) * 1.37
            n = torch.sin(x * 1e3 + phase)
        return x.abs() * EPS * n


class _PerturbFirstLinear(TorchFunctionMode):
    """Adds the noise to the output of the first ``F.linear`` the router runs (its logits)."""

    def __init__(self, noise: _Noise) -> None:
        super().__init__()
        self.noise, self.done = noise, False

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is F.linear and not self.done:
            self.done = True
            out = out + self.noise.draw(out)
        return out


def _noisy_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    noise: _Noise = self._sim_noise
    forward = type(self).__mro__[1].forward
    if not noise.on:
        return forward(self, *args, **kwargs)
    with _PerturbFirstLinear(noise):
        return forward(self, *args, **kwargs)


_NOISY: dict[type, type] = {}


def _add_noise(router: nn.Module, source: str, seed: int) -> None:
    cls = type(router)
    if cls not in _NOISY:
        _NOISY[cls] = type(f"Noisy{cls.__name__}", (cls,), {"forward": _noisy_forward})
    router.__class__ = _NOISY[cls]
    router._sim_noise = _Noise(source, seed)


def reset_noise(model: nn.Module, state: int = 0) -> None:
    """Every router's noise back to ``state`` (counter value; generator seed offset)."""
    for _, r in routers(model):
        r._sim_noise.reset(state)


def set_noise(model: nn.Module, on: bool) -> None:
    for _, r in routers(model):
        r._sim_noise.on = on


# --- the models ----------------------------------------------------------------------------------


class HandExpert(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.up(h)))


class HandMoELayer(nn.Module):
    """Norm, router (``nn.Linear``), softmax, ``topk``, then each expert on its tokens, ``index_add`` back."""

    def __init__(self, d: int = HIDDEN, n_experts: int = EXPERTS, k: int = TOP_K) -> None:
        super().__init__()
        self.k = k
        self.norm = nn.LayerNorm(d)
        self.router = nn.Linear(d, n_experts)
        self.experts = nn.ModuleList([HandExpert(d) for _ in range(n_experts)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x).reshape(-1, x.shape[-1])
        weights, idx = self.router(h).softmax(-1).topk(self.k, dim=-1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(idx == e)
            if rows.numel():  # an expert no token chose does not run
                out = out.index_add(0, rows, expert(h[rows]) * weights[rows, slot, None])
        return x + out.reshape(x.shape)


class HandMoE(nn.Module):
    """embed -> MoE layers -> LM head; ``forward(input_ids, labels)`` returns an object with ``.loss``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList([HandMoELayer() for _ in range(LAYERS)])
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Any:
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h)
        logits = self.head(h)
        return _Out(F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1)))


class _Out:
    def __init__(self, loss: torch.Tensor) -> None:
        self.loss = loss


def _hf(name: str) -> nn.Module:
    import transformers

    common = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        attention_dropout=0.0,
        num_experts_per_tok=TOP_K,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="eager",
    )
    if name.startswith("mixtral"):
        impl = "grouped_mm" if name == "mixtral_grouped" else "eager"
        config = transformers.MixtralConfig(**common, num_local_experts=EXPERTS, experts_implementation=impl)
        return transformers.MixtralForCausalLM(config)
    if name == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(
            **common, num_experts=EXPERTS, moe_intermediate_size=2 * HIDDEN, shared_expert_intermediate_size=HIDDEN
        )
        return transformers.Qwen2MoeForCausalLM(config)
    if name == "olmoe":
        return transformers.OlmoeForCausalLM(transformers.OlmoeConfig(**common, num_experts=EXPERTS))
    raise ValueError(f"unknown model {name!r}; one of {MODELS}")


def routers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The routers, in forward order: HF's ``mlp.gate`` (a ``*TopKRouter``), the handmade layers' ``router``."""
    return [
        (n, m)
        for n, m in model.named_modules()
        if (n.endswith("mlp.gate") and "TopKRouter" in type(m).__name__)
        or (n.endswith(".router") and isinstance(m, nn.Linear))
    ]


def _tie(router: nn.Module) -> None:
    """Experts 0 and 1 get the same router row (and bias): equal scores for every token."""
    with torch.no_grad():
        router.weight[1].copy_(router.weight[0])
        if getattr(router, "bias", None) is not None:
            router.bias[1].copy_(router.bias[0])


def build(name: str, seed: int = 0, noise: str | None = None, tie: bool = True) -> nn.Module:
    """A tiny ``name`` model (``MODELS``) with seeded weights, tied router rows (``tie``) and, with ``noise``
    (``"counter"`` or ``"generator"``), the perturbation on its router logits; train mode."""
    torch.manual_seed(seed)
    model = HandMoE() if name == "handmade" else _hf(name)
    found = routers(model)
    assert len(found) == LAYERS, (name, [n for n, _ in found])
    for i, (_, r) in enumerate(found):
        if tie:
            _tie(r)
        if noise is not None:
            _add_noise(r, noise, seed=1000 * seed + i)
    return model.train()


def batch(name: str, seed: int = 0, tokens: int = TOKENS) -> dict[str, Any]:
    """``input_ids`` and ``labels`` (the same ids: the models shift them) of ``tokens`` tokens in 8 rows."""
    g = torch.Generator().manual_seed(10_000 + seed)
    ids = torch.randint(3, VOCAB, (_ROWS, tokens // _ROWS), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def loss(model: nn.Module, b: dict[str, Any]) -> torch.Tensor:
    return model(**b).loss


def step_grads(model: nn.Module, b: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward and backward from fresh gradients: the loss and every gradient by clean FQN."""
    from distckpt.runtime.swap import _clean_fqn

    for p in model.parameters():
        p.grad = None
    out = loss(model, b)
    out.backward()
    return out.detach(), {
        _clean_fqn(n): p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None
    }


def rel_diff(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """The largest ``max|got - ref| / max|ref|`` over the parameters (inf when the sets differ)."""
    if got.keys() != ref.keys():
        return math.inf
    worst = 0.0
    for k, r in ref.items():
        scale = float(r.abs().max())
        diff = float((got[k] - r).abs().max())
        worst = max(worst, diff / scale if scale else diff)
    return worst


class _TopkCalls(compat.torch_dispatch_mode()):  # type: ignore[misc]
    """Each ``topk``'s scores (its input) and its chosen experts (sorted per token)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket is torch.ops.aten.topk:
            self.seen.append((args[0].clone(), out[1].sort(-1).values))
        return out


def routing_flips(model: nn.Module, b: dict[str, Any]) -> tuple[int, int, float]:
    """Between a forward and its re-run (no grad): how many (layer, token) pairs pick another set of experts, how
    many tokens a layer routes, and the largest relative change of a score of the first router."""
    runs = []
    with torch.no_grad():
        for _ in range(2):
            mode = _TopkCalls()
            with mode:
                model(**b)
            runs.append(mode.seen)
    changed = sum(int((a[1] != c[1]).any(-1).sum()) for a, c in zip(*runs))
    # The first router's scores: later layers see the first one's other routes too.
    (a, _), (c, _) = runs[0][0], runs[1][0]
    moved = float(((a - c).abs() / a.abs().clamp_min(1e-30)).max())
    return changed, runs[0][0][1].shape[0], moved
