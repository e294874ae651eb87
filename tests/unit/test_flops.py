"""distckpt.select.profile.flops: CPU attention FLOPs counted with torch's own formulas, checked against
attention written as matmul + softmax, without touching a user's own FlopCounterMode, and seen by
the profile (forward and full recompute count attention; selective/pointwise keep its output)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode, flop_registry

import distckpt.select.profile.recompute_passes as passes_mod
import distckpt.select.profile.recorder as recorder_mod
from distckpt import _torch_compat as compat
from distckpt.select.profile import attention_flop_formulas, flop_counter, profile_model

FWD, BWD = compat.cpu_flash_attention_ops()
SDPA_FLOPS, SDPA_BACKWARD_FLOPS = compat.sdpa_flop_count_fns()

# (query heads, key/value heads, query length, key length, causal, extra sdpa kwargs)
CASES = {
    "cross": (4, 4, 8, 12, False, {}),
    "causal": (4, 4, 8, 8, True, {}),
    "gqa_causal": (4, 2, 8, 8, True, {"enable_gqa": True}),
    "scale_mask": (2, 2, 6, 10, False, {"scale": 0.3, "attn_mask": torch.ones(6, 10, dtype=torch.bool).tril(4)}),
}


def _qkv(hq: int, hkv: int, sq: int, sk: int, d: int = 16) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    return tuple(torch.randn(2, h, s, d, requires_grad=True) for h, s in ((hq, sq), (hkv, sk), (hkv, sk)))


def _fwd_bwd(fn, q, k, v, counter_factory=flop_counter) -> tuple[int, int, dict]:
    """FLOPs of ``fn(q, k, v)`` forward and of its backward, each under its own counter."""
    with counter_factory() as fc:
        out = fn(q, k, v)
    with counter_factory() as bc:
        out.backward(torch.ones_like(out))
    return (
        fc.get_total_flops(),
        bc.get_total_flops(),
        {**fc.get_flop_counts()["Global"], **bc.get_flop_counts()["Global"]},
    )


def _matmul_softmax(q, k, v, *, is_causal=False, enable_gqa=False, scale=None, attn_mask=None):
    """Attention written out (the math a kernel does): ``softmax(q k^T * scale + mask) v``."""
    if enable_gqa:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    s = q @ k.transpose(-2, -1) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if is_causal:
        attn_mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf"))
    return s.softmax(-1) @ v


@pytest.mark.parametrize("case", CASES)
def test_cpu_attention_flops_are_torchs_formula_and_the_matmul_path(case):
    hq, hkv, sq, sk, causal, kw = CASES[case]
    q, k, v = _qkv(hq, hkv, sq, sk)

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, **kw)

    fwd, bwd, ops = _fwd_bwd(sdpa, q, k, v)
    assert set(ops) == {FWD, BWD}  # the CPU kernel ran (not sdpa's math fallback, whose bmm torch counts)
    assert fwd == SDPA_FLOPS(q.shape, k.shape, v.shape) > 0  # causal counted as full, as torch does
    assert bwd == SDPA_BACKWARD_FLOPS(q.shape, q.shape, k.shape, v.shape)

    # Independent: the same attention as matmul + softmax, counted by torch's own bmm formula.
    mm_fwd, mm_bwd, mm_ops = _fwd_bwd(lambda q, k, v: _matmul_softmax(q, k, v, is_causal=causal, **kw), q, k, v)
    assert set(mm_ops) == {torch.ops.aten.bmm}
    assert fwd == mm_fwd
    # The kernel's backward recomputes the scores (one q @ k^T) where the matmul path saved them.
    with FlopCounterMode(display=False) as scores:
        q @ k.repeat_interleave(hq // hkv, dim=1).transpose(-2, -1)
    assert bwd == mm_bwd + scores.get_total_flops()


def test_a_plain_flop_counter_is_left_alone():
    """Nothing is registered globally: a user's FlopCounterMode still counts what torch counts
    (torch 2.13: no formula for the CPU kernel, so 0; if torch adds one, ours can go)."""
    flop_counter()
    assert FWD not in flop_registry and BWD not in flop_registry
    q, k, v = _qkv(2, 2, 8, 8)
    fwd, bwd, ops = _fwd_bwd(
        F.scaled_dot_product_attention, q, k, v, counter_factory=lambda: FlopCounterMode(display=False)
    )
    assert (fwd, bwd) == (0, 0) and ops == {}


def test_formulas_fold_extra_leading_dims_and_keep_a_callers_mapping():
    fwd_formula = attention_flop_formulas()[FWD]
    q = (2, 3, 4, 8, 16)  # [batch..., heads, seq, dim]: folded into a batch of 6
    assert fwd_formula(q, q, q) == SDPA_FLOPS((6, 4, 8, 16), (6, 4, 8, 16), (6, 4, 8, 16))
    mine = flop_counter(custom_mapping={FWD: lambda *a, **k: 7})
    q, k, v = _qkv(2, 2, 8, 8)
    with mine:
        F.scaled_dot_product_attention(q, k, v)
    assert mine.get_total_flops() == 7


class Attention(nn.Module):
    """A grouped-query causal attention block: q/kv/out projections around the CPU sdpa kernel."""

    def __init__(self, d: int = 32, heads: int = 4, kv_heads: int = 2) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, d // heads
        self.q = nn.Linear(d, d)
        self.kv = nn.Linear(d, 2 * kv_heads * self.hd)
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q = self.q(x).view(b, s, self.heads, self.hd).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.hd).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return x + self.out(y.transpose(1, 2).reshape(b, s, d))


def test_profile_counts_attention_in_forward_and_full_recompute_only(monkeypatch):
    torch.manual_seed(0)
    b, s, d = 2, 16, 32
    model = nn.Sequential(Attention(d), Attention(d))
    x = torch.randn(b, s, d)
    blocks = [("0", model[0]), ("1", model[1])]
    new = profile_model(model, blocks, (x,))
    # torch's counter, in the first step (forward FLOPs) and the recompute FLOP steps
    for mod in (recorder_mod, passes_mod):
        monkeypatch.setattr(mod, "flop_counter", lambda: FlopCounterMode(display=False))
    m = copy.deepcopy(model)  # a new model: profiles are cached per model
    old = profile_model(m, [("0", m[0]), ("1", m[1])], (x,))
    hd = d // 4
    attention = SDPA_FLOPS((b, 4, s, hd), (b, 2, s, hd), (b, 2, s, hd))
    projections = 2 * b * s * d * (d + 2 * 2 * hd + d)  # q, kv and out Linear layers
    for n, o in zip(new.blocks, old.blocks):
        assert o.forward_flops == projections  # torch 2.13's counter: no attention
        assert n.forward_flops == projections + attention
        # Full recompute re-runs the attention kernel (non-reentrant checkpoint stops before `out`).
        assert n.full_flops - o.full_flops == attention > 0
        # selective/pointwise keep the attention output: their recompute is unchanged.
        assert n.selective_flops == o.selective_flops
        assert n.pointwise_flops == o.pointwise_flops
        assert n.selective_held_bytes == o.selective_held_bytes >= 0
