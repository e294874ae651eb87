"""How close ``distckpt plan`` (fake tensors, a few traced blocks) comes to MemTracker's measured peak of
a real steady-state AdamW step, per model and policy (none, full, pointwise, selective, a budget plan), one rank.

    python -m benchmarks.plan_accuracy   # writes benchmarks/results/plan_accuracy.md

The cases are tests/plan_cases.py's; ``distckpt plan --factory benchmarks.plan_accuracy:make_llama_70b`` (docs/plan.md)
plans its 70B-shaped model.
"""

from __future__ import annotations

from pathlib import Path

import torch
from plan_cases import compare, compare_dist, gpt_factory, hf_factory, make_gpt, make_llama_70b, mlp_factory

from benchmarks.ranks import run_ranks

# The factories too: `distckpt plan --factory benchmarks.plan_accuracy:make_llama_70b` (docs/plan.md).
__all__ = ["main", "make_gpt", "make_llama_70b"]

RESULTS = Path(__file__).parent / "results" / "plan_accuracy.md"


DIST_NOTE = (
    "FSDP2: parallelize makes every block its own unit, checkpointed or not; the memory model counts "
    "what FSDP2 holds unsharded phase by phase (a block's parameters, the prefetched one's, the all-gather "
    "output and reduce-scatter input, the gradients made so far: distckpt/select/budget/memory_terms.py `_Sharded`). "
    "Counting two blocks' unsharded parameters and one block's gradients at every peak (before) was up "
    "to 5.7% high."
)
DIST = [("MultiTaskGPT", "gpt", 4), ("MultiTaskMLP", "mlp", 4), ("gpt2", "hf", "gpt2")]


MODELS = {
    "MultiTaskGPT": gpt_factory(),
    "MultiTaskMLP": mlp_factory(),
    "gpt2": hf_factory("gpt2"),
    "llama": hf_factory("llama"),
}


def main() -> None:
    lines = [
        "# distckpt plan: predicted vs measured peak (one rank, CPU, MemTracker)",
        "",
        f"torch {torch.__version__}; fake-tensor plan vs a real steady-state AdamW step; "
        "error = predicted / measured - 1.",
        "",
        "| model | policy | predicted MiB | measured MiB | error |",
        "|---|---|---|---|---|",
    ]
    for name, factory in MODELS.items():
        for policy, (pred, meas) in compare(factory).items():
            lines.append(
                f"| {name} | {policy} | {pred / 2**20:.2f} | {meas / 2**20:.2f} | {100 * (pred / meas - 1):+.1f}% |"
            )
            print(lines[-1], flush=True)
    lines += [
        "",
        "## 2 gloo ranks (per rank; DDP's gradient bucket counted)",
        "",
        "| model | strategy | policy | predicted MiB | measured MiB | error |",
        "|---|---|---|---|---|---|",
    ]
    for name, kind, arg in DIST:
        for strategy, results in compare_dist(kind, arg, ("ddp", "fsdp2"), run_ranks=run_ranks).items():
            for policy, (pred, meas) in results.items():
                lines.append(
                    f"| {name} | {strategy} | {policy} | {pred / 2**20:.2f} | {meas / 2**20:.2f} | "
                    f"{100 * (pred / meas - 1):+.1f}% |"
                )
                print(lines[-1], flush=True)
    lines += ["", DIST_NOTE]
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
