"""The checkpointed block itself, below every layer that chooses or applies it: the class swap and its
undo (swap), the run-time of one checkpointed or offloaded block (recompute), op-level contexts (selective)."""
