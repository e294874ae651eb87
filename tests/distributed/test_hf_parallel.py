"""Hugging Face models (built from their configs, tests/zoo.py) on 2 ranks under DDP, FSDP and FSDP2:
per-step gradients and final parameters against the single-process model without checkpointing that
runs both ranks' shards and averages (AdamW with weight decay).

Each rank's shard is a padded batch of its own (``attention_mask`` with zeros); the global batch is
their concatenation. Dropout stays on (0.1, LoRA dropout too): before each local forward the rank
seeds the RNG with ``_seed(step, rank)``, and the reference seeds it the same way before running that
rank's shard. A dropout mask depends only on the RNG state and the shape, so each shard draws the
same masks in both; checkpointing's recompute restores the forward's RNG state
(``preserve_rng_state``), and DDP/FSDP draw no random numbers. That makes the comparison exact with
dropout on under every strategy, without a separate dropout-free run.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from patterns import assert_matches, full_grads, full_params, make_optimizer
from zoo import FAMILIES

import distckpt

STEPS = 2
WORLD = 2


def _seed(step: int, rank: int) -> int:
    return 10_000 + 100 * step + rank


def _shard(family: str, step: int, rank: int, rejected: bool = False) -> dict:
    """Rank ``rank``'s shard of step ``step``'s global batch (the zoo's padded batch of 2 rows)."""
    return FAMILIES[family].batch(1000 * step + 10 * rank + (5 if rejected else 0))


def _logp(model, batch: dict) -> torch.Tensor:
    """Per-sequence log-probability of the labels (padding excluded), as a DPO trainer computes it."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    labels = batch["labels"][:, 1:]
    lp = logits.log_softmax(-1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (lp * (labels != -100)).sum(-1)


def _local_loss(family: str, model, step: int, rank: int, dpo: bool) -> torch.Tensor:
    torch.manual_seed(_seed(step, rank))  # dropout masks: see the module docstring
    if dpo:
        # Two forwards (chosen, rejected) through the same model before one backward.
        chosen, rejected = _logp(model, _shard(family, step, rank)), _logp(model, _shard(family, step, rank, True))
        return -F.logsigmoid(0.1 * (chosen - rejected)).mean()
    return FAMILIES[family].loss(model, _shard(family, step, rank))


def _trainable(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


_REF: dict = {}


def _reference(family: str, dpo: bool) -> tuple[list[dict], dict]:
    """Single process, no checkpointing, both ranks' shards, losses averaged as DDP averages grads."""
    key = (family, dpo)
    if key not in _REF:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as on the ranks (harness.py)
        try:
            model = FAMILIES[family].build()
            opt = make_optimizer(_trainable(model))
            grads = []
            for step in range(STEPS):
                opt.zero_grad(set_to_none=True)
                for rank in range(WORLD):
                    (_local_loss(family, model, step, rank, dpo) / WORLD).backward()
                grads.append(
                    {
                        n: None if p.grad is None else p.grad.clone()
                        for n, p in model.named_parameters()
                        if p.requires_grad
                    }
                )
                opt.step()
            _REF[key] = grads, {n: p.detach().clone() for n, p in model.named_parameters()}
        finally:
            torch.set_num_threads(threads)
    return _REF[key]


def _train(rank, world_size, family, strategy, reentrant, dpo):
    model = FAMILIES[family].build()
    distckpt.wrap(model, reentrant=reentrant)  # blocks=None: the zoo checks which blocks it picks
    assert distckpt.checkpointed(model), "nothing checkpointed"
    pm = distckpt.parallelize(model, strategy)
    opt = make_optimizer(_trainable(pm))
    grads = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        _local_loss(family, pm, step, rank, dpo).backward()
        grads.append(full_grads(pm, strategy))
        opt.step()
    return grads, full_params(pm, strategy)


def _check(dist_pool, family, strategy, reentrant=False, dpo=False):
    results = dist_pool.run(_train, family, strategy, reentrant, dpo, timeout=90)
    # Gradients: as tight as the pattern tests. Parameters: 1e-4, because Adam divides by sqrt(v) + 1e-8,
    # so a gradient that is zero in exact arithmetic (GPT-2's key bias: softmax ignores it) is float
    # noise that the reduction order changes (1e-9 here), scaled to updates up to 2e-5 after 2 steps
    # (measured). A gradient made up or dropped moves a parameter by about lr = 1e-2, and None versus zero
    # is checked on the gradients themselves.
    assert_matches(results, _reference(family, dpo), param_atol=1e-4)


@pytest.mark.dist
@pytest.mark.filterwarnings("ignore:distckpt.*KV cache")
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "fsdp2"])
@pytest.mark.parametrize("family", ["gpt2", "llama_lora", "bert", "t5"])
def test_hf_family(dist_pool, family, strategy):
    """Non-reentrant checkpointing (the default), padded batches, dropout on: exact."""
    _check(dist_pool, family, strategy)


def _reentrant_cases() -> list:
    # The default run keeps every family x strategy with two forwards before one backward (the reentrant
    # inputs of HF decoders, position_ids and rotary cos/sin, go through each forward alike), and one forward
    # for llama_lora under FSDP2 (pytorch#121594's case); the other one-forward cases are slow only.
    out = []
    for family, strategy, dpo in itertools.product(["gpt2", "llama", "llama_lora"], ["ddp", "fsdp2"], [False, True]):
        keep = dpo or (family, strategy) == ("llama_lora", "fsdp2")
        out.append(
            pytest.param(
                family,
                strategy,
                dpo,
                marks=[] if keep else [pytest.mark.slow],
                id=f"{family}-{strategy}-{'dpo_two_forwards' if dpo else 'one_forward'}",
            )
        )
    return out


@pytest.mark.dist
@pytest.mark.filterwarnings("ignore:distckpt.*KV cache")
@pytest.mark.parametrize(("family", "strategy", "dpo"), _reentrant_cases())
def test_hf_reentrant(dist_pool, family, strategy, dpo):
    """reentrant=True on HF decoders (position_ids and rotary cos/sin need no grad, so nothing is refused),
    with and without LoRA (pytorch#121594), also two forwards before one backward: exact."""
    _check(dist_pool, family, strategy, reentrant=True, dpo=dpo)


@pytest.mark.parametrize("family", ["gpt2", "llama_lora", "bert", "t5"])
def test_dropout_is_on(family):
    """The control for the seeding above: the same shard with another seed gives another loss, so the
    comparisons run with dropout active."""
    model = FAMILIES[family].build()
    with torch.no_grad():
        losses = [_local_loss(family, model, step, 0, dpo=False) for step in (0, 0)]
        torch.manual_seed(1)
        other = FAMILIES[family].loss(model, _shard(family, 0, 0))
    assert torch.equal(losses[0], losses[1]) and not torch.equal(losses[0], other)
