"""Fault tolerance: the fault campaign against `boostjax train`, and checkpoint checksums."""
