"""Keeping a step's scratch memory (`boostjax.runtime.allocator`): a block freed on a worker thread is
reused without faulting its pages in again; nothing changes once JAX runs, where a GPU/TPU backend could
start, or when turned off; a bad setting is one line naming the variable."""

import platform
import subprocess
import sys
import textwrap

import pytest
from helpers import cli_env

from boostjax.config import ConfigError
from boostjax.runtime import allocator

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# a 64 MiB block allocated, written and freed on a worker thread (as XLA's runtime does with a step's
# scratch), twice: the page faults of the second time
PROBE = textwrap.dedent("""
    import ctypes, resource, sys, threading
    from boostjax.runtime.allocator import keep_scratch_memory, in_force
    if sys.argv[1] == "jax-first":
        import jax
        jax.numpy.zeros(1).block_until_ready()
    if sys.argv[1] == "accelerator":  # what a machine with a GPU plugin decides
        import boostjax.runtime.allocator as allocator
        allocator.accelerator_installed = lambda: True
    on = keep_scratch_memory()
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
    faults = []
    def touch():  # plain malloc, as XLA's runtime (numpy would ask for huge pages and hide the faults)
        r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        p = libc.malloc(64 << 20)
        ctypes.memset(p, 1, 64 << 20)
        libc.free(p)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0)
    for _ in range(2):
        t = threading.Thread(target=touch)
        t.start(); t.join()
    print(on, in_force(), faults[1])
""")
PAGES = (64 << 20) // 4096


def _probe(mode: str, keep: str = "1") -> tuple[bool, bool, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120,
                         env=cli_env(BOOSTJAX_KEEP_SCRATCH=keep))
    assert out.returncode == 0, out.stderr
    on, force, faults = out.stdout.split()
    return on == "True", force == "True", int(faults)


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt: the setting is a no-op elsewhere")
def test_a_freed_block_is_reused_without_faulting_it_in_again():
    on, force, faults = _probe("fresh")
    assert on and force
    assert faults < PAGES // 10, (faults, PAGES)  # measured: 0 of 16,384 pages (glibc's default: 16,385)


def test_nothing_changes_once_jax_runs_on_an_accelerator_or_when_turned_off():
    assert _probe("jax-first")[:2] == (False, False)  # its thread pool has picked its heaps already
    assert _probe("accelerator")[:2] == (False, False)
    assert _probe("fresh", keep="0")[:2] == (False, False)


def test_a_bad_setting_is_one_line_naming_the_variable(monkeypatch):
    monkeypatch.setenv(allocator.ENV, "yes")
    with pytest.raises(ConfigError, match=r"^BOOSTJAX_KEEP_SCRATCH='yes': [^\n]*; fix: export BOOSTJAX_KEEP_SCRATCH=1"):
        allocator.keep_scratch_memory()
