"""Which modules are units of the parallel model and which trainable parameters each holds: the blocks FSDP/FSDP2
shard as their own units (every block ``wrap`` chose among, except an unchecked conditional one), the root's
remainder, and the parameters inside reentrant-checkpointed blocks (their gradients arrive in a nested backward)."""

from __future__ import annotations

import torch.nn as nn

from distckpt.apply.state import candidate_blocks
from distckpt.errors import ConfigError
from distckpt.parallel.param_sync import _Unit, param_owner
from distckpt.runtime.swap import is_checkpointed
from distckpt.select.blocks import conditional_reason

__all__ = ["Owners", "block_units", "reentrant_blocks", "reentrant_params", "refuse_conditional_units", "root_unit"]

Owners = list[tuple[nn.Module, str]]  # per trainable parameter: the submodule holding it and its attribute name


def reentrant_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks checkpointed with ``reentrant=True``."""
    return [m for m in model.modules() if is_checkpointed(m) and m._distckpt_options.reentrant]


def reentrant_params(model: nn.Module, names: list[str]) -> set[int]:
    """Indices (in ``names``) of the trainable parameters inside reentrant-checkpointed blocks."""
    index = {n: i for i, n in enumerate(names)}
    re_blocks = reentrant_blocks(model)
    return {
        index[f"{bn}.{pn}"]
        for bn, b in model.named_modules()
        if b in re_blocks
        for pn, p in b.named_parameters()
        if p.requires_grad
    }


def owners_of(model: nn.Module, names: list[str]) -> Owners:
    """The owner (submodule, attribute) of each trainable parameter in ``names``."""
    return [param_owner(model, n) for n in names]


def root_unit(model: nn.Module, names: list[str], owners: Owners) -> _Unit:
    """DDP's one unit is the root: every trainable parameter joins in the model's forward."""
    return _Unit(model, [(i, *owners[i]) for i in range(len(names))])


def refuse_conditional_units(model: nn.Module, strategy: str) -> None:
    """A block that runs on some ranks only cannot be an FSDP unit: the ranks' all-gathers would pair
    different units' parameters, silently (pytorch#158719). Refused here; the end-of-step check in
    distckpt.parallel.param_sync catches what a name cannot tell."""
    for name, m in model.named_modules():
        if is_checkpointed(m):
            why = conditional_reason(model, name)
            if why:
                raise ConfigError(
                    f"{name} is checkpointed, so {strategy} would make it its own unit, but it runs conditionally "
                    f"({why}): ranks that route differently would pair the all-gathers of different units and "
                    "compute wrong values. Checkpoint and shard the layer that contains the router instead, e.g. "
                    "distckpt.wrap(model) with blocks=None, or blocks=<the layer class>."
                )


def _unit_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules FSDP/FSDP2 shard as their own units: every checkpointed block and every other
    candidate block of ``wrap`` (as torchtitan shards every layer), except a candidate that runs
    conditionally (an expert: ranks would pair different units' all-gathers) and is not checkpointed
    (a checkpointed one is refused before). A kept block in the root unit would stay unsharded for
    the whole step and its gradients until the root's reduce-scatter."""
    chosen = {id(m) for n, m in model.named_modules() if is_checkpointed(m)}
    chosen |= {id(m) for n, m in candidate_blocks(model) if conditional_reason(model, n) is None}
    return [(n, m) for n, m in model.named_modules() if n and id(m) in chosen]


def block_units(
    model: nn.Module, names: list[str], owners: Owners
) -> tuple[list[tuple[str, nn.Module]], list[_Unit], _Unit]:
    """The shard units of FSDP/FSDP2: ``(blocks, their units, the root's unit)``, each trainable parameter in the
    innermost unit holding it (the root's for the rest). Call before sharding: the units keep the owners."""
    blocks = _unit_blocks(model)
    owned: dict[str, list[int]] = {bn: [] for bn, _ in blocks}
    owned[""] = []
    for i, n in enumerate(names):
        home = max((bn for bn, _ in blocks if n.startswith(bn + ".")), key=len, default="")
        owned[home].append(i)
    units = [_Unit(b, [(i, *owners[i]) for i in owned[bn]], bn) for bn, b in blocks]
    return blocks, units, _Unit(model, [(i, *owners[i]) for i in owned[""]])
