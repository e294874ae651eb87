"""Write docs/models.md (the supported-model table) from what tests/unit/test_zoo.py measured.

ZOO_REPORT=/tmp/zoo.json .venv/bin/pytest tests/unit/test_zoo.py -m "slow or not slow"
.venv/bin/python tests/zoo_table.py /tmp/zoo.json docs/models.md
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

import zoo  # tests/, the script's own folder: first on the path


def _mark(r: dict, check: str) -> str:
    if r.get(check) is True:
        return "yes"
    if f"xfail_{check}" in r:
        return "**no** (see notes)"
    return "not run"


def _kib(n: int) -> str:
    return f"{n / 1024:.1f}"


def table(results: dict[str, dict]) -> str:
    import torch
    import transformers

    rows = [
        "# Supported models",
        "",
        f"Measured by `tests/unit/test_zoo.py` (torch {torch.__version__}, transformers {transformers.__version__}, "
        f"CPU, {platform.machine()}) on tiny models built from their configs (random init, no download; sizes in "
        "`tests/zoo.py`): dropout 0.1, a padded batch with a real attention mask where the model takes one. "
        "Regenerate with `tests/zoo_table.py`.",
        "",
        "- **blocks**: what `distckpt.wrap(model)` picks with `blocks=None` (class, first FQN, count).",
        '- **grads**: `policy="full"` gradients and loss bitwise equal (`torch.equal`) to the model without '
        "checkpointing (seeded dropout; `state_dict` keys unchanged).",
        "- **peak vs HF**: MemTracker peak of one forward/backward, distckpt `full` / Hugging Face "
        "`activation_checkpointing_enable(use_reentrant=False)` on the same layers / no checkpointing, in KiB.",
        "- **selective**, **budget**: bitwise exact (budget: at the midpoint of the full and no-checkpoint peaks); "
        "budget at 25%, 50% and 75% of the way from the full peak to the no-checkpoint one: the measured peak at or "
        "under each (KiB) and how many blocks the planner checkpointed.",
        "- **planner**: the budget's memory model against MemTracker, each in its own pass, on that many "
        "choices of checkpointed blocks (all 16 in the full run): never below the measured peak nor more than 3% "
        "above it, exact with none checkpointed on all but LoRA (+1168 B there); the largest over-prediction in bytes.",
        "",
        "| family | HF class | blocks chosen | grads | peak vs HF (KiB) | selective | budget | planner | notes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, fam in zoo.FAMILIES.items():
        r = results.get(name, {})
        blocks = r.get("blocks")
        blocks_s = (
            f"{', '.join(blocks)} (`{r.get('fqn')}`, {r.get('n_blocks')})"
            if isinstance(blocks, list)
            else _mark(r, "blocks")
        )
        if "peak" in r:
            explained = "< (explained in notes)" if "peak_hf_note" in r else "> (routing replay, in notes)"
            noted = "peak_hf_note" in r or "peak_replay_note" in r
            same = "=" if r["peak"] == r["peak_hf"] else (explained if noted else "**!=**")
            peak = f"{_kib(r['peak'])} {same} {_kib(r['peak_hf'])} / {_kib(r['peak_none'])}"
        else:
            peak = _mark(r, "peak")
        if r.get("budget_exact") is True and "budget_points" in r:
            points = "; ".join(
                f"{round(100 * p['frac'])}%: {_kib(p['peak'])} <= {_kib(p['budget'])}, {p['blocks']} blocks"
                for p in r["budget_points"]
            )
            budget = f"yes ({points})"
        elif r.get("budget_exact") is True:
            budget = f"yes ({_kib(r['peak_budget'])} <= {_kib(r['budget'])}, {r['budget_blocks']} blocks)"
        else:
            budget = _mark(r, "budget")
        notes = [fam.notes] if fam.notes else []
        if r.get("ambiguous"):
            notes.append("blocks=None refuses (ConfigError naming both layer classes); pass both")
        if fam.kind in ("decoder", "moe", "seq2seq"):
            notes.append("cache dropped in training")
        if "peak_hf_note" in r:
            notes.append(
                f"HF's peak is {r['peak_hf_note']} B higher: its activation_checkpointing_enable also sets "
                "T5Attention.gradient_checkpointing, which makes the cross-attention's zero position bias "
                "require grad (kept for backward, and its gradient computed); with that flag off, equal "
                f"({_kib(r['peak_hf_without_bias_grad'])} KiB)"
            )
        if "peak_replay_note" in r:
            notes.append(
                f"{r['peak_replay_note']} B over HF's peak: routing replay keeps a layer's routing (56 B per token) "
                "until its backward ([moe.md](moe.md)); without it (`routing_replay_disabled`), equal"
            )
        notes += [f"known failure, {k[len('xfail_') :]}: {v}" for k, v in sorted(r.items()) if k.startswith("xfail_")]
        if "prediction_choices" in r:
            planner = f"{r['prediction_choices']} choices, +{r['prediction_max_slack']} B"
        else:
            planner = _mark(r, "prediction")
        rows.append(
            f"| {name} | {r.get('hf_class', '?')} | {blocks_s} | {_mark(r, 'exact')} | {peak} | "
            f"{_mark(r, 'selective')} | {budget} | {planner} | {'; '.join(notes)} |"
        )
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    src, dst = sys.argv[1], sys.argv[2]
    Path(dst).parent.mkdir(parents=True, exist_ok=True)
    Path(dst).write_text(table(json.loads(Path(src).read_text())))
