"""checkpoints: saving, loading, integrity, the pre-launch fit check and preemption saves; may touch the
filesystem, megatron's dist_checkpointing and mcore/'s checkpoint hooks, not the optimizer families."""
