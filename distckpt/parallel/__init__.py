"""Data parallelism around checkpointed blocks: DDP/FSDP/FSDP2 in a fixed order (strategies) and the
per-forward bookkeeping that keeps every multi-task pattern in sync (param_sync)."""
