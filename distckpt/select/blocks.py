"""Find the blocks of a model that checkpointing may wrap: by class, predicate, FQN glob, or on
its own (the repeated, same-class children of ``nn.ModuleList``/``nn.Sequential`` containers, and of an
``nn.ModuleDict`` keyed by layer numbers, as torchtitan keeps its ``layers``)."""

from __future__ import annotations

import fnmatch
import logging
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Union

import torch.nn as nn

from distckpt.errors import ConfigError

__all__ = ["BlockSpec", "conditional_reason", "find_blocks", "repeated_block_groups"]

logger = logging.getLogger("distckpt")

BlockSpec = Union[type, str, Callable[[nn.Module], bool], Sequence[Union[type, str]], None]

_CONTAINERS = (nn.ModuleList, nn.Sequential)


def _is_stack(container: nn.Module) -> bool:
    """A container of layers: a ModuleList or Sequential, or a ModuleDict whose keys are layer numbers ("0", "1", ...
    as torchtitan keeps ``layers``, so that FQNs survive a pipeline split that drops some). A ModuleDict keyed by
    names (task heads ``{"lm": ..., "cls": ...}``) is not one."""
    if isinstance(container, _CONTAINERS):
        return True
    return isinstance(container, nn.ModuleDict) and len(container) > 0 and all(k.isdigit() for k in container)


# Modules that run on some inputs only. A mixture-of-experts layer runs each expert on the tokens routed
# to it, so ranks run different experts: such a module cannot be an FSDP unit (nor a block to profile).
# Told by name, as no static property separates "for e in experts: if routed: e(x)" from a stack of layers.
_EXPERTS = re.compile(r"expert", re.IGNORECASE)
_ROUTERS = re.compile(r"^(gate|router|routing|gating|wg|switch)$", re.IGNORECASE)
_CONTAINER_TYPES = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def _container_reason(name: str, container: nn.Module, parent: nn.Module) -> str | None:
    leaf = name.rpartition(".")[2]
    if _EXPERTS.search(leaf):
        return f"{name} looks like a mixture-of-experts expert list"
    routers = [k for k, _ in parent.named_children() if _ROUTERS.match(k)]
    if routers:
        return f"{name} sits beside the router {name.rpartition('.')[0] + '.' if '.' in name else ''}{routers[0]}"
    return None


def conditional_reason(model: nn.Module, fqn: str) -> str | None:
    """Why the module at ``fqn`` probably runs conditionally (it is, or is inside, an expert list or
    a container beside a router), or None."""
    parts = fqn.split(".")
    for k in range(1, len(parts) + 1):
        name = ".".join(parts[:k])
        container = model.get_submodule(name)
        if isinstance(container, _CONTAINER_TYPES):
            parent = model.get_submodule(".".join(parts[: k - 1])) if k > 1 else model
            why = _container_reason(name, container, parent)
            if why:
                return why
    return None


def _outermost(named: Iterable[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """Drop matches nested inside an earlier match: a block is never checkpointed inside another."""
    out: list[tuple[str, nn.Module]] = []
    for name, module in named:
        if any(name.startswith(prev + ".") for prev, _ in out):
            continue
        out.append((name, module))
    return out


def _n_params(modules: Iterable[nn.Module]) -> int:
    seen: dict[int, int] = {}
    for m in modules:
        for p in m.parameters():
            seen[id(p)] = p.numel()
    return sum(seen.values())


def repeated_block_groups(model: nn.Module) -> list[tuple[type, list[tuple[str, nn.Module]], int]]:
    """Same-class children (two or more per container) of ModuleList/Sequential containers and of ModuleDicts keyed
    by layer numbers, grouped by class across the model, most parameters first.

    Returns:
        ``[(block_class, [(fqn, module), ...], n_params), ...]``
    """
    groups: dict[type, list[tuple[str, nn.Module]]] = {}
    for name, container in model.named_modules():
        if not _is_stack(container) or (name and conditional_reason(model, name)):
            continue  # not a container, or an expert list (conditional: never a block on its own)
        prefix = f"{name}." if name else ""
        by_class: dict[type, list[tuple[str, nn.Module]]] = {}
        for k, c in container.named_children():
            # A block distckpt already wraps counts as its original class.
            cls = getattr(type(c), "_distckpt_orig_class", type(c))
            by_class.setdefault(cls, []).append((prefix + k, c))
        for cls, kids in by_class.items():
            if len(kids) >= 2 and cls not in _CONTAINERS:
                groups.setdefault(cls, []).extend(kids)
    scored = [(cls, mods, _n_params(m for _, m in mods)) for cls, mods in groups.items()]
    scored = [g for g in scored if g[2] > 0]
    return sorted(scored, key=lambda g: -g[2])


def _nested(inner: list[tuple[str, nn.Module]], outer: list[tuple[str, nn.Module]]) -> bool:
    return all(any(n.startswith(o + ".") for o, _ in outer) for n, _ in inner)


def _auto_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    groups = repeated_block_groups(model)
    if not groups:
        raise ConfigError(
            f"distckpt.wrap found no repeated blocks in {type(model).__name__} (no nn.ModuleList, nn.Sequential or "
            "nn.ModuleDict keyed '0', '1', ... of two or more same-class modules). Pass blocks= a module class, a "
            "predicate or FQN globs such as blocks='layers.*'."
        )
    chosen = groups[0]
    # Prefer finer blocks nested in the chosen ones when they hold nearly all of their parameters
    # (e.g. the layers of each stage of a Swin model rather than the stages themselves).
    for g in groups[1:]:
        if _nested(g[1], chosen[1]) and g[2] >= 0.8 * chosen[2]:
            chosen = g
    rivals = [
        g
        for g in groups
        if g is not chosen and not _nested(g[1], chosen[1]) and not _nested(chosen[1], g[1]) and g[2] >= 0.5 * chosen[2]
    ]
    if rivals:
        names = ", ".join(f"{g[0].__name__} ({len(g[1])} blocks, {g[2]:,} params)" for g in [chosen, *rivals])
        classes = ", ".join(g[0].__name__ for g in [chosen, *rivals])
        raise ConfigError(
            f"distckpt.wrap cannot tell which repeated blocks to checkpoint: {names}. "
            f"Pass blocks=[{classes}] (or FQN globs) to choose."
        )
    total = _n_params([model])
    logger.info(
        "distckpt.apply.wrap: blocks=None chose %d blocks of class %s (%s, ...; %.0f%% of parameters)",
        len(chosen[1]),
        chosen[0].__name__,
        chosen[1][0][0],
        100.0 * chosen[2] / max(total, 1),
    )
    return list(chosen[1])


def _matcher(spec: type | str | Callable[[nn.Module], bool]) -> Callable[[str, nn.Module], bool]:
    if isinstance(spec, type):
        if not issubclass(spec, nn.Module):
            raise ConfigError(f"blocks= got the class {spec.__name__}, which is not an nn.Module subclass.")
        return lambda name, m: isinstance(m, spec)
    if isinstance(spec, str):
        return lambda name, m: fnmatch.fnmatchcase(name, spec)
    if callable(spec):
        return lambda name, m: bool(spec(m))
    raise ConfigError(f"blocks= takes module classes, a predicate fn(module) -> bool, or FQN globs; got {spec!r}.")


def find_blocks(model: nn.Module, blocks: BlockSpec = None) -> list[tuple[str, nn.Module]]:
    """The candidate blocks of ``model`` in registration order, outermost matches only (usually the order
    they run, not always: HF CLIP runs its second-registered tower first; the budget's profile finds out).

    Args:
        model: the model, before data parallelism.
        blocks: module classes, a predicate ``fn(module) -> bool``, FQN glob strings (a list may
            mix classes and globs), or ``None`` to find the repeated blocks automatically.

    Returns:
        ``[(fqn, module), ...]``; the root module is never a block.

    Raises:
        ConfigError: when nothing matches, or the automatic choice is ambiguous.
    """
    if blocks is None:
        return _auto_blocks(model)
    specs = list(blocks) if isinstance(blocks, (list, tuple, set, frozenset)) else [blocks]
    if not specs:
        raise ConfigError("blocks= is empty; pass None to find blocks automatically, or policy='none'.")
    matchers = [_matcher(s) for s in specs]
    matched = _outermost((name, m) for name, m in model.named_modules() if name and any(f(name, m) for f in matchers))
    if not matched:
        hint = ""
        groups = repeated_block_groups(model)
        if groups:
            cls, mods, _ = groups[0]
            hint = f" The largest repeated blocks are {cls.__name__} at {mods[0][0]}, ...; try blocks={cls.__name__}."
        raise ConfigError(f"blocks={blocks!r} matches no module of {type(model).__name__}.{hint}")
    return matched
