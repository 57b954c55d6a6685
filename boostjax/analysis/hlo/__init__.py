"""Reading compiled HLO text: collectives (kind, shapes, bytes, groups) and GEMMs (K, intensity).

`parse_module(text)` reads the text of `jax.jit(f).lower(...).compile().as_text()` (or an HLO dump)
into `Instr` records grouped by computation. On top of it:

- `collectives(text)`: every all-reduce, all-gather, reduce-scatter, collective-permute, all-to-all
  (async `-start`/`-done` pairs counted once, at the `-done`), with every result shape (combined
  all-reduces have tuple results), element types, bytes and replica groups. Groups of one device
  move nothing and are flagged `trivial`.
- `logical_dtype`: the CPU backend has no bf16 collectives or dots; it rounds the value to bf16 and
  widens it to f32 before the all-reduce. `Collective.logical_bytes` undoes such a widening (a
  chain of convert/bitcast/copy from a narrower float type feeding the operand): the bytes a
  backend with native bf16 collectives (GPU, TPU) would move. `bytes` is what this executable moves.
- `gemms(text)`: every `dot` (and `convolution`) with operand shapes, contracting/batch dims, the
  reduction size K, FLOPs `2·M·N·K·batch`, bytes moved (operands + result) and their ratio.

Modules: `parse` (the text into `Module`/`Instr`/`Array`), `comms` (collectives), `gemm` (GEMMs);
this package re-exports their public names.

Counts are static: an op inside a loop body is counted once (the models here unroll their layers);
`Module.runs(computation)` says how often a computation runs per step, from XLA's known trip counts
(a pipeline schedule's or an accumulation's loop).
"""

from boostjax.analysis.hlo.comms import (Collective, collective_summary, collectives, from_parameter,
                                         logical_dtype)
from boostjax.analysis.hlo.gemm import Gemm, gemms, multiset_difference
from boostjax.analysis.hlo.parse import (BITS, COLLECTIVE_KINDS, FLOAT_BITS, Array, Instr, Module, parse_module,
                                         parse_shapes)

__all__ = ["BITS", "COLLECTIVE_KINDS", "FLOAT_BITS", "Array", "Collective", "Gemm", "Instr", "Module",
           "collective_summary", "collectives", "from_parameter", "gemms", "logical_dtype",
           "multiset_difference", "parse_module", "parse_shapes"]
