"""Old home of the run-time guards, kept so ``from distckpt.guards import ...`` still works.

:class:`GradSyncGuard` lives in :mod:`distckpt.sync_guard`, :func:`verify_recompute` in
:mod:`distckpt.recompute_check`.
"""

from distckpt.recompute_check import Mismatch, RecomputeReport, verify_recompute
from distckpt.sync_guard import GradSyncGuard, GuardReport, NoGradientError

__all__ = [
    "GradSyncGuard",
    "GuardReport",
    "Mismatch",
    "NoGradientError",
    "RecomputeReport",
    "verify_recompute",
]
