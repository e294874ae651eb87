"""Lightning strategies whose DDP / FSDP is built by ``distckpt.parallelize``: checkpointed blocks, the zero-weight
join in every forward, ``accumulate_grad_batches`` without sync, and ``GradSyncGuard`` inside ``Trainer.fit``.

Built on the ``lightning`` package (``import lightning.pytorch``); docs/integrations.md says why and what holds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

import distckpt
from distckpt.errors import ConfigError
from distckpt.integrations._common import check_guard_every, checkpoint_blocks
from distckpt.options import check_graph
from distckpt.parallel.state import sync_state

__all__ = ["DistckptDDPStrategy", "DistckptFSDPStrategy"]


class _Distckpt:
    """What both strategies add to Lightning's: checkpoint the blocks, parallelize with distckpt, accumulate
    without sync, check the gradients before each optimizer step, and join the loss of a manual backward."""

    model: nn.Module | None
    lightning_module: pl.LightningModule | None

    def __init__(
        self,
        policy: Any = "full",
        *,
        blocks: Any = None,
        reentrant: bool = False,
        graph: str = "auto",
        guard_every: int = 0,
        **kwargs: Any,
    ) -> None:
        self._refuse(kwargs)
        check_guard_every(guard_every, type(self).__name__)
        check_graph(graph)
        super().__init__(**kwargs)  # Lightning's strategy
        self._policy, self._blocks, self._reentrant = policy, blocks, reentrant
        self._graph, self._guard_every = graph, guard_every
        self._guard: distckpt.GradSyncGuard | None = None

    @staticmethod
    def _refuse(kwargs: dict[str, Any]) -> None:
        """Lightning options that contradict distckpt's (none under DDP)."""

    def _checkpoint(self, model: nn.Module) -> None:
        """``distckpt.wrap`` the blocks, unless ``policy=None`` keeps the model's own distckpt checkpointing."""
        checkpoint_blocks(model, self._policy, blocks=self._blocks, reentrant=self._reentrant, owner="the strategy")

    def _parallelize(self, model: nn.Module, strategy: str, kwargs: dict[str, Any]) -> nn.Module:
        self._checkpoint(model)
        wrapped = distckpt.parallelize(model, strategy, graph=self._graph, **kwargs)
        if self._guard_every:
            self._guard = distckpt.GradSyncGuard(wrapped, every=self._guard_every)
        return wrapped

    def _sync_state(self) -> Any:
        return sync_state(self.model)

    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """No gradient sync on this micro-batch (``accumulate_grad_batches``, ``toggle_model(sync_grad=False)``):
        ``distckpt.accumulate``, so distckpt's bookkeeping skips the reduction too and refuses what cannot skip it."""
        if self._sync_state() is None:  # not parallelized by distckpt (not fitting)
            yield
            return
        with distckpt.accumulate(self.model):
            yield

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        lm = self.lightning_module
        state = self._sync_state()
        if state is not None and lm is not None and not lm.automatic_optimization:
            # manual_backward runs inside training_step, i.e. inside the DDP forward: join the loss here.
            closure_loss = state.join_loss(closure_loss)
        return super().backward(closure_loss, optimizer, *args, **kwargs)  # type: ignore[misc]

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        guard = self._guard
        if guard is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)  # type: ignore[misc]

        def checked() -> Any:
            # After the closure's backward (the window's last micro-batch), before optimizer.step(): every rank
            # gets the same GradDesyncError naming the parameter, so no rank waits in a later collective.
            out = closure()
            guard.check()
            return out

        return super().optimizer_step(optimizer, checked, model, **kwargs)  # type: ignore[misc]

    def _release(self) -> None:
        """Remove distckpt's hooks, so a later ``fit`` on the same LightningModule starts clean."""
        state = self._sync_state()
        if state is not None:
            state.remove()
        self._guard = None


class DistckptDDPStrategy(_Distckpt, DDPStrategy):
    """``DDPStrategy`` whose DDP is ``distckpt.parallelize(model, "ddp")``: exact for every multi-task pattern.

    Args:
        policy: ``distckpt.wrap``'s policy for the LightningModule's blocks (``"full"``, ``"every:2"``,
            ``"budget:2GiB"``, ...); ``None`` keeps the checkpointing the LightningModule applied itself with
            ``distckpt.wrap`` (or none).
        blocks: ``distckpt.wrap``'s ``blocks=`` (``None``: found in the LightningModule).
        reentrant: ``distckpt.wrap``'s ``reentrant=``.
        graph: ``distckpt.parallelize``'s ``graph=`` (``"auto"``: any pattern; ``"static"``: the same
            parameters every step).
        guard_every: run ``GradSyncGuard.check()`` before every ``guard_every``-th optimizer step (0: never).
        **kwargs: ``DDPStrategy``'s arguments (``process_group_backend``, ``timeout``, ...) and DDP's
            (``bucket_cap_mb``, ...); ``find_unused_parameters`` and ``static_graph`` are distckpt's to set.

    Raises:
        ConfigError: bad options; at ``fit``: what ``distckpt.wrap`` and ``distckpt.parallelize`` refuse.
    """

    def _setup_model(self, model: nn.Module) -> nn.Module:
        # Lightning calls this when fitting only (configure_ddp): the LightningModule, on its device.
        return self._parallelize(model, "ddp", dict(self._ddp_kwargs))

    def teardown(self) -> None:
        self._release()
        if isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
            # Unwrapped here, so DDPStrategy.teardown does not suggest static_graph=True: every parameter takes part
            # each step because of distckpt's join, which static_graph would defeat (distckpt refuses it).
            self.model = self.lightning_module
        super().teardown()


class DistckptFSDPStrategy(_Distckpt, FSDPStrategy):
    """``FSDPStrategy`` whose FSDP is ``distckpt.parallelize(model, "fsdp")``: one unit per block (checkpointing
    inside it), ``use_orig_params=True``, the join in each unit's forward. Runs on CPU (gloo) too, which
    Lightning's own ``FSDPStrategy`` refuses.

    Args:
        policy, blocks, reentrant, graph, guard_every: as :class:`DistckptDDPStrategy` (``reentrant=True`` is
            refused under FSDP1).
        **kwargs: ``FSDPStrategy``'s arguments (``sharding_strategy``, ``mixed_precision``, ``cpu_offload``,
            ``state_dict_type``, ...); ``auto_wrap_policy`` and ``activation_checkpointing_policy`` are refused
            (distckpt makes the units and checkpoints the blocks).

    Raises:
        ConfigError: bad options; at ``fit``: what ``distckpt.wrap`` and ``distckpt.parallelize`` refuse.
    """

    @staticmethod
    def _refuse(kwargs: dict[str, Any]) -> None:
        if kwargs.get("activation_checkpointing_policy") or kwargs.get("activation_checkpointing"):
            raise ConfigError(
                "activation_checkpointing_policy (Lightning's checkpointing) and distckpt's policy would checkpoint "
                "the blocks twice, and Lightning's is not kept in sync under data parallelism. Drop "
                "activation_checkpointing_policy and choose the blocks with policy= and blocks=."
            )
        if kwargs.get("auto_wrap_policy") is not None:
            raise ConfigError(
                "auto_wrap_policy is set by distckpt (one FSDP unit per block, so checkpointing sits inside the units, "
                "pytorch#82203). Drop it, and choose the blocks with blocks=."
            )

    def _setup_model(self, model: nn.Module) -> nn.Module:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or trainer.state.fn != TrainerFn.FITTING:
            return super()._setup_model(model)  # validate/test/predict alone: no gradients to keep in sync
        if not model.automatic_optimization:
            raise ConfigError(
                "manual optimization under DistckptFSDPStrategy: manual_backward runs inside the FSDP root's forward, "
                "where distckpt cannot join the root's parameters yet. Use DistckptDDPStrategy, or automatic "
                "optimization (return the loss from training_step)."
            )
        kwargs = {k: v for k, v in self.kwargs.items() if k != "use_orig_params"}  # distckpt sets True
        kwargs.update(
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
        )
        if self.root_device.type == "cuda":
            kwargs["device_id"] = self.root_device
        return self._parallelize(model, "fsdp", kwargs)

    def teardown(self) -> None:
        self._release()
        super().teardown()
