"""Training-loop pieces the launcher composes: models, step-indexed data, checkpoints, metrics, the loop.

Torch only: Hydra lives in ``launch/``; tqdm, TensorBoard, wandb, scikit-learn and transformers are
imported lazily where they are used.
"""

from distckpt.train.checkpoint import TrainState, latest_checkpoint, load_checkpoint, save_checkpoint
from distckpt.train.loop import LoopOptions, LoopResult, NonFiniteLossError, fit
from distckpt.train.metrics import MetricSink, format_summary

__all__ = [
    "LoopOptions",
    "LoopResult",
    "MetricSink",
    "NonFiniteLossError",
    "TrainState",
    "fit",
    "format_summary",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
]
