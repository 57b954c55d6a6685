"""Basis-rotation Adam under pipeline staleness, and the pipeline schedules."""
