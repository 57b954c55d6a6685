"""GEMMs in compiled HLO: dots and convolutions with K, FLOPs, bytes moved and intensity."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from boostjax.analysis.hlo.comms import from_parameter
from boostjax.analysis.hlo.parse import Array, Instr, Module, parse_module


def _dims(ins: Instr, key: str) -> tuple[int, ...]:
    v = ins.attr(key)
    return tuple(int(x) for x in re.findall(r"\d+", v)) if v else ()


@dataclass(frozen=True)
class Gemm:
    name: str
    lhs: Array
    rhs: Array
    out: Array
    lhs_contracting: tuple[int, ...]
    rhs_contracting: tuple[int, ...]
    lhs_batch: tuple[int, ...]
    rhs_batch: tuple[int, ...]
    op_name: str = ""
    source: tuple[tuple[str, str, int], ...] = ()  # (function, file, line), innermost first
    kind: str = "dot"
    conv_k: int = 0  # convolutions: input features x kernel window
    weight_operand: int | None = None  # 0 / 1: that operand is an entry parameter (a weight); None: both computed

    @property
    def k(self) -> int:
        """The reduction size: product of the contracted dimensions."""
        if self.kind == "convolution":
            return self.conv_k
        return int(np.prod([self.lhs.shape[d] for d in self.lhs_contracting], dtype=np.int64))

    @property
    def batch(self) -> int:
        return int(np.prod([self.lhs.shape[d] for d in self.lhs_batch], dtype=np.int64))

    @property
    def m(self) -> int:
        free = [s for i, s in enumerate(self.lhs.shape) if i not in self.lhs_contracting + self.lhs_batch]
        return int(np.prod(free, dtype=np.int64))

    @property
    def n(self) -> int:
        free = [s for i, s in enumerate(self.rhs.shape) if i not in self.rhs_contracting + self.rhs_batch]
        return int(np.prod(free, dtype=np.int64))

    @property
    def flops(self) -> int:
        return 2 * self.out.elements * self.k

    def bytes_moved(self, dtype: str | None = None) -> int:
        """Operands read plus result written (in `dtype` if given, else the HLO element types)."""
        return self.lhs.bytes(dtype) + self.rhs.bytes(dtype) + self.out.bytes(dtype)

    def intensity(self, dtype: str | None = None) -> float:
        """Arithmetic intensity 2·M·N·K·batch / bytes moved (FLOP per byte)."""
        b = self.bytes_moved(dtype)
        return self.flops / b if b else 0.0

    def key(self) -> tuple:
        """Identity up to the instruction name (for multiset differences between modules)."""
        return (str(self.lhs), str(self.rhs), str(self.out), self.lhs_contracting, self.rhs_contracting,
                self.lhs_batch, self.rhs_batch, self.source[:1], self.kind)


def _conv_reduction(lhs: Array, rhs: Array, ins: Instr) -> int:
    labels = ins.attr("dim_labels") or ""
    m = re.match(r"(\w+)_(\w+)->(\w+)", labels)
    if not m or len(m.group(2)) != len(rhs.shape):
        return 0
    k = 1
    for i, ch in enumerate(m.group(2)):
        if ch != "o":  # input features and every kernel spatial dim are reduced
            k *= rhs.shape[i]
    return k


def gemms(text_or_module: str | Module) -> list[Gemm]:
    """Every dot / convolution of the module (fused ones included) with its shapes and dims."""
    mod = parse_module(text_or_module) if isinstance(text_or_module, str) else text_or_module
    out: list[Gemm] = []
    for comp, instrs in mod.computations.items():
        for ins in instrs:
            if ins.opcode not in ("dot", "convolution") or len(ins.operands) < 2 or not ins.results:
                continue
            lhs_i, rhs_i = mod.lookup(comp, ins.operands[0]), mod.lookup(comp, ins.operands[1])
            if lhs_i is None or rhs_i is None or not lhs_i.results or not rhs_i.results:
                continue
            lhs, rhs = lhs_i.results[0], rhs_i.results[0]
            opn = re.search(r'op_name="([^"]*)"', ins.attrs)
            src = tuple(mod.source(ins))
            weight = next((k for k in (1, 0) if from_parameter(mod, comp, ins.operands[k])), None)
            if ins.opcode == "dot":
                out.append(Gemm(ins.name, lhs, rhs, ins.results[0], _dims(ins, "lhs_contracting_dims"),
                                _dims(ins, "rhs_contracting_dims"), _dims(ins, "lhs_batch_dims"),
                                _dims(ins, "rhs_batch_dims"), opn.group(1) if opn else "", src,
                                weight_operand=weight))
            else:
                out.append(Gemm(ins.name, lhs, rhs, ins.results[0], (), (), (), (),
                                opn.group(1) if opn else "", src, "convolution", _conv_reduction(lhs, rhs, ins),
                                weight))
    return out


def multiset_difference(more: Iterable[Gemm], fewer: Iterable[Gemm]) -> list[Gemm]:
    """The GEMMs of `more` left after removing one match (by `Gemm.key`) for each GEMM of `fewer`."""
    left = Counter(g.key() for g in fewer)
    out = []
    for g in more:
        if left[g.key()]:
            left[g.key()] -= 1
        else:
            out.append(g)
    return out
