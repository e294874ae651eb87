"""Lightning's own ``FSDPStrategy`` on the CPU, for the Lightning tests (tests/integrations/lightning_fit.py) and
benchmark (benchmarks/integrations_lightning.py): what Lightning gives without distckpt, measured on gloo ranks."""

from __future__ import annotations

from typing import Any

import torch


def cpu_fsdp_strategy(**kwargs: Any) -> Any:
    """Lightning's own ``FSDPStrategy`` made to run on the CPU: Lightning refuses it there ("requires a GPU
    accelerator", a check a subclass passes), then builds FSDP with ``device_id=None``, which torch refuses on the
    CPU ("FSDP needs a non-CPU accelerator device"). This subclass passes the CPU device; the rest is Lightning's
    ``_setup_model``: FSDP around the LightningModule, then its activation checkpointing."""
    from lightning.pytorch.strategies import FSDPStrategy
    from lightning.pytorch.strategies.fsdp import _setup_activation_checkpointing
    from torch.distributed.fsdp import FullyShardedDataParallel

    class CPUFSDPStrategy(FSDPStrategy):
        def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
            model = FullyShardedDataParallel(
                module=model,
                cpu_offload=self.cpu_offload,
                mixed_precision=self.mixed_precision_config,
                sharding_strategy=self.sharding_strategy,
                device_id=torch.device("cpu"),
                **self.kwargs,
            )
            _setup_activation_checkpointing(model, self._activation_checkpointing_kwargs)
            return model

    return CPUFSDPStrategy(**kwargs)
