"""Speed on this machine: training step, generation, attention kernels, against transformers, across ISAs."""
