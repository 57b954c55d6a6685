"""Compiled HLO text into `Module` (computations of `Instr` records) and `Array` shapes."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "s32": 32, "u32": 32,
        "s64": 64, "u64": 64, "f16": 16, "bf16": 16, "f32": 32, "f64": 64, "c64": 64, "c128": 128,
        "f8e4m3fn": 8, "f8e5m2": 8, "f8e4m3": 8, "f8e4m3fnuz": 8, "f8e5m2fnuz": 8, "f8e4m3b11fnuz": 8,
        "f8e3m4": 8, "f4e2m1fn": 4, "f8e8m0fnu": 8, "token": 0}
FLOAT_BITS = {"f16": 16, "bf16": 16, "f32": 32, "f64": 64}
COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all",
                    "ragged-all-to-all", "collective-broadcast")
MOVE_OPS = {"bitcast", "copy", "reshape", "transpose", "convert"}

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

    @property
    def param_index(self) -> int:
        """A `parameter` instruction's number (its position among the computation's arguments)."""
        m = re.match(r"\s*(\d+)", self.args)
        return int(m.group(1)) if m else 0

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
        self._loop: dict[str, Instr] = {}

    def index(self) -> None:
        self._by_name = {(i.computation, i.name): i for c in self.computations.values() for i in c}
        self._caller = {}
        self._loop: dict[str, Instr] = {}
        for instrs in self.computations.values():
            for i in instrs:
                called = i.attr("calls") if i.opcode in ("fusion", "call") else None
                if called:
                    self._caller.setdefault(called.lstrip("%"), i)
                if i.opcode == "while" and i.attr("body"):
                    self._loop.setdefault(i.attr("body").lstrip("%"), i)

    def caller(self, computation: str) -> Instr | None:
        """The fusion / call instruction that calls `computation` (None for the entry)."""
        return self._caller.get(computation)

    def runs(self, computation: str) -> int | None:
        """How many times `computation` runs per run of the entry: the product of the known trip counts
        (`known_trip_count` in XLA's backend config) of the while loops whose body holds it, through
        calls and fusions; None where a loop's trip count is unknown."""
        n, comp, seen = 1, computation, set()
        while comp not in seen:
            seen.add(comp)
            loop = self._loop.get(comp)
            if loop is not None:
                m = re.search(r'"known_trip_count":\{"n":"(\d+)"', loop.attrs)
                if not m:
                    return None
                n, comp = n * int(m.group(1)), loop.computation
                continue
            call = self._caller.get(comp)
            if call is None:
                return n
            comp = call.computation
        return n

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
