"""Analyses of the compiled training step: its collectives (`comm`), its per-device memory (`memory`) and
the HLO text parser they read it with (`hlo`). They compile the step training runs, so they sit above
`boostjax.training`."""
