"""training: the trainer itself (config, flags, validation, build, step, loop) and its rooms data/, checkpoints/,
observability/, planning/ and evaluation/."""
