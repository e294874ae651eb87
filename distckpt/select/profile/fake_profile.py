"""The profile of a model's sample step on fake tensors (no data, no allocation): the repeated blocks cut
down to a few, traced by :func:`~distckpt.select.profile.profile_model`'s measurement, and the profile
stretched back to every block. ``budget:auto`` plans on it (:func:`estimate_profile`), and so does
``distckpt plan`` (:mod:`distckpt.cli.plan`) for a cluster we cannot run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn

from distckpt import _torch_compat as compat
from distckpt.errors import ConfigError
from distckpt.runtime.selective import share_reach
from distckpt.runtime.swap import checkpointing_disabled
from distckpt.select.profile import profile as _profile
from distckpt.select.profile.profile import ModelProfile

__all__ = ["estimate_profile", "profile_cut"]


def _signature(m: nn.Module) -> tuple[Any, ...]:
    return type(m), tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in m.named_parameters())


def _kept(blocks: list[tuple[str, nn.Module]]) -> tuple[list[int], list[int]]:
    """Which blocks to trace (indices into ``blocks``) and, for every block, the traced one it copies."""
    n = len(blocks)
    sigs = [_signature(m) for _, m in blocks]
    keep = {0, n - 1} | ({1} if n > 2 else set())
    for i, s in enumerate(sigs):
        if s not in {sigs[j] for j in keep}:
            keep.add(i)
    kept = sorted(keep)
    middle = [j for j in kept if j not in (0, n - 1)]
    source = []
    for i in range(n):
        if i in keep:
            source.append(i)
        else:
            source.append(next((j for j in middle if sigs[j] == sigs[i]), next(j for j in kept if sigs[j] == sigs[i])))
    return kept, source


def _cut(model: nn.Module, blocks: list[tuple[str, nn.Module]], kept: list[int]) -> Callable[[], None]:
    """Leave only the ``kept`` blocks in their container (one ``nn.ModuleList``/``Sequential``); returns
    the undo.

    Raises:
        ConfigError: blocks spread over several containers, or a container of another kind.
    """
    parents = {name.rpartition(".")[0] for name, _ in blocks}
    if len(parents) != 1:
        raise ConfigError(
            f"distckpt plan traces blocks of one container; these sit in {sorted(parents)}: "
            "pass blocks= naming one nn.ModuleList's children."
        )
    container = model.get_submodule(parents.pop())
    if not isinstance(container, (nn.ModuleList, nn.Sequential)):
        raise ConfigError(
            f"distckpt plan needs the blocks in an nn.ModuleList or nn.Sequential, not {type(container).__name__}."
        )
    full = dict(container._modules)
    names = [name.rpartition(".")[2] for name, _ in blocks]
    container._modules = {str(k): full[names[j]] for k, j in enumerate(kept)}

    def undo() -> None:
        container._modules = full

    return undo


def _stretch(
    mp: ModelProfile, blocks: list[tuple[str, nn.Module]], kept: list[int], source: list[int], whole: dict[str, int]
) -> ModelProfile:
    """The traced profile extended to every block: block i copies its source's numbers, with each
    gradient count shifted by the trainable bytes of the blocks behind it that the cut removed."""

    def trainable(m: nn.Module) -> int:
        return sum(p.numel() * p.element_size() for p in m.parameters() if p.requires_grad)

    size = [trainable(m) for _, m in blocks]
    after_full = [sum(size[i + 1 :]) for i in range(len(blocks))]
    after_cut = {j: sum(size[k] for k in kept if k > j) for j in kept}
    out = []
    for i, (name, _) in enumerate(blocks):
        b = mp.blocks[kept.index(source[i])]
        d = after_full[i] - after_cut[source[i]]

        def shift(v: int, d: int = d) -> int:
            return v + d if v >= 0 else v

        out.append(
            dataclasses.replace(
                b,
                fqn=name,
                grads_ready_bytes=shift(b.grads_ready_bytes),
                grads_at_peak_bytes=shift(b.grads_at_peak_bytes),
                recompute_grads_bytes=shift(b.recompute_grads_bytes),
                selective_recompute_grads_bytes=shift(b.selective_recompute_grads_bytes),
                pointwise_recompute_grads_bytes=shift(b.pointwise_recompute_grads_bytes),
            )
        )
    if mp.run_order:
        raise ConfigError(
            "distckpt plan and budget:auto trace the blocks of one container in the order they are listed; these run "
            f"in another ({[blocks[kept[k]][0] for k in mp.run_order]}): use budget:SIZE (it measures a real step)."
        )
    lost = sum(size) - sum(size[k] for k in kept)
    tail = mp.tail_grads_bytes + lost if mp.tail_grads_bytes >= 0 else -1
    return dataclasses.replace(mp, blocks=tuple(out), tail_grads_bytes=tail, **whole)


def profile_cut(
    root: nn.Module, model: nn.Module, found: list[tuple[str, nn.Module]], call: Any, *, prefix: str = ""
) -> tuple[ModelProfile, list[int]]:
    """Under a fake mode: ``found`` (blocks of ``model``, which ``root`` runs) cut to the traced ones, the
    sample step measured and stretched back to every block (the profile measures each traced block's
    full and selective recompute: held bytes, peaks, FLOPs, so the ``selective`` row and the budget's
    per-block choice use that one model of both). Returns ``(profile, traced block indices)``.

    Raises:
        ConfigError: the model reads tensor values while it runs (fake tensors have none).
    """
    whole = _profile.parameter_fields(root, found)  # of the whole model, before the cut
    kept, source = _kept(found)
    undo = _cut(model, found, kept)
    cut = [(prefix + found[j][0], found[j][1]) for j in kept]
    try:
        with checkpointing_disabled(model):
            # _measure, not profile_model: no cache entry for a cut model, and the ranks agree outside the
            # fake mode (estimate_profile), where a collective has real tensors.
            mp = _stretch(_profile._measure(root, cut, call), found, kept, source, whole)
        for (_, block), (_, traced) in zip(found, (found[j] for j in source)):
            if block is not traced:  # its numbers are the traced block's: so is what its recompute reads
                share_reach(traced, block)
    except (RuntimeError, NotImplementedError) as e:
        # FakeTensorMode's own errors (DataDependentOutputException, ...) live in torch._subclasses.
        if type(e).__module__.startswith("torch._subclasses") or "data-dependent" in str(e):
            raise ConfigError(
                f"distckpt plan and budget:auto run the model on fake tensors (no values); it read a "
                f"value: {e}. Make the model's forward shape-only (or, in wrap, give budget:SIZE, "
                "which measures a real step)."
            ) from e
        raise
    finally:
        undo()
    return mp, kept


@contextlib.contextmanager
def _fake_tensors(model: nn.Module, mode: Any) -> Iterator[None]:
    """``model``'s parameters and buffers swapped for fake copies of ``mode`` (same shapes, dtypes, devices
    and ``requires_grad``; tied ones stay tied; no memory) inside the context, the real ones put back after."""
    fakes: dict[int, torch.Tensor] = {}
    swapped: list[tuple[nn.Module, str, torch.Tensor]] = []
    try:
        for mod in model.modules():
            own = [*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)]
            for name, t in own:
                if id(t) not in fakes:
                    fake = mode.from_tensor(t)
                    with mode:
                        fakes[id(t)] = nn.Parameter(fake, t.requires_grad) if isinstance(t, nn.Parameter) else fake
                swapped.append((mod, name, t))
                setattr(mod, name, fakes[id(t)])
        yield
    finally:
        for mod, name, t in reversed(swapped):
            setattr(mod, name, t)


def estimate_profile(model: nn.Module, blocks: list[tuple[str, nn.Module]], example_inputs: Any) -> ModelProfile:
    """The profile of ``model``'s sample step as ``distckpt plan`` estimates it: on fake copies of its
    parameters, buffers and inputs (no memory, no values), the repeated blocks traced once per shape
    (``budget:auto`` on CUDA: a real sample step of a model near the device's size could run out of memory).
    The real tensors are left as they were; under ``torch.distributed`` every rank gets the same numbers.
    Cached per model, block list and input shapes, as :func:`~distckpt.select.profile.profile_model` is.

    Args:
        model: the model, its ``blocks`` (``[(fqn, module), ...]`` in forward order) not yet checkpointed.
        example_inputs: as :func:`distckpt.select.profile.profile_model` takes them.

    Returns:
        A :class:`ModelProfile` of every block.

    Raises:
        ConfigError: the model reads tensor values in forward (it cannot run on fake tensors), or its
            blocks do not sit in one ``nn.ModuleList``/``nn.Sequential``.
    """
    args, kwargs = _profile.as_args(example_inputs)
    # Cached as profile_model's measures are (same key): budget:auto plans again at parallelize, and a
    # trace is seconds even for a small model.
    key = _profile._cache_key(model, blocks, example_inputs)
    cache = _ESTIMATES.setdefault(model, {})
    if key not in cache:
        mode = compat.fake_mode()
        with _fake_tensors(model, mode):
            fake_inputs = compat.tree_map(
                lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, (args, kwargs)
            )
            with mode:
                mp, _ = profile_cut(model, model, blocks, _profile.Call(*fake_inputs))
        cache[key] = _profile._agree(mp)
    return cache[key]


# Per model: {(blocks, input shapes, training, world size): the estimated profile} (see profile._CACHE).
_ESTIMATES: weakref.WeakKeyDictionary[nn.Module, dict[Any, ModelProfile]] = weakref.WeakKeyDictionary()
