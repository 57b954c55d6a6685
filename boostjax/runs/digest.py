"""File digests at disk speed: what checkpoint checksums and data fingerprints are made of.

BLAKE3 (the `blake3` package, the reference implementation's Python binding) hashes one file at
about 4.7 GB/s on one core of the development machine (AVX-512), SHA-256 at 1.3 GB/s with the SHA
extensions (experiments/results/checkpoint_verify.md); either is then limited by the disk. Files are
read in `CHUNK` pieces into one reused buffer and hashed on `workers` threads at once (BLAKE3 and
hashlib release the GIL while they hash), so several files use several cores and disks.

`SHA256` stays readable for the manifests of older checkpoints (`sha256sum` format); new ones are
BLAKE3 (`b3sum` format: `b3sum -c BLAKE3SUMS` checks one by hand).
"""

from __future__ import annotations

import hashlib
import os
import pathlib
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable

import blake3

BLAKE3, SHA256 = "blake3", "sha256"
HEX_LEN: dict[str, int] = {BLAKE3: 64, SHA256: 64}  # hex digits of a digest
CHUNK: int = 1 << 24  # bytes read at a time (16 MiB: large enough that the GIL is released per read)
MAX_WORKERS: int = 8  # threads hashing files at once (more rarely helps: the disk is the limit)


def _hasher(algo: str) -> Callable[[], object]:
    if algo == BLAKE3:
        return blake3.blake3
    if algo == SHA256:
        return hashlib.sha256
    raise ValueError(f"digest: unknown algorithm {algo!r}; fix: one of {BLAKE3}, {SHA256}")


def file_digest(path: str | os.PathLike, algo: str = BLAKE3) -> str:
    """The hex digest of one file's bytes (read in `CHUNK` pieces into one buffer, no larger than the
    file: a 16 MiB buffer zeroed for each of the stdlib's 1,790 small sources took 4 s)."""
    h = _hasher(algo)()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(max(1, min(CHUNK, os.fstat(f.fileno()).st_size)))
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def file_digests(paths: Iterable[str | os.PathLike], algo: str = BLAKE3, workers: int = 0) -> list[str]:
    """`file_digest` of each path, in order, hashed on up to `workers` threads (0: one per core, at most
    `MAX_WORKERS`). An OSError of any file is raised."""
    paths = list(paths)
    workers = workers or min(MAX_WORKERS, os.cpu_count() or 1)
    if len(paths) <= 1 or workers == 1:
        return [file_digest(p, algo) for p in paths]
    # the largest first, so that the last thread does not start one big file alone at the end
    order = sorted(range(len(paths)), key=lambda i: -_size(paths[i]))
    with ThreadPoolExecutor(min(workers, len(paths))) as pool:
        got = dict(zip(order, pool.map(lambda i: file_digest(paths[i], algo), order)))
    return [got[i] for i in range(len(paths))]


def _size(path: str | os.PathLike) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def digest_of_lines(lines: Iterable[str]) -> str:
    """BLAKE3 of text lines (e.g. `"<digest>  <name>"` per file): one digest standing for many files."""
    h = blake3.blake3()
    for line in lines:
        h.update(line.encode("utf-8"))
    return h.hexdigest()


def tree_lines(root: pathlib.Path, files: Iterable[pathlib.Path], workers: int = 0) -> list[str]:
    """`"<blake3>  <path relative to root>\\n"` per file (the `b3sum` line), in the order given."""
    files = list(files)
    return [f"{d}  {p.relative_to(root).as_posix()}\n" for d, p in zip(file_digests(files, BLAKE3, workers), files)]
