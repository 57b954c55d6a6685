"""One-GPU measurements: the training step and the GPU suite."""
