"""Smoke tests of the experiments (experiments/<system>/<script>.py): tests/smoke/test_<script>.py runs a
script's pieces at tiny shapes or renders its report from a stored result. Unit tests of the library stay in
tests/test_<module or behaviour>.py."""
