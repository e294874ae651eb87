"""parallelize(..., compile=...) on 2 gloo ranks: every block compiled (checkpointed or not) after checkpointing and
before DDP/FSDP2, as torchtitan does, and the zero-weight join still makes each multi-task pattern of tests/patterns.py
train to the single-process reference without checkpointing (AdamW, 3 steps); or a ConfigError naming the fix.

Backend aot_eager (dynamo and AOT autograd, no C++ build). Each rank resets dynamo before it builds its model."""

from __future__ import annotations

import pytest
import torch
from patterns import (
    PATTERNS,
    assert_matches,
    build,
    full_grads,
    full_params,
    make_optimizer,
    reference_of,
    train_parallel,
)

import distckpt
from distckpt import _torch_compat as compat
from distckpt.apply.compile import compiled_blocks

STEPS = 3
COMPILE = {"backend": "aot_eager"}


def _train(rank, world_size, name, strategy, policy="full", reentrant=False, compile=COMPILE):  # noqa: A002
    """Per-step full grads, final full params, the compiled and checkpointed block names, dynamo's counts."""
    torch.compiler.reset()
    pattern = PATTERNS[name]
    model = build(pattern)
    distckpt.wrap(model, policy, blocks=pattern.blocks, reentrant=reentrant)
    try:
        with compat.compile_counts() as counts:
            pm = distckpt.parallelize(model, strategy, compile=compile)
            trained = train_parallel(pm, pattern, strategy, rank, world_size, STEPS)
    finally:
        torch.compiler.reset()  # the ranks run other tests next
    return trained, (compiled_blocks(pm), distckpt.checkpointed(pm)), counts


def _check(dist_pool, name, strategy, **kw):
    results = dist_pool.run(_train, name, strategy, **kw, timeout=120)
    assert_matches([r[0] for r in results], reference_of(name, steps=STEPS))
    for _, (compiled, _), counts in results:
        assert compiled and counts["breaks"] == {} and counts["graphs"] >= 1, (compiled, counts)
    return results[0][1]


# Two forwards before one backward, heads sampled by rank and step (the join at work), and LoRA (every trainable
# parameter inside the checkpointed blocks: pytorch#121594's silent desync). Slow: the other combinations, and heads
# by rank (sampled varies them by rank too).
_DEFAULT = {("sampled", "ddp"), ("lora_two_forwards", "ddp"), ("two_forwards", "fsdp2"), ("sampled", "fsdp2")}
_CASES = [
    pytest.param(name, strategy, marks=[] if (name, strategy) in _DEFAULT else [pytest.mark.slow])
    for name in ("two_forwards", "by_rank", "sampled", "lora_two_forwards")
    for strategy in ("ddp", "fsdp2")
]


@pytest.mark.dist
@pytest.mark.parametrize(("name", "strategy"), _CASES)
def test_compiled_blocks_exact(dist_pool, name, strategy):
    _check(dist_pool, name, strategy)


@pytest.mark.dist
@pytest.mark.parametrize(
    ("name", "strategy", "policy", "reentrant"),
    [
        ("by_rank", "ddp", "every:2", False),  # kept blocks are compiled too
        ("by_rank", "fsdp2", "selective", False),
        ("all_heads", "ddp", "full", True),  # reentrant: compiled forward inside an eager reentrant checkpoint
        pytest.param("unused_output", "fsdp2", "full", False, marks=pytest.mark.slow),
        pytest.param("eval_between", "ddp", "full", False, marks=pytest.mark.slow),
        pytest.param("interleaved_accumulate", "fsdp2", "full", False, marks=pytest.mark.slow),
        pytest.param("dpo", "fsdp", "full", False, marks=pytest.mark.slow),  # FSDP1 works the same way
    ],
)
def test_compiled_modes_exact(dist_pool, name, strategy, policy, reentrant):
    compiled, checkpointed = _check(dist_pool, name, strategy, policy=policy, reentrant=reentrant)
    assert compiled == ["blocks.0", "blocks.1"], compiled  # every block, checkpointed or not
    assert checkpointed == (["blocks.0"] if policy == "every:2" else compiled)


def _refused(rank, world_size, *args, **kwargs):
    try:
        _train(rank, world_size, *args, **kwargs)
    except distckpt.ConfigError as e:
        return str(e)
    return None


@pytest.mark.dist
def test_refusals_name_the_fix(dist_pool):
    # A gradient penalty's create_graph=True backward through compiled blocks: AOT autograd cannot differentiate it
    # again (torch's own error would come in the second backward).
    msgs = dist_pool.run(_refused, "grad_penalty", "ddp")
    assert all(m and "double backward" in m and "Drop compile=" in m for m in msgs), msgs
    # An MoE layer (experts run only when chosen): no single graph under fullgraph=True.
    msgs = dist_pool.run(_refused, "moe", "ddp")
    assert all(m and "MoELayer in one graph" in m and "'fullgraph': False" in m for m in msgs), msgs


@pytest.mark.dist
@pytest.mark.slow
def test_moe_without_fullgraph_exact(dist_pool):
    """Slow: the refusal above is the default case. fullgraph=False runs the routing between graphs: exact."""
    results = dist_pool.run(_train, "moe", "fsdp2", compile={**COMPILE, "fullgraph": False}, timeout=120)
    assert_matches([r[0] for r in results], reference_of("moe"))
    assert all(counts["breaks"] for _, _, counts in results)


# --- Hugging Face models on 2 ranks (slow: transformers and a compile of each family on every rank) ---------------


def _train_hf(rank, world_size, family, strategy, dpo):
    import test_hf_parallel as hf

    torch.compiler.reset()
    model = hf.FAMILIES[family].build()
    distckpt.wrap(model)
    try:
        with compat.compile_counts() as counts:
            pm = distckpt.parallelize(model, strategy, compile=COMPILE)
            opt = make_optimizer(hf._trainable(pm))
            grads = []
            for step in range(hf.STEPS):
                opt.zero_grad(set_to_none=True)
                hf._local_loss(family, pm, step, rank, dpo).backward()
                grads.append(full_grads(pm, strategy))
                opt.step()
    finally:
        torch.compiler.reset()
    return (grads, full_params(pm, strategy)), counts


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:distckpt.*KV cache")
@pytest.mark.parametrize(("family", "strategy", "dpo"), [("gpt2", "ddp", False), ("llama_lora", "fsdp2", True)])
def test_hf_compiled_blocks_exact(dist_pool, family, strategy, dpo):
    import test_hf_parallel as hf

    results = dist_pool.run(_train_hf, family, strategy, dpo, timeout=300)
    assert_matches([r[0] for r in results], hf._reference(family, dpo), param_atol=1e-4)
    assert all(counts["breaks"] == {} for _, counts in results)
