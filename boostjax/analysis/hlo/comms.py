"""Collectives in compiled HLO: kind, result shapes, bytes (as moved and logical), replica groups."""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from boostjax.analysis.hlo.parse import Array, COLLECTIVE_KINDS, FLOAT_BITS, Instr, Module, MOVE_OPS, parse_module


# XLA's iota form of a device list: `[dims]` (ids 0..n-1 in that shape), or `[dims]<=[reshape]` (the ids
# laid out in `reshape`, then read as `dims`), either with `T(perm)` (`reshape` transposed first)
IOTA = r"\[([\d,]+)\](?:<=\[([\d,]+)\])?(?:T\(([\d,]+)\))?"


def _iota_ids(m: re.Match) -> np.ndarray:
    """The device ids of an `IOTA` match, in the shape of its `reshape` (or `dims`) after the transpose."""
    shape = [int(x) for x in (m.group(2) or m.group(1)).split(",")]
    ids = np.arange(int(np.prod(shape))).reshape(shape)
    return ids.transpose([int(x) for x in m.group(3).split(",")]) if m.group(3) else ids


def _groups(instr: Instr) -> list[list[int]]:
    """Replica groups as lists of device ids ([] = one group of all devices, size unknown)."""
    if instr.opcode.startswith("collective-permute"):
        pairs = instr.attr("source_target_pairs") or ""
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs)]
    text = instr.attr("replica_groups")
    if not text or text == "{}":
        return []
    if text.startswith("mesh["):
        devices = instr.attr("device_ids")  # `mesh[...], device_ids=(...) {...}`: the axes come after it
        return _mesh_groups(f"{text}, device_ids={devices}" if devices else text)
    iota = re.match(IOTA, text)
    if iota:
        return _iota_ids(iota).reshape(int(iota.group(1).split(",")[0]), -1).tolist()
    return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", text)]


def _mesh_groups(text: str) -> list[list[int]]:
    """Groups of the mesh-axes form `mesh['x'=2,'y'=4](, device_ids=(...))? {'y', 'x':(1)2}`.

    A group holds the devices that differ only along the listed (sub-)axes; a sub-axis
    `name:(pre)size` is the `size`-long factor of that axis after `pre` major ones (Shardy).
    """
    head = re.match(r"mesh\[([^\]]*)\](.*)", text)
    if not head:
        return []
    axes = [(n.strip("'\" "), int(s)) for n, s in re.findall(r"([^,=]+)=(\d+)", head.group(1))]
    rest = head.group(2)
    sizes = [s for _, s in axes]
    ids = np.arange(int(np.prod(sizes)))
    dev = re.search(r"device_ids=\(" + IOTA + r"\)", rest)  # an iota form: `[2,2]T(1,0)`
    if dev:
        ids = _iota_ids(dev).reshape(-1)
    else:
        dev = re.search(r"device_ids=\(([\d,\s]*)\)", rest)  # or the ids listed
        found = [int(x) for x in re.findall(r"\d+", dev.group(1))] if dev else []
        if len(found) == ids.size:
            ids = np.asarray(found)
    brace = re.search(r"\{([^}]*)\}\s*$", rest)
    refs = re.findall(r"['\"]?([\w.\-]+)['\"]?(?::\((\d+)\)(\d+))?", brace.group(1)) if brace else []
    # split every mesh axis into (pre, size, post) factors so sub-axes become whole dims
    names = [n for n, _ in axes]
    split: list[list[int]] = [[1, s, 1] for s in sizes]
    picked: list[tuple[int, int]] = []
    for name, pre, size in refs:
        if name not in names:
            continue
        i = names.index(name)
        if pre:
            split[i] = [int(pre), int(size), sizes[i] // (int(pre) * int(size))]
        picked.append((i, 1))
    shape = [f for parts in split for f in parts]
    arr = ids.reshape(shape)
    grouped = [3 * i + k for i, k in picked]
    others = [d for d in range(arr.ndim) if d not in grouped]
    arr = arr.transpose(others + grouped)
    size = int(np.prod([shape[d] for d in grouped])) if grouped else 1
    return arr.reshape(-1, size).tolist()


@dataclass(frozen=True)
class Collective:
    kind: str  # one of COLLECTIVE_KINDS
    name: str
    results: tuple[Array, ...]
    logical_dtypes: tuple[str, ...]  # element type before a backend widening (see module docstring)
    groups: tuple[tuple[int, ...], ...]
    op_name: str = ""
    is_async: bool = False
    computation: str = ""

    @property
    def bytes(self) -> int:
        return sum(a.bytes() for a in self.results)

    @property
    def logical_bytes(self) -> int:
        return sum(a.bytes(dt) for a, dt in zip(self.results, self.logical_dtypes))

    @property
    def elements(self) -> int:
        return sum(a.elements for a in self.results)

    @property
    def group_size(self) -> int:
        return max((len(g) for g in self.groups), default=0)

    @property
    def trivial(self) -> bool:
        """Every group holds one device: nothing is communicated."""
        return bool(self.groups) and self.group_size <= 1 and not self.kind.startswith("collective-permute")

    @property
    def dtypes(self) -> tuple[str, ...]:
        return tuple(a.dtype for a in self.results)


def _producer(mod: Module, ins: Instr) -> tuple[str, str] | None:
    """(computation, name) of the value `ins` merely moves: the operand of a convert / bitcast /
    copy / reshape / transpose, the root of a fusion, the caller's operand for a fused parameter."""
    if ins.opcode in MOVE_OPS and ins.operands:
        return ins.computation, ins.operands[0]
    if ins.opcode == "fusion":
        called = (ins.attr("calls") or "").lstrip("%")
        root = mod.root(called)
        return (called, root.name) if root is not None else None
    if ins.opcode == "parameter" and ins.computation != mod.entry:
        call, idx = mod.caller(ins.computation), ins.param_index
        if call is not None and idx < len(call.operands):
            return call.computation, call.operands[idx]
    return None


def _chain(mod: Module, computation: str, name: str, limit: int = 64) -> tuple[list[Instr], Instr | None]:
    """The data-movement chain above a value, and the instruction it ends at (None: unknown)."""
    seen: list[Instr] = []
    for _ in range(limit):
        ins = mod.lookup(computation, name)
        if ins is None:
            return seen, None
        seen.append(ins)
        nxt = _producer(mod, ins)
        if nxt is None:
            return seen, ins
        computation, name = nxt
    return seen, None


def logical_dtype(mod: Module, computation: str, name: str) -> str | None:
    """The narrowest float type a value passes through on its data-movement chain.

    A value that was rounded to bf16 and widened to f32 (the CPU backend's way to all-reduce bf16)
    has logical type bf16; a genuine f32 value stays f32.
    """
    seen, _ = _chain(mod, computation, name)
    types = [i.results[0].dtype for i in seen if len(i.results) == 1]
    floats = [t for t in types if t in FLOAT_BITS]
    if not floats:
        return types[0] if types else None
    return min(floats, key=lambda t: FLOAT_BITS[t])


def from_parameter(mod: Module, computation: str, name: str) -> bool:
    """Whether a value is an entry parameter seen through data movement and fusions.

    In a training step the weights enter as entry parameters; activations are computed. A GEMM
    with such an operand is a projection; one with none (q·k, p·v) is attention arithmetic.
    """
    _, end = _chain(mod, computation, name)
    return end is not None and end.opcode == "parameter" and end.computation == mod.entry


def collectives(text_or_module: str | Module) -> list[Collective]:
    """Every collective of the module (async pairs once), in program text order."""
    mod = parse_module(text_or_module) if isinstance(text_or_module, str) else text_or_module
    out: list[Collective] = []
    for comp, instrs in mod.computations.items():
        for ins in instrs:
            op = ins.opcode
            is_async = op.endswith("-done")
            base = op[: -len("-done")] if is_async else op
            if base not in COLLECTIVE_KINDS or op.endswith("-start"):
                continue
            src = ins
            if is_async and ins.operands:  # the -start holds the attributes and the real operands
                src = mod.lookup(comp, ins.operands[0]) or ins
            results = ins.results
            operands = src.operands if len(src.operands) == len(results) else ()
            logical = []
            for k, a in enumerate(results):
                lt = logical_dtype(mod, comp, operands[k]) if operands else None
                widened = lt in FLOAT_BITS and a.dtype in FLOAT_BITS and FLOAT_BITS[lt] < FLOAT_BITS[a.dtype]
                logical.append(lt if widened else a.dtype)
            opn = re.search(r'op_name="([^"]*)"', src.attrs)
            out.append(Collective(base, ins.name, results, tuple(logical),
                                  tuple(tuple(g) for g in _groups(src)), opn.group(1) if opn else "",
                                  is_async, comp))
    return out


def collective_summary(text_or_module: str | Module, *, include_trivial: bool = False) -> dict[str, dict[str, int]]:
    """{kind: {"count", "bytes", "logical_bytes", "elements"}} over the module's collectives.

    Collectives whose groups hold a single device (e.g. a psum over a mesh axis of size 1) move
    nothing and are left out unless `include_trivial`.
    """
    out: dict[str, dict[str, int]] = {}
    for c in collectives(text_or_module):
        if c.trivial and not include_trivial:
            continue
        s = out.setdefault(c.kind, {"count": 0, "bytes": 0, "logical_bytes": 0, "elements": 0})
        s["count"] += 1
        s["bytes"] += c.bytes
        s["logical_bytes"] += c.logical_bytes
        s["elements"] += c.elements
    return out
