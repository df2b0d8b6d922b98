"""planning: a run's memory, FLOPs and communication from its config alone; arithmetic only, touching no device,
process group or file."""
