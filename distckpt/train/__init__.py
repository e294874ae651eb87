"""Training-loop pieces the launcher composes: models, step-indexed data, checkpoints, metrics, the loop.

Torch only: Hydra lives in ``launch/``; tqdm, TensorBoard, wandb, scikit-learn and transformers are
imported lazily where they are used.
"""

from distckpt.train.callbacks import Callback
from distckpt.train.checkpoint import (
    TrainState,
    check_compatible,
    latest_checkpoint,
    load_checkpoint,
    resume_latest,
    save_checkpoint,
)
from distckpt.train.integrity import verify_checkpoint
from distckpt.train.loop import LoopOptions, LoopResult, NonFiniteLossError, fit
from distckpt.train.metrics import MetricSink, format_summary

__all__ = [
    "Callback",
    "LoopOptions",
    "LoopResult",
    "MetricSink",
    "NonFiniteLossError",
    "TrainState",
    "check_compatible",
    "fit",
    "format_summary",
    "latest_checkpoint",
    "load_checkpoint",
    "resume_latest",
    "save_checkpoint",
    "verify_checkpoint",
]
