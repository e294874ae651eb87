"""The memory planner behind ``budget:SIZE``: the per-block choice of none, pointwise, selective, full or
offload with the least recompute whose predicted peak fits the budget. program (the peak-memory model and
the exact Pareto program over blocks) over memory_terms (static, FSDP per-phase and accumulation terms,
per-block bounds); planner (a ``Budget`` policy's plan on a model: its profile, the budget in bytes, the
offload price).

Everything outside this package imports from here.
"""

from distckpt.select.budget.memory_terms import OPTIMIZER_STATES, optimizer_terms, shards, static_bytes
from distckpt.select.budget.planner import auto_budget, budget_profile, offload_offered, select_for_budget
from distckpt.select.budget.program import MODES, BudgetPlan, human_bytes, plan_budget, predicted_peak

__all__ = [
    "MODES",
    "OPTIMIZER_STATES",
    "BudgetPlan",
    "auto_budget",
    "budget_profile",
    "human_bytes",
    "offload_offered",
    "optimizer_terms",
    "plan_budget",
    "predicted_peak",
    "select_for_budget",
    "shards",
    "static_bytes",
]
