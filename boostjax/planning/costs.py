"""Seconds from a compiled program: a roofline over its GEMMs, its other memory traffic and its collectives.

`program_cost(text, seq, batch)` reads one compiled program's HLO (per device): dots, the bytes of every
other executed instruction, collectives. `program_time(cost, hw, eta)` turns that into seconds on `hw`
(a GPU profile's peaks, or a calibrated CPU's measured curves: `instruction_s`); nothing overlaps. The
formulas, what is charged once, and what `fused_attention` leaves out: docs/planning.md ("Cost model",
"The CPU profile").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from boostjax.analysis import hlo


@dataclass(frozen=True)
class Hardware:
    """Per-device rates the time model charges: stated assumptions, not fitted (eta is passed apart)."""

    name: str
    peak_flops: float  # dense compute peak of the compute dtype (bf16 tensor cores on a GPU)
    hbm_bytes_per_s: float  # nominal device-memory bandwidth
    hbm_efficiency: float  # fraction of it streaming kernels reach
    bus_bytes_per_s: float  # bus bandwidth of an all-reduce inside a node (large messages)
    alpha_s: float  # per-collective latency
    p2p_bytes_per_s: float  # between nodes, per device (pipeline sends, collectives that cross nodes)
    p2p_alpha_s: float
    gemm_curve: tuple[tuple[float, float], ...] = ()  # (FLOPs of a dot, seconds) measured (calibrated CPU)
    stream_curve: tuple[tuple[float, float], ...] = ()  # (bytes of an instruction, seconds) measured
    gemm_t_curve: tuple[tuple[float, float], ...] = ()  # the same for a dot whose lhs contracts a major dimension
    alpha_by_group: tuple[tuple[int, float], ...] = ()  # (devices in the group, alpha) measured (calibrated CPU)

    def alpha(self, group: int) -> float:
        """Per-collective latency over `group` devices: `alpha_s`, or the measured one of the nearest group
        size (log-linear between two measured sizes)."""
        if not self.alpha_by_group:
            return self.alpha_s
        return instruction_s(self.alpha_by_group, group)


def instruction_s(curve: tuple[tuple[float, float], ...], size: float) -> float:
    """Seconds of one instruction of `size` on `curve` ((size, seconds) points, sizes ascending): log-log
    between points, the first point's time below it (dispatch), linear in size beyond the last."""
    (s0, t0), (s1, t1) = curve[0], curve[-1]
    if size >= s1:
        return t1 * size / s1
    if size <= s0:
        return t0
    xs, ys = np.log([s for s, _ in curve]), np.log([t for _, t in curve])
    return float(np.exp(np.interp(np.log(size), xs, ys)))


_FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all", "partition-id",
         "replica-id", "iota", "opt-barrier", "custom-call"}
_MOVE = {"parameter", "convert", "bitcast", "transpose", "copy", "reshape", "tuple", "get-tuple-element"}


def _score_shaped(arrays, seq: int, batch: int) -> bool:
    """An attention-score array: two sequence-sized dims and at least 2 x batch x seq^2 elements (scores
    have >= 2 heads per device at every shape planned), so [b, s, d] with d = s is not one."""
    return any(sum(1 for s in a.shape if s == seq) >= 2 and a.elements >= 2 * batch * seq * seq for a in arrays)


def traffic_bytes(mod: hlo.Module, comp: str, ins: hlo.Instr) -> int:
    """Bytes one executed instruction reads and writes: its operands and results, except what an in-place
    `dynamic-update-slice` (the whole instruction's, or its fusion's root) leaves alone (the buffer it
    updates: only the update is written) and what a `dynamic-slice` does not read (an operand used only
    through slices is read for the slices' bytes). A pipeline's ring and scan buffers are updated and
    read this way, a slot per tick."""
    ops = [mod.lookup(comp, n) for n in ins.operands]
    body = (ins.attr("calls") or "").lstrip("%") if ins.opcode == "fusion" else ""
    instrs = mod.computations.get(body, [])
    root = mod.root(body) if body else ins
    params = {i.param_index: i.name for i in instrs if i.opcode == "parameter"}
    users: dict[str, list[hlo.Instr]] = {}
    for i in instrs:
        for o in i.operands:
            users.setdefault(o, []).append(i)
    dus = root is not None and root.opcode == "dynamic-update-slice"
    in_place = root.operands[0] if dus and root.operands else None  # the buffer (a parameter's name in a fusion)
    total = 0
    if dus:  # writes the update only
        upd = mod.lookup(body or comp, root.operands[1]) if len(root.operands) > 1 else None
        total += upd.results[0].bytes() if upd is not None and upd.results else 0
    else:
        total += sum(a.bytes() for a in ins.results)
    for k, o in enumerate(ops):
        if o is None or o.opcode == "tuple" or not o.results:
            continue
        name = params.get(k) if body else ins.operands[k]
        if dus and name == in_place:
            continue  # updated in place, not read
        used = users.get(name, []) if body else ([ins] if ins.opcode == "dynamic-slice" and k == 0 else [])
        if used and all(u.opcode == "dynamic-slice" and u.operands[:1] == (name,) for u in used):
            total += sum(u.results[0].bytes() for u in used)  # read through slices only
        else:
            total += o.results[0].bytes()
    return total


def lhs_major(g: hlo.Gemm) -> bool:
    """The dot's lhs contracts a dimension other than its minor (last) one, as a weight gradient `x^T dy`
    does: XLA:CPU runs these through another GEMM library than `x W` and `x W^T`, at a different rate."""
    return g.kind == "dot" and tuple(g.lhs_contracting) != (len(g.lhs.shape) - 1,)


def program_cost(text: str, seq: int, batch: int, fused_attention: bool = True,
                 gemm_dtype: str | None = "bf16") -> dict[str, Any]:
    """GEMMs `(FLOPs, bytes, score-shaped?, lhs_major?)`, other memory traffic and collectives `(kind, bytes, group)` of
    one compiled program of `batch` sequences of `seq` tokens (per device). `gemm_dtype`: the element
    type GEMM operands are charged at (None: the HLO's own)."""
    mod = hlo.parse_module(text)
    gemm_bodies = {c for c, instrs in mod.computations.items() if any(i.opcode in ("dot", "convolution")
                                                                     for i in instrs)}
    move_bodies = {c for c, instrs in mod.computations.items() if all(i.opcode in _MOVE for i in instrs)}
    gemms = [(g.flops, g.bytes_moved(gemm_dtype), fused_attention and _score_shaped((g.lhs, g.rhs, g.out), seq, batch),
              lhs_major(g)) for g in hlo.gemms(mod)]
    other = scores = moves = 0
    sizes: list[int] = []  # bytes of every executed instruction charged to `other`
    applied = {(i.attr("to_apply") or "").lstrip("%") for c in mod.computations.values() for i in c}
    for comp, instrs in mod.computations.items():
        caller = mod.caller(comp)
        if caller is not None and caller.opcode == "fusion":
            continue  # counted at its fusion instruction
        executed = comp not in applied  # a reducer's scalar ops run inside its caller
        for ins in instrs:
            if ins.opcode in _FREE or ins.opcode in ("dot", "convolution") or any(
                    ins.opcode.startswith(k) for k in hlo.COLLECTIVE_KINDS):
                continue
            if ins.opcode == "fusion" and (ins.attr("calls") or "").lstrip("%") in gemm_bodies:
                continue  # a dot with fused epilogue: the GEMM roofline charges it
            ops = [o for o in (mod.lookup(comp, n) for n in ins.operands) if o is not None]
            arrays = [*ins.results, *(a for o in ops for a in o.results[:1] if o.opcode != "tuple")]
            nbytes = traffic_bytes(mod, comp, ins)
            moving = ins.opcode in _MOVE or (ins.opcode == "fusion"
                                             and (ins.attr("calls") or "").lstrip("%") in move_bodies)
            if fused_attention and moving:
                moves += nbytes
            elif fused_attention and _score_shaped(arrays, seq, batch):
                scores += nbytes
            else:
                other += nbytes
                if executed:
                    sizes.append(nbytes)
    colls = [(c.kind, c.logical_bytes, c.group_size) for c in hlo.collectives(mod) if not c.trivial]
    return {"gemms": gemms, "other_bytes": other, "score_bytes_excluded": scores,
            "move_bytes_excluded": moves, "collectives": colls, "other_sizes": sizes}


def coll_time(kind: str, nbytes: float, t: int, hw: Hardware, bus_bytes_per_s: float | None = None) -> float:
    """Seconds of one ring collective of `nbytes` (its result) over `t` devices."""
    bw = bus_bytes_per_s or hw.bus_bytes_per_s
    if t <= 1:
        return 0.0
    if kind == "all-reduce":
        return hw.alpha(t) + 2 * (t - 1) / t * nbytes / bw
    if kind in ("all-gather", "all-to-all"):
        return hw.alpha(t) + (t - 1) / t * nbytes / bw
    if kind == "reduce-scatter":
        return hw.alpha(t) + (t - 1) * nbytes / bw
    return hw.alpha(t) + nbytes / bw  # collective-permute and the rest: one hop


def program_time(cost: dict[str, Any], hw: Hardware, eta: float,
                 bus_bytes_per_s: float | None = None) -> dict[str, float]:
    """Seconds per component of one program on `hw` with GEMM efficiency `eta` (`bus_bytes_per_s`: the
    collectives' bandwidth when not the node's bus, e.g. a model axis across nodes)."""
    peak, hbm = eta * hw.peak_flops, hw.hbm_efficiency * hw.hbm_bytes_per_s
    measured = bool(hw.gemm_curve and hw.stream_curve)

    def flop_s(f: float, major: bool) -> float:
        curve = hw.gemm_t_curve if major and hw.gemm_t_curve else hw.gemm_curve
        return instruction_s(curve, f) / eta if measured else f / peak

    def byte_s(b: float) -> float:
        return instruction_s(hw.stream_curve, b) / hw.hbm_efficiency if measured else b / hbm

    gemm = sum(flop_s(f, t) if score else max(flop_s(f, t), byte_s(b)) for f, b, score, t in cost["gemms"])
    bound = sum(1 for f, b, score, t in cost["gemms"] if not score and byte_s(b) > flop_s(f, t))
    comm = sum(coll_time(k, b, t, hw, bus_bytes_per_s) for k, b, t in cost["collectives"])
    memory = sum(byte_s(b) for b in cost["other_sizes"]) if measured else cost["other_bytes"] / hbm
    return {"gemm_s": gemm, "memory_s": memory, "comm_s": comm,
            "gemm_flops": float(sum(g[0] for g in cost["gemms"])), "memory_bound_gemms": float(bound),
            "collectives": float(len(cost["collectives"])), "other_bytes": float(cost["other_bytes"]),
            "gemm_bytes": float(sum(g[1] for g in cost["gemms"] if not g[2])),
            "score_bytes_excluded": float(cost["score_bytes_excluded"]),
            "move_bytes_excluded": float(cost["move_bytes_excluded"]),
            "comm_bytes": float(sum(b for _, b, _ in cost["collectives"]))}


def scaled(cost: dict[str, Any], f: float) -> dict[str, Any]:
    """`cost` with every GEMM's FLOPs and bytes and every other instruction's bytes times `f` (an update
    whose state ZeRO shards over data: the same instructions on 1/data of the arrays)."""
    return {**cost, "gemms": [(g * f, b * f, *rest) for g, b, *rest in cost["gemms"]], "other_bytes": cost["other_bytes"] * f,
            "other_sizes": [b * f for b in cost["other_sizes"]]}


def split_layers(one: dict[str, float], two: dict[str, float], layers: float) -> dict[str, float]:
    """`rest + layers x layer` from a 1-layer and a 2-layer program's figures (layer = two - one)."""
    return {k: (one[k] - (two[k] - one[k])) + layers * (two[k] - one[k]) for k in one}


__all__ = ["Hardware", "coll_time", "instruction_s", "program_cost", "program_time", "scaled", "split_layers"]
