"""Test setup: eight simulated CPU devices, set before JAX is imported anywhere."""
import os

# exact bf16: collectives keep their bf16 payload in the compiled HLO that tests/test_comm.py counts
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8 --xla_allow_excess_precision=false"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
