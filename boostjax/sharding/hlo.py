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

Counts are static: an op inside a loop body is counted once (the models here unroll their layers).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "s32": 32, "u32": 32,
        "s64": 64, "u64": 64, "f16": 16, "bf16": 16, "f32": 32, "f64": 64, "c64": 64, "c128": 128,
        "f8e4m3fn": 8, "f8e5m2": 8, "f8e4m3": 8, "f8e4m3fnuz": 8, "f8e5m2fnuz": 8, "f8e4m3b11fnuz": 8,
        "f8e3m4": 8, "f4e2m1fn": 4, "f8e8m0fnu": 8, "token": 0}
FLOAT_BITS = {"f16": 16, "bf16": 16, "f32": 32, "f64": 64}
COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all",
                    "ragged-all-to-all", "collective-broadcast")
_MOVE_OPS = {"bitcast", "copy", "reshape", "transpose", "convert"}

_SHAPE = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_COMP = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_OPCODE = re.compile(r"\s*([a-z][a-z0-9\-]*)\(")


@dataclass(frozen=True)
class Array:
    dtype: str
    shape: tuple[int, ...]

    @property
    def elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    def bytes(self, dtype: str | None = None) -> int:
        return self.elements * BITS.get(dtype or self.dtype, 0) // 8

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.shape))}]"


@dataclass(frozen=True)
class Instr:
    name: str
    opcode: str
    results: tuple[Array, ...]  # one per tuple element (one for an array result)
    operands: tuple[str, ...]
    attrs: str  # everything after the operand list
    args: str  # the raw text between the opcode's parentheses
    computation: str
    is_root: bool = False

    def attr(self, key: str) -> str | None:
        m = re.search(r"\b" + re.escape(key) + r"=", self.attrs)
        if not m:
            return None
        i, depth, out = m.end(), 0, []
        while i < len(self.attrs):
            ch = self.attrs[i]
            if ch in "{[(":
                depth += 1
            elif ch in "}])":
                depth -= 1
            if (ch == "," and depth == 0) or depth < 0:
                break
            out.append(ch)
            i += 1
        return "".join(out).strip()


@dataclass
class Module:
    computations: dict[str, list[Instr]] = field(default_factory=dict)
    entry: str = ""
    frames: dict[int, tuple[str, str, int]] = field(default_factory=dict)  # frame id -> (function, file, line)
    frame_parent: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._by_name: dict[tuple[str, str], Instr] = {}
        self._caller: dict[str, Instr] = {}

    def index(self) -> None:
        self._by_name = {(i.computation, i.name): i for c in self.computations.values() for i in c}
        self._caller = {}
        for instrs in self.computations.values():
            for i in instrs:
                called = i.attr("calls") if i.opcode in ("fusion", "call") else None
                if called:
                    self._caller.setdefault(called.lstrip("%"), i)

    def caller(self, computation: str) -> Instr | None:
        """The fusion / call instruction that calls `computation` (None for the entry)."""
        return self._caller.get(computation)

    def lookup(self, computation: str, name: str) -> Instr | None:
        return self._by_name.get((computation, name))

    def root(self, computation: str) -> Instr | None:
        instrs = self.computations.get(computation, [])
        return next((i for i in instrs if i.is_root), instrs[-1] if instrs else None)

    def source(self, instr: Instr) -> list[tuple[str, str, int]]:
        """(function, file, line) of the instruction's Python stack, innermost first."""
        m = re.search(r"stack_frame_id=(\d+)", instr.attrs)
        if m:
            out, fid, seen = [], int(m.group(1)), set()
            while fid in self.frames and fid not in seen:
                seen.add(fid)
                out.append(self.frames[fid])
                fid = self.frame_parent.get(fid, fid)
            return out
        f = re.search(r'source_file="([^"]*)"', instr.attrs)
        ln = re.search(r"source_line=(\d+)", instr.attrs)
        return [("", f.group(1), int(ln.group(1)) if ln else 0)] if f else []


def parse_shapes(text: str) -> tuple[Array, ...]:
    """All array shapes in a (possibly tuple) HLO type string, in order."""
    text = re.sub(r"/\*.*?\*/", "", text)
    return tuple(Array(dt, tuple(int(x) for x in dims.split(",") if x)) for dt, dims in _SHAPE.findall(text)
                 if dt in BITS)


def _split_type(rest: str) -> tuple[str, str]:
    """Split `TYPE opcode(...)...` into the type text and the remainder starting at the opcode."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rest[: i + 1], rest[i + 1 :]
    m = re.match(r"\S+", rest)
    return (m.group(0), rest[m.end() :]) if m else ("", rest)


def _parse_instr(line: str, computation: str) -> Instr | None:
    m = _INSTR.match(line)
    if not m:
        return None
    type_text, rest = _split_type(m.group(3).strip())
    om = _OPCODE.match(rest)
    if not om:
        return None
    i, depth = om.end(), 1
    start = i
    while i < len(rest) and depth:
        depth += rest[i] == "("
        depth -= rest[i] == ")"
        i += 1
    operand_text = rest[start : i - 1]
    operands = tuple(re.findall(r"%([\w.\-]+)", operand_text))
    if not operands and operand_text and not re.search(r"[{\"]", operand_text):
        operands = tuple(t.split()[-1] for t in operand_text.split(",") if t.strip() and not t.strip()[0].isdigit())
    return Instr(m.group(2), om.group(1), parse_shapes(type_text), operands, rest[i:].lstrip(", "),
                 operand_text, computation, bool(m.group(1)))


def parse_module(text: str) -> Module:
    """Parse HLO module text into computations of `Instr`, plus the stack-frame tables if present."""
    mod, comp, section = Module(), None, None
    files: dict[int, str] = {}
    funcs: dict[int, str] = {}
    locs: dict[int, tuple[int, int, int]] = {}
    for line in text.splitlines():
        s = line.strip()
        if comp is None:
            if s in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
                section = s
                continue
            if section and s:
                num = re.match(r"(\d+)\s+(.*)", s)
                if num:
                    k, body = int(num.group(1)), num.group(2)
                    if section == "FileNames":
                        files[k] = body.strip('"')
                    elif section == "FunctionNames":
                        funcs[k] = body.strip('"')
                    elif section == "FileLocations":
                        g = dict(re.findall(r"(\w+)=(\d+)", body))
                        locs[k] = (int(g.get("file_name_id", 0)), int(g.get("function_name_id", 0)),
                                   int(g.get("line", 0)))
                    else:
                        g = dict(re.findall(r"(\w+)=(\d+)", body))
                        loc = locs.get(int(g.get("file_location_id", 0)), (0, 0, 0))
                        mod.frames[k] = (funcs.get(loc[1], ""), files.get(loc[0], ""), loc[2])
                        mod.frame_parent[k] = int(g.get("parent_frame_id", k))
                    continue
                section = None
            cm = _COMP.match(line)
            if cm:
                comp = cm.group(2)
                mod.computations[comp] = []
                if cm.group(1):
                    mod.entry = comp
            continue
        if s == "}":
            comp = None
            continue
        ins = _parse_instr(line, comp)
        if ins is not None:
            mod.computations[comp].append(ins)
    mod.index()
    return mod


# -- collectives -------------------------------------------------------------------------------------

def _groups(instr: Instr) -> list[list[int]]:
    """Replica groups as lists of device ids ([] = one group of all devices, size unknown)."""
    if instr.opcode.startswith("collective-permute"):
        pairs = instr.attr("source_target_pairs") or ""
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs)]
    text = instr.attr("replica_groups")
    if not text or text == "{}":
        return []
    if text.startswith("mesh["):
        return _mesh_groups(text)
    iota = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
    if iota:
        gshape = [int(x) for x in iota.group(1).split(",")]
        rshape = [int(x) for x in iota.group(2).split(",")]
        ids = np.arange(int(np.prod(rshape))).reshape(rshape)
        if iota.group(3):
            ids = ids.transpose([int(x) for x in iota.group(3).split(",")])
        return ids.reshape(gshape[0], -1).tolist()
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
    dev = re.search(r"device_ids=\(([^)]*)\)", rest)
    if dev:
        found = [int(x) for x in re.findall(r"\d+", dev.group(1))]
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
    if ins.opcode in _MOVE_OPS and ins.operands:
        return ins.computation, ins.operands[0]
    if ins.opcode == "fusion":
        called = (ins.attr("calls") or "").lstrip("%")
        root = mod.root(called)
        return (called, root.name) if root is not None else None
    if ins.opcode == "parameter" and ins.computation != mod.entry:
        call, idx = mod.caller(ins.computation), _param_index(ins)
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


def _param_index(ins: Instr) -> int:
    m = re.match(r"\s*(\d+)", ins.args)
    return int(m.group(1)) if m else 0


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


# -- GEMMs ------------------------------------------------------------------------------------------

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

    @property
    def function(self) -> str:
        return self.source[0][0] if self.source else ""

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
