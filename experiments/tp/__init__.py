"""Tensor parallelism: communication, memory and time of full-rank TP, low-rank TP and BTP."""
