"""A run folder as the fault campaign reads it, independently of boostjax: metrics.jsonl records,
committed checkpoints and their BLAKE3SUMS (hashed here with the blake3 package), Orbax temporary folders, checkpoints moved
aside; one checkpoint damaged in place; loss records compared bit for bit with the reference's."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import struct

import blake3
import numpy as np

from experiments.faults.plan import PROBE

MANIFEST, TMP, ASIDE = "BLAKE3SUMS", "orbax-checkpoint-tmp", "checkpoints-aside"


# ---------------------------------------------------------------------------------- run folder


def read_records(folder: pathlib.Path) -> list[dict]:
    """metrics.jsonl records; a last line cut short by a kill is skipped."""
    try:
        lines = (folder / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for i, line in enumerate(lines):
        try:
            out.append(json.loads(line))
        except ValueError:
            if i != len(lines) - 1:
                raise
    return out


def loss_records(records: list[dict]) -> list[dict]:
    return [r for r in records if "loss" in r]


def history_start(folder: pathlib.Path, pid: int) -> int | None:
    """The step the process `pid` started from (its config_history.jsonl line), None before it got there."""
    try:
        lines = (folder / "config_history.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return None
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("pid") == pid:
            return rec["start_step"]
    return None


def checkpoints(folder: pathlib.Path) -> dict[int, bool]:
    """{step: has BLAKE3SUMS} of the committed steps."""
    ck = folder / "checkpoints"
    try:
        names = os.listdir(ck)
    except FileNotFoundError:
        return {}
    return {int(n): os.path.exists(ck / n / MANIFEST) for n in names if n.isdigit()}


def leftovers(folder: pathlib.Path) -> dict[str, tuple[int, int]]:
    """Orbax temporary folders and the trash folder a kill can leave in checkpoints/, with their identity
    (inode, ctime): a later save of the same step makes a new folder of the same name."""
    ck = folder / "checkpoints"
    out = {}
    try:
        for n in os.listdir(ck):
            if TMP in n or n == ".trash":
                st = os.stat(ck / n)
                out[n] = (st.st_ino, st.st_ctime_ns)
    except FileNotFoundError:
        pass
    return out


def aside(folder: pathlib.Path) -> list[str]:
    try:
        return sorted(os.listdir(folder / ASIDE))
    except FileNotFoundError:
        return []


def saves_in_flight(folder: pathlib.Path, ignore: set[str]) -> set[int]:
    """Steps being saved: an Orbax temporary folder, or a committed step without BLAKE3SUMS yet."""
    ck = folder / "checkpoints"
    try:
        names = os.listdir(ck)
    except FileNotFoundError:
        return set()
    out = set()
    for n in names:
        if n in ignore:
            continue
        if TMP in n and n.split(".")[0].isdigit():
            out.add(int(n.split(".")[0]))
        elif n.isdigit() and not os.path.exists(ck / n / MANIFEST):
            out.add(int(n))
    return out


def _blake3(path: pathlib.Path) -> str:
    return blake3.blake3(path.read_bytes()).hexdigest()


def verify(step_dir: pathlib.Path) -> str | None:
    """Why `step_dir` does not match its BLAKE3SUMS (None if it does); hashed here, not by boostjax."""
    try:
        entries = [line.split("  ", 1) for line in (step_dir / MANIFEST).read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return f"no {MANIFEST}"
    listed = {rel for _, rel in entries}
    on_disk = {p.relative_to(step_dir).as_posix() for p in step_dir.rglob("*") if p.is_file() and p.name != MANIFEST}
    if on_disk - listed:
        return f"files not in {MANIFEST}: {sorted(on_disk - listed)[:3]}"
    for digest, rel in entries:
        p = step_dir / rel
        if not p.is_file():
            return f"{rel}: missing"
        if _blake3(p) != digest:
            return f"{rel}: checksum mismatch"
    return None


# ------------------------------------------------------------------------------------- damage


def _files(step_dir: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in step_dir.rglob("*") if p.is_file() and p.name != MANIFEST)


def _flip(p: pathlib.Path) -> int:
    """Invert 64 bytes in the middle of `p`; returns the offset."""
    b = bytearray(p.read_bytes())
    mid = max(0, len(b) // 2 - 32)
    b[mid:mid + 64] = bytes(x ^ 0xFF for x in b[mid:mid + 64])
    p.write_bytes(bytes(b))
    return mid


def damage(step_dir: pathlib.Path, kind: str, rng: np.random.Generator) -> str:
    """Damage one checkpoint in place; returns what was done."""
    rel = lambda p: p.relative_to(step_dir).as_posix()  # noqa: E731
    if kind in ("flip", PROBE):
        if kind == PROBE:
            (step_dir / MANIFEST).unlink(missing_ok=True)
        largest = max(_files(step_dir), key=lambda p: p.stat().st_size)
        size = largest.stat().st_size
        mid = _flip(largest)
        return f"{f'deleted {MANIFEST}; ' if kind == PROBE else ''}inverted bytes {mid}..{mid + 64} of {rel(largest)} ({size} B)"
    if kind == "truncate":
        files = [p for p in _files(step_dir) if p.stat().st_size > 0]
        p = files[rng.integers(len(files))]
        size = p.stat().st_size
        new = int(rng.integers(0, size))
        os.truncate(p, new)
        return f"truncated {rel(p)} from {size} to {new} B"
    if kind == "delete-file":
        files = _files(step_dir)
        p = files[rng.integers(len(files))]
        p.unlink()
        return f"deleted {rel(p)}"
    if kind == "delete-data":
        shutil.rmtree(step_dir / "data")
        return "deleted data/"
    raise ValueError(kind)


# ------------------------------------------------------------------------------ against the reference


def same(a: float, b: float) -> bool:
    """Bit-identical (both parsed from the JSON the runs wrote)."""
    return struct.pack("<d", a) == struct.pack("<d", b)


def compare(records: list[dict], ref: dict[int, dict], complete: bool) -> dict:
    """Loss records against the reference: missing steps (all of 1..N when `complete`, else 1..last),
    duplicates, extra steps and steps whose loss / grad norm / lr differ."""
    steps = [r["step"] for r in records]
    seen = set(steps)
    last = max(ref) if complete else (max(steps) if steps else 0)
    different = [r["step"] for r in records if r["step"] in ref and not all(
        same(r[k], ref[r["step"]][k]) for k in ("loss", "grad_norm", "lr"))]
    return {"records": len(records), "missing": [s for s in range(1, last + 1) if s not in seen][:50],
            "duplicates": sorted({s for s in steps if steps.count(s) > 1})[:50],
            "extra": sorted(seen - set(ref))[:50], "different": different[:50], "n_different": len(different)}


def compare_ok(c: dict) -> bool:
    return not (c["missing"] or c["duplicates"] or c["extra"] or c["n_different"])
