"""One split of a tokenised folder as its shard files, read by the byte ranges a batch needs.

`TokenShards` stands where a token array stood (``len``, ``dtype``, indexing by an int array or a
slice, ``np.asarray``): a gather reads only the contiguous runs of positions it touches, each with
``os.preadv`` straight into the output (a run that crosses shards is read from each), so a process
of a multi-host run reads its own rows' bytes and nothing else. ``bytes_read`` counts them.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any, Sequence

import numpy as np


def runs(src_bs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first position, length) of every run of consecutive positions in the rows of ``src_bs``
    (int64[b, n]), row by row: the contiguous pieces of the stream a batch reads."""
    flat = src_bs.reshape(-1)
    first = np.ones(flat.shape, bool)  # a run starts at every row and wherever a position does not follow the last
    first[1:] = flat[1:] != flat[:-1] + 1
    if src_bs.ndim > 1:
        first[:: src_bs.shape[-1]] = True
    at = np.flatnonzero(first)
    return flat[at], np.diff(np.append(at, flat.size))


class TokenShards:
    """The token ids of ``files`` (each ``counts[i]`` ids of ``dtype``), one stream in that order."""

    ndim = 1

    def __init__(self, files: Sequence[str | os.PathLike], counts: Sequence[int], dtype: str | np.dtype):
        if len(files) != len(counts) or not files:
            raise ValueError(f"TokenShards: need one count per file, got {len(files)} files, {len(counts)} counts")
        self.files = [pathlib.Path(f) for f in files]
        self.dtype = np.dtype(dtype)
        self.edges = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)  # shard i holds [edges[i], edges[i+1])
        self.bytes_read = 0  # bytes read from the files so far
        first = self.files[0]  # what messages name: the file, or the shards as a pattern
        self.filename = str(first) if len(self.files) == 1 else str(first.with_name(first.name.rsplit("-", 1)[0] + "-*.bin"))
        self._fds: dict[int, int] = {}

    def __len__(self) -> int:
        return int(self.edges[-1])

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    @property
    def size(self) -> int:
        return len(self)

    def __repr__(self) -> str:
        return f"TokenShards({len(self)} {self.dtype} tokens in {len(self.files)} file{'s' * (len(self.files) > 1)})"

    def _fd(self, shard: int) -> int:
        if shard not in self._fds:
            try:
                self._fds[shard] = os.open(self.files[shard], os.O_RDONLY)
            except OSError as e:
                raise ValueError(f"data: cannot read {self.files[shard]}: {e.strerror or type(e).__name__}; fix: "
                                 "check that the file is readable, or tokenise the text again") from None
        return self._fds[shard]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __del__(self) -> None:
        try:
            self.close()
        except (OSError, AttributeError):
            pass

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fds": {}}

    def read_runs(self, first: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """The ids of the runs ``[first[i], first[i] + lengths[i])``, concatenated in order."""
        item = self.dtype.itemsize
        out = np.empty(int(lengths.sum()), self.dtype)
        if out.size == 0:
            return out
        last = first + lengths
        if first.min() < 0 or last.max() > len(self):
            raise IndexError(f"TokenShards: positions outside [0, {len(self)})")
        dst = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        shard = np.searchsorted(self.edges, first, side="right") - 1
        end_shard = np.searchsorted(self.edges, last - 1, side="right") - 1
        cross = end_shard != shard
        pieces = list(zip(shard[~cross].tolist(), first[~cross].tolist(), lengths[~cross].tolist(), dst[~cross].tolist()))
        for i in np.flatnonzero(cross).tolist():  # a run across a shard boundary: one piece per shard
            a, b, d = int(first[i]), int(last[i]), int(dst[i])
            for s in range(int(shard[i]), int(end_shard[i]) + 1):
                lo, hi = max(a, int(self.edges[s])), min(b, int(self.edges[s + 1]))
                pieces.append((s, lo, hi - lo, d + lo - a))
        buf = memoryview(out.view(np.uint8))
        todo = [(s, self._fd(s), (a - int(self.edges[s])) * item, n * item, d * item) for s, a, n, d in pieces]
        if hasattr(os, "posix_fadvise") and len(todo) > 1:  # ask for every piece at once: cold reads overlap
            for _, fd, at, n, _ in todo:
                os.posix_fadvise(fd, at, n, os.POSIX_FADV_WILLNEED)
        for s, fd, at, n, d in todo:
            got = 0
            while got < n:
                k = os.preadv(fd, [buf[d + got:d + n]], at + got)
                if k <= 0:
                    raise ValueError(f"data: {self.files[s]} ends at byte {at + got}, before the tokens its metadata "
                                     "names; fix: tokenise the text again (boostjax tokenize)")
                got += k
            self.bytes_read += n
        return out

    def gather(self, src: np.ndarray) -> np.ndarray:
        """``tokens[src]`` for an integer array ``src`` of any shape: only its runs are read."""
        src = np.asarray(src, np.int64)
        if src.size == 0:
            return np.empty(src.shape, self.dtype)
        first, lengths = runs(src.reshape(-1, src.shape[-1]) if src.ndim else src.reshape(1))
        return self.read_runs(first, lengths).reshape(src.shape)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                return self.gather(np.arange(start, stop, step, dtype=np.int64))
            n = max(stop - start, 0)
            return self.read_runs(np.array([start], np.int64), np.array([n], np.int64))
        if isinstance(key, (int, np.integer)):
            i = int(key) + len(self) * (int(key) < 0)
            if not 0 <= i < len(self):
                raise IndexError(f"TokenShards: index {int(key)} outside [0, {len(self)})")
            return self.read_runs(np.array([i], np.int64), np.array([1], np.int64))[0]
        return self.gather(np.asarray(key))

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        """Every id, read whole (explicitly: a batch reads its rows through indexing)."""
        whole = self[:]
        return whole if dtype is None else whole.astype(dtype)

    def tobytes(self) -> bytes:
        return np.asarray(self).tobytes()
