"""Applying checkpointing: the class swap (wrap), the recompute run-time, chunked feed-forward."""
