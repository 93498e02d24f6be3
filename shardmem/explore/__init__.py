"""Exploring tradeoffs: sweeps over config values, the per-layer remat tuner, and their plots."""
