"""Test setup: eight simulated CPU devices, set before JAX is imported anywhere, and one persistent
compilation cache for the session (many tests compile the same tiny programs; subprocesses that
tests start inherit it)."""
import atexit
import os
import shutil
import tempfile

# exact bf16: collectives keep their bf16 payload in the compiled HLO that tests/test_comm.py counts
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8 --xla_allow_excess_precision=false"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # the first process (pytest, or xdist's controller) makes it
    _cache = tempfile.mkdtemp(prefix="boostjax-test-jax-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
