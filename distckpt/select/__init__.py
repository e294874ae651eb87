"""Choosing what to checkpoint: block detection (blocks), policy specs and objects (policies), the
memory planner (budget) on per-block profiles (profile), op-level checkpointing (selective), the FLOP
counter that also counts CPU attention (flops)."""
