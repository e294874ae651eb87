"""Old home of the run-time guards, kept so ``from distckpt.guards import ...`` still works.

:class:`GradSyncGuard` lives in :mod:`distckpt.check.sync_guard`, :func:`verify_recompute` in
:mod:`distckpt.check.recompute`.
"""

from distckpt.check.recompute import Mismatch, RecomputeReport, verify_recompute
from distckpt.check.sync_guard import GradSyncGuard, GuardReport, NoGradientError

__all__ = [
    "GradSyncGuard",
    "GuardReport",
    "Mismatch",
    "NoGradientError",
    "RecomputeReport",
    "verify_recompute",
]
