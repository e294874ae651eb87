"""Chunked feed-forward: run a position-wise module (a transformer MLP) on slices of the sequence,
so its wide hidden activation exists for one slice at a time (Hugging Face's
``apply_chunking_to_forward`` idea, made to save memory in training too).

Each slice runs under non-reentrant ``torch.utils.checkpoint``: it keeps only its input (a view of
the module's input, no new memory) and recomputes its hidden activation slice by slice in backward.
Like :func:`distckpt.apply.wrap`, the module's class is swapped for a subclass, so parameter names stay.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.utils.checkpoint as tuc

from distckpt.errors import ConfigError

__all__ = ["chunk_feed_forward", "is_chunked", "unchunk_feed_forward"]


@dataclass(frozen=True)
class _ChunkOptions:
    chunk_size: int
    dim: int
    checkpoint: bool


class _ChunkedMixin:
    _distckpt_chunk: _ChunkOptions

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        inner = super().forward  # type: ignore[misc]
        opts = self._distckpt_chunk
        lead = args[0] if args else None
        if not isinstance(lead, torch.Tensor) or lead.dim() == 0:
            raise ConfigError(
                f"chunk_feed_forward: {type(self).__name__} must take the tensor to chunk as its first "
                "positional argument."
            )
        dim = opts.dim % lead.dim()
        length = lead.shape[dim]
        if length <= opts.chunk_size:
            return inner(*args, **kwargs)
        # Every positional tensor with the same length along ``dim`` is sliced with the first one.
        sliced = [isinstance(a, torch.Tensor) and a.dim() > dim and a.shape[dim] == length for a in args]
        pieces = [a.split(opts.chunk_size, dim) if s else None for a, s in zip(args, sliced)]
        n = len(pieces[0])
        ckpt = opts.checkpoint and torch.is_grad_enabled()
        outs = []
        for k in range(n):
            chunk_args = tuple(p[k] if p is not None else a for a, p in zip(args, pieces))
            if ckpt:
                outs.append(tuc.checkpoint(inner, *chunk_args, use_reentrant=False, **kwargs))
            else:
                outs.append(inner(*chunk_args, **kwargs))
        if not all(isinstance(o, torch.Tensor) for o in outs):
            raise ConfigError(
                f"chunk_feed_forward: {type(self).__name__} must return one tensor to be chunked; "
                "chunk a submodule that does."
            )
        return torch.cat(outs, dim)


_CLASSES: dict[type, type] = {}


def is_chunked(module: nn.Module) -> bool:
    """Whether :func:`chunk_feed_forward` was applied to ``module``."""
    return isinstance(module, _ChunkedMixin)


def chunk_feed_forward(module: nn.Module, chunk_size: int, dim: int = 1, *, checkpoint: bool = True) -> nn.Module:
    """Make ``module`` run on slices of ``chunk_size`` along ``dim`` of its first input, in place.

    Only exact for position-wise modules (each position's output depends on that position alone:
    MLPs, not attention). Outputs and gradients are those of the unchunked module up to float
    rounding of the smaller matmuls. Calling it again changes the options.

    Args:
        module: the feed-forward module (e.g. a transformer block's MLP).
        chunk_size: positions per slice (>= 1).
        dim: the sequence dimension of the input (1 for ``(batch, seq, dim)``).
        checkpoint: recompute each slice in backward, so that training holds one slice's hidden
            activation at a time; ``False`` lowers only no-grad (inference) peaks.

    Returns:
        ``module``.

    Raises:
        ConfigError: a chunk size below 1.
    """
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ConfigError(f"chunk_feed_forward needs an integer chunk_size >= 1, got {chunk_size!r}.")
    cls = type(module)
    if not is_chunked(module):
        if cls not in _CLASSES:
            _CLASSES[cls] = type(f"Chunked{cls.__name__}", (_ChunkedMixin, cls), {"_distckpt_chunk_orig": cls})
        module.__class__ = _CLASSES[cls]
    module._distckpt_chunk = _ChunkOptions(chunk_size, dim, checkpoint)
    return module


def unchunk_feed_forward(module: nn.Module) -> nn.Module:
    """Undo :func:`chunk_feed_forward` on ``module`` (in place).

    Returns:
        ``module``.
    """
    if is_chunked(module):
        module.__class__ = module._distckpt_chunk_orig
        del module._distckpt_chunk
    return module
