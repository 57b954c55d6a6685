"""Test setup: eight simulated CPU devices, set before JAX is imported anywhere, and one persistent
compilation cache for the session (many tests compile the same tiny programs; subprocesses that
tests start inherit it)."""
import atexit
import gc
import os
import shutil
import tempfile

import cheap_codegen  # tests/: no jax import

# exact bf16: collectives keep their bf16 payload in the compiled HLO that tests/test_comm.py counts;
# XLA's cheap CPU codegen (cheap_codegen.FAST_CPU: LLVM at -O0 without its expensive passes, and the element-wise
# emitter instead of the MLIR fusion emitters) for every compile, subprocesses included. The optimised HLO
# has the same collectives; its fusions differ a little (a tiny BTP step's temp bytes by <= 192 of ~0.9 MB,
# its rounding: a sharded and a replicated update 2.6e-10 apart after three ZeRO steps). The suite's tiny programs compile in about a third
# of the time (a 2-layer BTP LaX loss and gradient with remat: LLVM codegen 1.8 s instead of 6.2 s) and
# run a little slower. The suite ran in 920 s instead of 1225 s on a 2-core AMD EPYC.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8 --xla_allow_excess_precision=false "
    + cheap_codegen.xla_flags()
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# glibc's default allocation for the suite's processes (a training process keeps its steps' scratch memory,
# boostjax.runtime.allocator): thousands of small programs, whose freed memory should go back to the system;
# tests/test_allocator.py sets it for its own subprocesses
os.environ.setdefault("BOOSTJAX_KEEP_SCRATCH", "0")

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # the first process (pytest, or xdist's controller) makes it
    _cache = tempfile.mkdtemp(prefix="boostjax-test-jax-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"


# The slowest tests (seconds in a fresh-clone run on a busy 2-core machine), slowest first. Under
# `pytest -n 2` (xdist's `load` schedule hands out tests in collection order, the first ones alternately
# to the two workers) a long test collected late can start when the other worker is nearly done and run
# on alone; started first, they run side by side and the many short tests fill in around them.
SLOW_FIRST = (
    # 40-55 s by scale: 299 s where the next test took 213-279 s (load ~11 on 2 cores), not measured alone
    "tests/test_combinations.py::test_rotation_with_delay_on_a_pipeline_tp_mesh_matches_one_device_for_60_steps",
    "tests/test_combinations.py::test_btp_pipeline_rotation_delay_and_offload_in_one_mesh",  # 39 s
    "tests/test_multihost.py::test_a_signal_to_one_process_stops_the_whole_job_at_one_step",  # 36 s
    "tests/test_multihost.py::test_two_processes_match_one_process_and_resume",  # 33 s
)


def pytest_collection_modifyitems(items):
    """Moves the SLOW_FIRST tests to the front, in that order; every other test keeps its place. (Only
    test_multihost's first job shares a module-scoped fixture, its single-process reference, with
    tests collected later: a worker that runs both computes it once, the other worker once more.)"""
    rank = {nodeid: i for i, nodeid in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid, len(rank)))


def pytest_collection_finish(session):
    """After collection (every test module, JAX, torch and transformers imported), those objects move out
    of the garbage collector's reach (`gc.freeze`) and collections run less often: tracing makes many
    short-lived objects, and each full collection walked the whole heap (test_tp + test_zero: 6.4 s of
    127 s in 4,728 collections before, 1.2 s in 747 after)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)
