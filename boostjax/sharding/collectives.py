"""Moved to `boostjax.models.collectives` (the block's hooks belong to the model); this name stays
until the pipeline modules import from there."""

from boostjax.models.collectives import LOCAL, Collectives, vocab_parallel_cross_entropy

__all__ = ["LOCAL", "Collectives", "vocab_parallel_cross_entropy"]
