"""Training runs: the loop, data sources, checkpoints, multi-process start-up and metrics."""
