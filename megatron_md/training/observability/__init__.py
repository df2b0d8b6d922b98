"""observability: logs, metrics, throughput, diagnostics and profiler traces; reads the model, optimizer and
timers and writes the run directory, never changes what trains."""
