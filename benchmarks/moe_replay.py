"""What routing replay costs: ``python -m benchmarks.moe_replay``.

A Hugging Face Mixtral (grouped experts, built from its config: 4 layers of width 256, 8 experts, top-2) and a
dense GPT (tests/models.py), every block checkpointed (``full``), one forward+backward on CPU:

- memory: MemTracker's peak of the step with replay (the default) and inside ``routing_replay_disabled``
  (no perturbation: both steps compute the same values), next to what replay records, counted from the
  routing ops' outputs of one forward (``distckpt.runtime.routing.replay_contexts``);
- time: the step with and without replay, interleaved, medians. A dense block pays replay's dispatch mode in its
  first checkpointed forward only (it runs no routing op), so its ratio is measured after that one.

Writes ``benchmarks/results/moe_replay.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

import distckpt
from distckpt import _torch_compat as compat
from distckpt.apply.wrap import is_checkpointed
from distckpt.runtime import routing
from distckpt.select.profile import memory_tracker

RESULTS = Path(__file__).resolve().parent / "results"
LAYERS, WIDTH, EXPERTS, TOP_K = 4, 256, 8, 2


def _mixtral() -> nn.Module:
    import transformers

    config = transformers.MixtralConfig(
        vocab_size=1024,
        hidden_size=WIDTH,
        intermediate_size=2 * WIDTH,
        num_hidden_layers=LAYERS,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        max_position_embeddings=1024,
        experts_implementation="grouped_mm",
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(config).train()


def _gpt() -> tuple[nn.Module, Any]:
    from models import GPT, GPTConfig, batch

    cfg = GPTConfig(vocab=1024, seq=256, dim=WIDTH, heads=8, layers=LAYERS)
    torch.manual_seed(0)
    return GPT(cfg).train(), batch(cfg, 8)


def _step(model: nn.Module, inputs: Any, replay: bool) -> None:
    with contextlib.nullcontext() if replay else distckpt.routing_replay_disabled(model):
        out = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
        (out.loss if hasattr(out, "loss") else out).backward()
    model.zero_grad(set_to_none=True)


def _peaks(model: nn.Module, inputs: Any, replay: bool) -> tuple[int, list[int]]:
    """MemTracker's peak of the step, and of each checkpointed layer's backward."""
    tracker = memory_tracker(model)
    with tracker:
        _step(model, inputs, replay)
    _, peak_bw = compat.mem_tracker_states()

    def total(snap: dict[Any, dict[str, int]]) -> int:
        return sum(d.get("Total", 0) for d in snap.values())

    layers = [m for m in model.modules() if is_checkpointed(m)]
    per = [max(map(total, tracker.memory_tracking[m].snapshots.get(peak_bw, [])), default=0) for m in layers]
    return total(tracker.get_tracker_snapshot("peak")), per


def _recorded(model: nn.Module, inputs: dict) -> int:
    """Bytes replay records in one forward: the routing ops' outputs of every checkpointed block."""
    total = 0
    fwds = []
    hooks = []
    for block in (m for m in model.modules() if is_checkpointed(m)):
        fwd, _ = routing.replay_contexts()
        fwds.append(fwd)
        hooks.append(block.register_forward_pre_hook(lambda _m, _a, fwd=fwd: fwd.__enter__() and None))
        hooks.append(block.register_forward_hook(lambda _m, _a, _o, fwd=fwd: fwd.__exit__(None, None, None) and None))
    with torch.no_grad(), distckpt.checkpointing_disabled(model):
        model(**inputs)
    for h in hooks:
        h.remove()
    for fwd in fwds:
        total += sum(t.numel() * t.element_size() for _, _, out in fwd.log for t in out)
    return total


def _times(model: nn.Module, inputs: Any, rounds: int) -> tuple[float, float]:
    _step(model, inputs, True)  # the first checkpointed forward: a dense block is learned not to route
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(rounds):
        for replay in (True, False):
            t0 = time.perf_counter()
            _step(model, inputs, replay)
            times[replay].append(time.perf_counter() - t0)
    return statistics.median(times[True]), statistics.median(times[False])


def measure(rounds: int, tokens: int) -> dict[str, Any]:
    rows = 8
    ids = torch.randint(0, 1024, (rows, tokens // rows), generator=torch.Generator().manual_seed(0))
    moe_inputs = {"input_ids": ids, "labels": ids}
    moe = distckpt.wrap(_mixtral(), "full")
    gpt, gpt_inputs = _gpt()
    distckpt.wrap(gpt, "full")
    _step(moe, moe_inputs, True)  # warm-up (and the blocks learn that they route)
    out: dict[str, Any] = {"tokens": tokens, "rounds": rounds}
    out["peak_replay"], out["layers_replay"] = _peaks(moe, moe_inputs, True)
    out["peak_off"], out["layers_off"] = _peaks(moe, moe_inputs, False)
    out["recorded"] = _recorded(moe, moe_inputs)
    out["moe_time"] = _times(moe, moe_inputs, rounds)
    out["gpt_time"] = _times(gpt, gpt_inputs, rounds)
    return out


def report(r: dict[str, Any]) -> str:
    per_token = r["recorded"] / (r["tokens"] * LAYERS)
    layer_rows = "\n".join(
        f"| layer {i}'s backward | {off:,} B | {on:,} B | +{on - off:,} B |"
        for i, (on, off) in enumerate(zip(r["layers_replay"], r["layers_off"]))
    )
    (mr, mo), (gr, go) = r["moe_time"], r["gpt_time"]
    return f"""# Routing replay: memory and time

`python -m benchmarks.moe_replay --rounds {r["rounds"]} --tokens {r["tokens"]}`: Hugging Face Mixtral (grouped
experts; {LAYERS} layers of width {WIDTH}, {EXPERTS} experts, top-{TOP_K}; {r["tokens"]} tokens per step) and a
dense GPT of the same depth and width, every block checkpointed (`full`), one forward and backward. Machine:
{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}.

| MemTracker peak | `routing_replay_disabled` | replay (default) | difference |
|---|---|---|---|
| the step | {r["peak_off"]:,} B | {r["peak_replay"]:,} B | +{r["peak_replay"] - r["peak_off"]:,} B |
{layer_rows}
| what replay records in one forward | | {r["recorded"]:,} B | {per_token:.0f} B per token and layer |

Per token and layer replay keeps the router's top-{TOP_K} values (float32) and indices (int64), and the grouped
experts' sort of those {TOP_K} expert ids (int64 values and indices): {TOP_K} x (4 + 8) + {TOP_K} x (8 + 8) =
{TOP_K * 28} B, from the layer's forward to its backward. In the last layer's backward every layer's records are
alive; the step's peak is in the first layer's backward (every gradient allocated), when the later layers' records
are gone with their graphs: one layer's records more, {(r["peak_replay"] - r["peak_off"]) / r["peak_off"]:.3%}.

| median step (CPU) | replay | off | ratio |
|---|---|---|---|
| Mixtral | {mr * 1e3:.0f} ms | {mo * 1e3:.0f} ms | {mr / mo:.3f} |
| dense GPT (after its first checkpointed forward) | {gr * 1e3:.0f} ms | {go * 1e3:.0f} ms | {gr / go:.3f} |

A routing block runs under replay's dispatch mode in its forward and its recompute (about 10 us per op on the
host, whatever the device); a dense block only in its first checkpointed forward, after which both columns run
the same code: its ratio is the noise of the machine (2 cores shared with other jobs).
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=2048)
    args = parser.parse_args()
    text = report(measure(args.rounds, args.tokens))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "moe_replay.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
