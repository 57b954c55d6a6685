"""XLA's cheap CPU codegen for the suite's tiny programs, as compiler options (`FAST_CPU`) and as
`XLA_FLAGS` text (`xla_flags`). No jax import: conftest.py sets `XLA_FLAGS` from it before JAX starts.

LLVM at -O0 without its expensive passes, and, where this XLA still has it, the element-wise emitter
instead of the MLIR fusion emitters. jaxlib 0.11 dropped `xla_cpu_use_fusion_emitters` (its XLA aborts
the process on a flag it does not know, in `XLA_FLAGS` as in compiler options), so from 0.11 on the
fusion emitters stay and only the LLVM settings apply.
"""

from __future__ import annotations

from importlib import metadata


def _jaxlib_minor() -> tuple[int, int]:
    major, minor = metadata.version("jaxlib").split(".")[:2]
    return int(major), int(minor)


FAST_CPU: dict[str, object] = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
if _jaxlib_minor() < (0, 11):
    FAST_CPU["xla_cpu_use_fusion_emitters"] = False


def xla_flags() -> str:
    """`FAST_CPU` as `XLA_FLAGS` text (`--name=value`, booleans lower-case)."""
    return " ".join(f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in FAST_CPU.items())
