"""Synthetic checkpoints for the demo, the tests and the benchmarks (generated, never downloaded)."""
