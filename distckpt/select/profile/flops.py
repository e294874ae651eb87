"""A ``FlopCounterMode`` that also counts CPU attention: torch 2.13 has FLOP formulas for the CUDA
``scaled_dot_product_attention`` kernels but none for the CPU one, so on CPU every attention FLOP
(forward, backward, recompute) was left out of profiles, budget plans and benchmarks.

:func:`flop_counter` is the one place distckpt makes a counter. It passes the missing formulas
through the public ``custom_mapping`` argument, per counter: nothing is registered globally, so a
user's own ``FlopCounterMode`` is unchanged by importing distckpt. The arithmetic is torch's own
(``sdpa_flop_count``/``sdpa_backward_flop_count``, what it uses for the CUDA flash kernel), so CPU
and CUDA counts agree:

- causal attention is counted as full attention (torch does the same for every kernel);
- grouped-query attention (``enable_gqa``: fewer key/value heads) is counted per query head;
- ``scale`` and an ``attn_mask`` cost nothing (pointwise), as in torch's CUDA formulas;
- dropout and a value width other than the query's never reach the CPU kernel (``sdpa`` runs its
  math path, whose ``bmm`` ops torch already counts);
- the backward counts the recompute of the scores the kernel does (5 matmuls), so a backward is one
  ``q @ k^T`` above the 4 matmuls of attention written out as ``bmm`` + ``softmax``.
"""

from __future__ import annotations

from math import prod
from typing import Any

from torch.utils.flop_counter import FlopCounterMode

from distckpt import _torch_compat as compat

__all__ = ["attention_flop_formulas", "flop_counter"]


def _as_4d(shape: Any) -> tuple[int, ...]:
    """``[batch..., heads, seq, dim]`` as ``[batch, heads, seq, dim]`` (torch's count functions take
    exactly four dims; the CPU kernel gets four in torch 2.13, this keeps a future caller safe)."""
    shape = tuple(shape)
    if len(shape) <= 4:
        return (1,) * (4 - len(shape)) + shape
    return (prod(shape[:-3]), *shape[-3:])


def _cpu_flash_forward(
    query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, out_shape: Any = None, **kwargs: Any
) -> int:
    forward, _ = compat.sdpa_flop_count_fns()
    return forward(_as_4d(query_shape), _as_4d(key_shape), _as_4d(value_shape))


def _cpu_flash_backward(
    grad_out_shape: Any,
    query_shape: Any,
    key_shape: Any,
    value_shape: Any,
    *args: Any,
    out_shape: Any = None,
    **kwargs: Any,
) -> int:
    _, backward = compat.sdpa_flop_count_fns()
    return backward(_as_4d(grad_out_shape), _as_4d(query_shape), _as_4d(key_shape), _as_4d(value_shape))


def attention_flop_formulas() -> dict[Any, Any]:
    """The formulas :func:`flop_counter` adds, as a ``custom_mapping`` for ``FlopCounterMode``
    (op packet -> formula on shapes): for users who build their own counter. Empty on a torch
    build without the CPU kernel."""
    ops = compat.cpu_flash_attention_ops()
    if ops is None:
        return {}
    return {ops[0]: _cpu_flash_forward, ops[1]: _cpu_flash_backward}


def flop_counter(**kwargs: Any) -> FlopCounterMode:
    """A ``FlopCounterMode(display=False, ...)`` that also counts CPU attention.

    Args:
        **kwargs: passed to ``FlopCounterMode`` (``display`` defaults to False); a ``custom_mapping``
            given here is applied over the attention formulas.

    Returns:
        The counter, to use as a context manager (``get_total_flops()`` afterwards).
    """
    kwargs.setdefault("display", False)
    kwargs["custom_mapping"] = {**attention_flop_formulas(), **(kwargs.get("custom_mapping") or {})}
    return FlopCounterMode(**kwargs)
