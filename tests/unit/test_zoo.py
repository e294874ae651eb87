"""distckpt on tiny Hugging Face models of 24 families (tests/zoo.py), dropout on, padded batches:
blocks=None picks the layers, gradients bitwise equal to no checkpointing, state_dict keys kept,
peak memory equal to Hugging Face's own checkpointing on the same layers (MemTracker; T5: HF's
extra position-bias gradient accounted for), ``selective`` and ``budget`` exact (the budget never
exceeded at 25%, 50% and 75% between the two peaks, LoRA included), and the budget's memory model
never below the measured peak.

The memory checks of most families are marked ``slow`` and skipped unless ``-m`` names slow
(``-m "slow or not slow"`` runs everything). Set ``ZOO_REPORT=FILE.json`` to record what each
check measured; ``tests/zoo_table.py`` turns that file into docs/models.md.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import itertools
import json
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import zoo
from models import hf_checkpointing_enable

import distckpt
from distckpt import Budget, ConfigError
from distckpt.apply.wrap import is_checkpointed
from distckpt.select.budget import plan_budget, predicted_peak
from distckpt.select.policies import Placement
from distckpt.select.profile import memory_tracker, profile_model

# Skipped without transformers, which the zoo's builders import when they run, not at collection (by every
# pytest-xdist worker).
pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
CPU = torch.device("cpu")
NAMES = list(zoo.FAMILIES)
# Failures whose cause lies in the library, not in this test: (family, check) -> reason.
XFAIL: dict[tuple[str, str], str] = {}
RESULTS: dict[str, dict[str, Any]] = {n: {} for n in NAMES}


# The memory checks (MemTracker passes, the budget's profile) of these run by default; those of the
# other families are marked slow (tens of seconds each on a 2-core CPU). Run all: -m "slow or not slow".
FAST_MEMORY = ("gpt2", "llama", "llama_lora", "bert", "t5", "mixtral", "bart", "clip")


def _params(check: str, memory: bool = False) -> list[Any]:
    out = []
    for n in NAMES:
        marks = [pytest.mark.xfail(strict=True, reason=XFAIL[(n, check)])] if (n, check) in XFAIL else []
        if memory and n not in FAST_MEMORY:
            marks.append(pytest.mark.slow)
        out.append(pytest.param(n, marks=marks))
    return out


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    path = os.environ.get("ZOO_REPORT")
    if path:
        for (n, check), reason in XFAIL.items():
            RESULTS[n][f"xfail_{check}"] = reason
        Path(path).write_text(json.dumps(RESULTS, indent=1, sort_keys=True))


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # HF config/deprecation and distckpt's one-time cache warnings
        yield


def _classes(model: torch.nn.Module, names: tuple[str, ...]) -> list[type]:
    found = {type(m).__name__: type(m) for m in model.modules()}
    return [found[n] for n in names]


def _wrap(fam: zoo.Family, model: torch.nn.Module, policy: Any = "full", **kw: Any) -> str | None:
    """``distckpt.apply.wrap`` with ``blocks=None``; when it refuses to choose between two stacks' layer
    classes (encoder-decoders), check the error names both and pass them. Returns the error text."""
    try:
        distckpt.wrap(model, policy, **kw)
        return None
    except ConfigError as e:
        if len(fam.blocks) < 2 or not all(n in str(e) for n in fam.blocks):
            raise
        distckpt.wrap(model, policy, blocks=_classes(model, fam.blocks), **kw)
        return str(e)


def _wrapped_copy(fam: zoo.Family, plain: torch.nn.Module, policy: Any = "full", **kw: Any) -> torch.nn.Module:
    """A copy of the family's reference model with ``policy`` applied (the reference stays plain)."""
    model = copy.deepcopy(plain)
    _wrap(fam, model, policy, **kw)
    return model


def _zero(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


def _step(fam: zoo.Family, model: torch.nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, dict]:
    """Loss and gradients of one forward/backward, dropout seeded right before the forward."""
    _zero(model)
    torch.manual_seed(1)
    loss = fam.loss(model, batch)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    _zero(model)
    return loss.detach(), grads


_PEAKS: dict[tuple[str, str], int] = {}


def _cached_peak(name: str, policy: str) -> int:
    """Peak of the plain model (``"none"``) or of distckpt's ``"full"``, measured once per family."""
    if (name, policy) not in _PEAKS:
        fam = zoo.FAMILIES[name]
        plain, batch, _ = _reference(name)
        model = plain
        if policy == "full":
            model = _wrapped_copy(fam, plain)
        _PEAKS[(name, policy)] = _peak(fam, model, batch)
    return _PEAKS[(name, policy)]


def _peak(fam: zoo.Family, model: torch.nn.Module, batch: dict[str, Any]) -> int:
    """Peak bytes (MemTracker) of one forward/backward, in a pass of its own."""
    _zero(model)
    tracker = memory_tracker(model, *[v for v in batch.values() if isinstance(v, torch.Tensor)])
    with tracker:
        torch.manual_seed(1)
        loss = fam.loss(model, batch)
        loss.backward()
        del loss
    _zero(model)
    return tracker.get_tracker_snapshot("peak")[CPU]["Total"]


_REF: dict[str, tuple[torch.nn.Module, dict[str, Any], tuple[torch.Tensor, dict]]] = {}


def _reference(name: str) -> tuple[torch.nn.Module, dict[str, Any], tuple[torch.Tensor, dict]]:
    """The plain model (never modified), its batch, and its loss and gradients."""
    if name not in _REF:
        fam = zoo.FAMILIES[name]
        model, batch = fam.build(), fam.batch(0)
        # Without the KV cache, as a checkpointed layer runs in training (distckpt and HF alike): with
        # it, T5's decoder attends to concatenated cache tensors and its gradients move by 1 ulp.
        plain_batch = {**batch, "use_cache": False} if fam.kind in ("decoder", "moe", "seq2seq") else batch
        _REF[name] = (model, batch, _step(fam, model, plain_batch))
    return _REF[name]


def _assert_exact(ref: tuple[torch.Tensor, dict], got: tuple[torch.Tensor, dict]) -> None:
    assert torch.equal(ref[0], got[0]), (ref[0], got[0])
    assert ref[1].keys() == got[1].keys()
    bad = [
        n
        for n, g in ref[1].items()
        if not (g is None and got[1][n] is None) and (g is None or got[1][n] is None or not torch.equal(g, got[1][n]))
    ]
    assert not bad, f"gradients differ: {bad[:5]}"


def _block_classes(model: torch.nn.Module) -> set[str]:
    return {type(m)._distckpt_orig_class.__name__ for m in model.modules() if is_checkpointed(m)}


@pytest.mark.parametrize("name", _params("blocks"))
def test_blocks_none_picks_the_layers(name):
    fam = zoo.FAMILIES[name]
    model = copy.deepcopy(_reference(name)[0])
    err = _wrap(fam, model)
    chosen = distckpt.checkpointed(model)
    assert _block_classes(model) == set(fam.blocks), chosen
    n_layers = sum(type(m).__name__ in fam.blocks for m in _reference(name)[0].modules())
    assert len(chosen) == n_layers == zoo.LAYERS
    RESULTS[name].update(
        blocks=sorted(fam.blocks),
        fqn=chosen[0],
        n_blocks=len(chosen),
        ambiguous=bool(err),
        hf_class=type(_reference(name)[0]).__name__,
    )


@pytest.mark.parametrize("name", _params("exact"))
def test_full_gradients_bitwise_and_names_kept(name):
    fam = zoo.FAMILIES[name]
    plain, batch, ref = _reference(name)
    model = _wrapped_copy(fam, plain)
    assert list(model.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
    _assert_exact(ref, _step(fam, model, batch))
    RESULTS[name]["exact"] = True


@pytest.mark.parametrize("name", _params("peak", memory=True))
def test_peak_equals_hf_checkpointing(name):
    fam = zoo.FAMILIES[name]
    plain, batch, ref = _reference(name)
    theirs = copy.deepcopy(plain)
    hf_checkpointing_enable(theirs, use_reentrant=False)
    if hasattr(theirs, "disable_input_require_grads"):
        # HF makes the embedding output require grad (for frozen embeddings under reentrant
        # checkpointing); non-reentrant needs no such hook, and distckpt adds none. With trainable
        # embeddings it changes nothing; under LoRA it adds a gradient of the embedding output.
        theirs.disable_input_require_grads()
    _assert_exact(ref, _step(fam, theirs, batch))  # HF's checkpointing is exact too: same placement, same RNG
    p_ours, p_theirs, p_none = _cached_peak(name, "full"), _peak(fam, theirs, batch), _cached_peak(name, "none")
    RESULTS[name].update(peak=p_ours, peak_hf=p_theirs, peak_none=p_none)
    if name == "t5":
        # gradient_checkpointing_enable also sets T5Attention.gradient_checkpointing, and then the
        # cross-attention's zero position bias (1, heads, target, source), which has no relative
        # bias to learn, is made to require grad (a workaround for reentrant checkpointing): it
        # joins the graph (kept for backward) and backward computes its gradient. Off, equal peaks.
        extra = 2 * zoo.HEADS * batch["labels"].shape[1] * batch["input_ids"].shape[1] * 4
        RESULTS[name]["peak_hf_note"] = extra
        assert p_theirs - p_ours == extra, (p_ours, p_theirs, extra)
        for m in theirs.modules():
            if type(m).__name__ == "T5Attention":
                m.gradient_checkpointing = False
        p_theirs = _peak(fam, theirs, batch)
        RESULTS[name]["peak_hf_without_bias_grad"] = p_theirs
    if fam.kind == "moe":
        # Routing replay (docs/moe.md) keeps each layer's top-2 values (fp32) and indices (int64) and the grouped
        # experts' sort of the 2 expert ids (int64 values and indices), 56 B per token, from the layer's forward to
        # its backward; at the peak (the first layer's backward) one layer's are alive. Without replay: HF's peak.
        extra = zoo.BATCH * zoo.SEQ * 2 * (4 + 8 + 8 + 8)
        RESULTS[name]["peak_replay_note"] = extra
        assert p_ours - p_theirs == extra, (p_ours, p_theirs, extra)
        model = _wrapped_copy(fam, plain)
        with distckpt.routing_replay_disabled(model):
            p_ours = _peak(fam, model, batch)
    assert p_ours == p_theirs, (p_ours, p_theirs, p_ours - p_theirs)
    # No assertion against p_none: at this size several models (GPT-NeoX, OPT, Falcon, MoE,
    # DistilBERT, Whisper) peak in the head (logits and loss), where checkpointing saves nothing and
    # the checkpointed layers' saved inputs (and RNG states) add a few hundred bytes, for HF too.


@pytest.mark.parametrize("name", _params("selective"))
def test_selective_exact(name):
    fam = zoo.FAMILIES[name]
    plain, batch, ref = _reference(name)
    model = _wrapped_copy(fam, plain, "selective")
    _assert_exact(ref, _step(fam, model, batch))
    RESULTS[name]["selective"] = True


# Where between the two measured peaks (no checkpointing, every block full) the budgets lie.
BUDGET_POINTS = (0.25, 0.5, 0.75)


@pytest.mark.parametrize("name", _params("budget", memory=True))
def test_budget_never_exceeded_and_exact(name):
    """At 25%, 50% and 75% of the way from full's measured peak to no checkpointing's, the plan's measured
    peak is at or below the budget (issue 26: HF CLIP went 0.74% over at the midpoint), and the midpoint's
    gradients are exact. One profile for the three plans (:func:`_profile`), each placed as ``budget``
    places it (:class:`~distckpt.select.policies.Placement` of the plan's modes); the midpoint through
    ``budget:SIZE`` itself (``wrap`` plans on the same, cached, profile)."""
    fam = zoo.FAMILIES[name]
    plain, batch, ref = _reference(name)
    p_full, p_none = _cached_peak(name, "full"), _cached_peak(name, "none")
    # The layers the budget leaves unchecked would keep their KV cache, which moves T5's gradients by
    # 1 ulp against the reference (run without it): train without the cache, as users do.
    batch = _train_batch(fam, batch)
    probe, fqns, mp = _profile(name)
    # MemTracker, which measures the peak here, does not see the CPU RNG state a checkpoint keeps (5056 B:
    # ModelProfile.rng_state_bytes; the allocator does): planned without it, as measured.
    seen = dataclasses.replace(mp, rng_state_bytes=0)
    rows = []
    for frac in BUDGET_POINTS:
        budget = p_full + round(frac * (p_none - p_full))
        # Forward/backward only (no optimizer step), as _peak measures.
        plan = plan_budget(seen, budget, strategy="none", optimizer="none")
        # A copy of the profiled model: its blocks keep what the profile's op-level recomputes read
        # (selective._Reach), as a budget's own blocks do from the first step; a fresh model learns it in
        # its first backward, keeping more in that first forward (CLIP: 8688 B more, one pointwise block).
        model = copy.deepcopy(probe)
        distckpt.wrap(model, Placement(plan.placement), blocks=fqns)
        rows.append(dict(frac=frac, budget=budget, peak=_peak(fam, model, batch), blocks=len(plan.selected)))
    RESULTS[name]["budget_points"] = rows
    mid = rows[BUDGET_POINTS.index(0.5)]
    RESULTS[name].update(budget=mid["budget"], peak_budget=mid["peak"], budget_blocks=mid["blocks"])
    over = [r for r in rows if r["peak"] > r["budget"]]
    assert not over, over
    # The midpoint as a user asks for it: budget:SIZE on the profiled model (its profile is cached).
    model = distckpt.wrap(
        probe, Budget(mid["budget"], strategy="none", optimizer="none"), blocks=fqns, example_inputs=batch
    )
    assert _peak(fam, model, batch) <= mid["budget"]
    _assert_exact(ref, _step(fam, model, batch))
    RESULTS[name]["budget_exact"] = True


def _train_batch(fam: zoo.Family, batch: dict[str, Any]) -> dict[str, Any]:
    # Training without the KV cache (what a checkpointed layer does anyway), as the budget plans it.
    return {**batch, "use_cache": False} if fam.kind in ("decoder", "moe", "seq2seq") else batch


_PROFILES: dict[str, tuple[torch.nn.Module, list[str], Any]] = {}


def _profile(name: str) -> tuple[torch.nn.Module, list[str], Any]:
    """A copy of the family's plain model, the fqns of the layers ``blocks=None`` picks, and the
    budget's profile of that copy on the training batch: measured once per family (the budget and the
    prediction checks share it; the copy stays unwrapped until a test wraps it last)."""
    if name not in _PROFILES:
        fam = zoo.FAMILIES[name]
        plain, batch, _ = _reference(name)
        fqns = distckpt.checkpointed(_wrapped_copy(fam, plain))
        probe = copy.deepcopy(plain)
        mp = profile_model(probe, [(f, probe.get_submodule(f)) for f in fqns], _train_batch(fam, batch))
        _PROFILES[name] = (probe, fqns, mp)
    return _PROFILES[name]


def _prediction_vs_measure(name: str, choices: list[tuple[int, ...]]) -> None:
    """The budget's memory model never predicts below the measured peak (MemTracker, own pass) for
    each choice of checkpointed blocks, nor more than 3% above it (issue 10; T5 and BART were 8-9% above
    with only their last decoder layer checkpointed, its recompute peak measured in a window that held
    the previous layer's recompute), and is exact with none checkpointed."""
    fam = zoo.FAMILIES[name]
    plain, batch, _ = _reference(name)
    batch = _train_batch(fam, batch)
    _, fqns, mp = _profile(name)
    slack = {}
    for sel in choices:
        model = copy.deepcopy(plain)
        if sel:
            distckpt.wrap(model, "full", blocks=[fqns[i] for i in sel])
        measured = _peak(fam, model, batch)
        predicted = predicted_peak(mp, sel, strategy="none", optimizer="none")
        slack[sel] = predicted - measured
        assert predicted >= measured, (sel, predicted, measured)
        assert predicted - measured <= 0.03 * measured, (sel, predicted, measured)
    RESULTS[name]["prediction_choices"] = len(choices)
    RESULTS[name]["prediction_none_slack"] = slack[()]
    RESULTS[name]["prediction_max_slack"] = max(slack.values())


@pytest.mark.parametrize("name", _params("prediction", memory=True))
def test_budget_prediction_bounds_measured_peak(name):
    n = zoo.LAYERS
    _prediction_vs_measure(name, [(), tuple(range(n)), (0,), (n - 1,)])


@pytest.mark.slow
@pytest.mark.parametrize("name", _params("prediction"))
def test_budget_prediction_bounds_measured_peak_every_choice(name):
    n = zoo.LAYERS
    _prediction_vs_measure(name, [sel for k in range(n + 1) for sel in itertools.combinations(range(n), k)])
