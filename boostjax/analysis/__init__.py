"""Analyses of the compiled training step: its collectives (`comm`, `boostjax comm`) and its
per-device memory (`memory`). They compile the step training runs, so they sit above `boostjax.training.step`."""
