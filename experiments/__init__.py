"""Experiments and measurements, one subpackage per system; run a script as
`python -m experiments.<system>.<name>` from the repository root (`common`: what they share)."""
