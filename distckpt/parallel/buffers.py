"""DDP's buffers for a model that keeps running statistics (BatchNorm): synced from rank 0 once per step, right after
the gradient reduction, instead of DDP's broadcast at the start of every forward.

Why: DDP's per-forward broadcast pairs with nothing on a rank that runs fewer forwards in a step (a second task's
forward on some ranks): a hang. Once per step, at the one reducing backward every rank runs, it always pairs. What
the statistics become is what DDP's broadcast gave: rank 0's own (updated by rank 0's batches only), on every rank
after each step (DDP's left the other ranks with rank 0's plus their own last batch until the next forward).
Gradients do not depend on them in training mode, so they are the same as with DDP's default.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from distckpt import _torch_compat as compat

__all__ = ["BufferSync", "ddp_buffer_plan", "keeps_running_stats"]


def keeps_running_stats(model: nn.Module) -> bool:
    """Whether a module of ``model`` keeps running statistics (BatchNorm and the other ``_NormBase`` modules with
    ``track_running_stats``): the buffers a step changes, which DDP must keep equal across ranks."""
    norm = compat.norm_base_class()
    return any(isinstance(m, norm) and m.track_running_stats for m in model.modules())


class BufferSync:
    """Broadcast ``ddp.module``'s buffers (those DDP would sync) from the DDP group's rank 0: one broadcast per dtype.

    Args:
        ddp: the ``DistributedDataParallel`` (its ``forward_sync_buffers`` is off).
    """

    def __init__(self, ddp: nn.Module):
        self.module = ddp.module
        self.group = ddp.process_group
        self.src = dist.get_global_rank(self.group, 0)
        self.ignored = set(getattr(self.module, "_ddp_params_and_buffers_to_ignore", ()))

    def __call__(self) -> None:
        # Read each time, as DDP does: a module may reassign its buffers.
        buffers = [b for n, b in self.module.named_buffers() if n not in self.ignored]
        by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for b in buffers:
            by_dtype.setdefault((b.dtype, b.device), []).append(b)
        with torch.no_grad():
            for bufs in by_dtype.values():
                flat = torch.cat([b.reshape(-1) for b in bufs])
                dist.broadcast(flat, src=self.src, group=self.group)
                offset = 0
                for b in bufs:
                    new = flat[offset : offset + b.numel()].view_as(b)
                    offset += b.numel()
                    # Only a buffer that differs is written: a write bumps its version, and a graph that saved it
                    # (BatchNorm in eval mode, a retained graph) would then refuse its backward.
                    if not torch.equal(new, b):
                        b.copy_(new)


def ddp_buffer_plan(ddp: nn.Module, user_chose: bool) -> tuple[bool, Any]:
    """(whether DDP still broadcasts the buffers at every forward, the once-per-step sync or None) for ``ddp``. Unless
    the user chose DDP's ``forward_sync_buffers`` (True: kept, guarded by the handshake; False: each rank keeps its
    own statistics, as asked), it is turned off here and running statistics are synced once per step."""
    if user_chose:
        return bool(ddp.forward_sync_buffers) and any(True for _ in ddp.module.buffers()), None
    ddp.forward_sync_buffers = False  # DDP synced the buffers once when it was built
    return False, BufferSync(ddp) if keeps_running_stats(ddp.module) else None
