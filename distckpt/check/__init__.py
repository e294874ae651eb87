"""Run-time checks: gradients agree across ranks (sync_guard), the recompute equals the forward
(recompute), and the doctor that runs both on a user's model."""
