"""Batches: a deterministic, resumable, process-sharded iterator over a token stream.

Where the document boundaries are known (``Corpus.train_docs``/``val_docs``: the files of the stdlib
corpus and of a folder, the documents of a tokenised folder), `DocumentIterator` packs documents: epoch
``e`` concatenates every document (each ends with its separator: EOS, or ``b"\\n\\n"`` at byte level)
in the order of a permutation seeded by ``(seed, e)`` and cuts that stream into rows of ``seq + 1``
tokens (stride ``seq``, so every next-token pair is trained once per epoch), visited in a second
permutation; ``segments`` gives each position its document's number in the row. Otherwise
`BatchIterator` draws random windows: global batch ``k``'s starts come from
``np.random.default_rng([seed, k])``. Either way batch ``k`` is a pure function of ``(seed, k)`` and each
process reads only its contiguous block of rows, so batches are deterministic, resumable from
``state()`` and independent of the process count. `MixtureIterator` draws each row of a batch from one
of several document streams by weight (``--data A:0.7,B:0.3``), each stream packed by its own
`DocumentIterator`. From a memory-mapped file, a batch's pages are asked for all at once before they
are gathered (`prefetch`); from a tokenised folder (`boostjax.data.shards.TokenShards`), only the byte
ranges of this process's rows are read.
"""

from __future__ import annotations

import os
from typing import Any, Iterator

import numpy as np

from boostjax.data.shards import TokenShards, runs


def file_range(tokens: np.ndarray) -> tuple[str, int] | None:
    """(file, byte offset of ``tokens[0]`` in it) of a contiguous memory-mapped stream (a split may be
    a slice of the file's memmap); None for an array in memory."""
    if not isinstance(tokens, np.memmap) or not tokens.flags.c_contiguous:
        return None
    root = tokens
    while isinstance(root.base, np.ndarray):
        root = root.base
    if not isinstance(root, np.memmap) or not root.filename:
        return None
    return os.fspath(root.filename), int(root.offset) + tokens.ctypes.data - root.ctypes.data


def prefetch(tokens: np.ndarray, src_bs: np.ndarray) -> None:
    """Ask the kernel to read the file pages of the token positions ``src_bs`` (int64[b, n]) now, all at
    once (``posix_fadvise(WILLNEED)`` per contiguous run of positions): a memmap otherwise reads a row
    a page fault at a time, each waiting for its read and a readahead the rows do not use. Advice only:
    which tokens are read does not change; in-memory arrays and systems without it are left alone."""
    where = file_range(tokens) if hasattr(os, "posix_fadvise") else None
    if where is None or src_bs.size == 0:
        return
    item = tokens.dtype.itemsize
    first, lengths = runs(src_bs)
    try:
        fd = os.open(where[0], os.O_RDONLY)
    except OSError:
        return
    try:
        for start, n in zip((where[1] + first * item).tolist(), (lengths * item).tolist()):
            os.posix_fadvise(fd, start, n, os.POSIX_FADV_WILLNEED)
    except OSError:
        pass
    finally:
        os.close(fd)


def _check_int(name: str, value: Any, minimum: int, where: str = "BatchIterator") -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{where}: {name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


class _Batches:
    """Iteration over batches for the iterators below: each defines `next()` and keeps ``_step`` and ``_seed``."""

    @property
    def step(self) -> int:
        return self._step

    @property
    def seed(self) -> int:
        return self._seed

    def next(self) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def __next__(self) -> dict[str, np.ndarray]:
        return self.next()

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self


class BatchIterator(_Batches):
    """Random windows of ``seq + 1`` tokens; batch ``k`` depends only on ``(seed, k)``.

    ``next()`` returns ``{"inputs": int32[b, seq], "targets": int32[b, seq]}`` with
    ``b = batch // process_count`` (this process's rows of the global batch) and
    ``targets[:, t] == inputs[:, t + 1]`` along the window.
    """

    sampler = "windows"

    def __init__(
        self,
        tokens: np.ndarray,
        batch: int,
        seq: int,
        seed: int,
        *,
        step: int = 0,
        process_index: int = 0,
        process_count: int = 1,
        vocab_size: int | None = None,
    ) -> None:
        tokens = tokens if isinstance(tokens, (np.ndarray, TokenShards)) else np.asarray(tokens)
        if tokens.ndim != 1:
            raise ValueError(f"BatchIterator: tokens must be 1-D, got shape {tokens.shape}")
        self.batch = _check_int("batch", batch, 1)
        self.seq = _check_int("seq", seq, 1)
        self._seed = _check_int("seed", seed, 0)
        self._step = _check_int("step", step, 0)
        self.process_count = _check_int("process_count", process_count, 1)
        self.process_index = _check_int("process_index", process_index, 0)
        if self.process_index >= self.process_count:
            raise ValueError(
                f"BatchIterator: process_index {process_index} must be < process_count {process_count}"
            )
        if self.batch % self.process_count:
            raise ValueError(
                f"BatchIterator: global batch {batch} is not divisible by process_count {process_count}; "
                f"fix: use a --batch that is a multiple of {process_count}"
            )
        if len(tokens) < self.seq + 1:
            raise ValueError(
                f"BatchIterator: {len(tokens)} tokens are fewer than seq + 1 = {self.seq + 1}; "
                f"fix: a smaller --seq or more data"
            )
        self.vocab_size = vocab_size
        # In-memory arrays are checked once; files (memmaps, shards) lazily per batch (never scan a huge file).
        self._lazy_vocab_check = vocab_size is not None and isinstance(tokens, (np.memmap, TokenShards))
        if vocab_size is not None and not self._lazy_vocab_check:
            self._check_vocab(tokens)
        self.tokens = tokens
        self.local_batch = self.batch // self.process_count
        self._offsets = np.arange(self.seq + 1, dtype=np.int64)

    def _check_vocab(self, ids: np.ndarray) -> None:
        if ids.size and int(ids.max()) >= self.vocab_size:  # type: ignore[operator]
            where = getattr(self.tokens if hasattr(self, "tokens") else ids, "filename", None)
            raise ValueError(
                f"BatchIterator: token id {int(ids.max())} >= vocab_size {self.vocab_size}"
                f"{f' in {where}' if where else ''}; "
                f"fix: a --vocab-size > {int(ids.max())} or the --data-dtype the file was written with"
            )

    def global_starts(self, step: int) -> np.ndarray:
        """Window starts of global batch ``step``: int64[batch], uniform in [0, len - seq - 1]."""
        rng = np.random.default_rng([self._seed, step])
        return rng.integers(0, len(self.tokens) - self.seq, size=self.batch, dtype=np.int64)

    def epochs(self, steps: int) -> float:
        """How many times ``steps`` global batches read the stream's worth of tokens: windows drawn with
        replacement have no epoch boundary, so this counts tokens read over tokens held."""
        return steps * self.batch * self.seq / len(self.tokens)

    def batch_at(self, step: int) -> dict[str, np.ndarray]:
        """This process's share of global batch ``step`` (does not move the iterator)."""
        lo = self.process_index * self.local_batch
        starts_b = self.global_starts(step)[lo : lo + self.local_batch]
        src_bs = starts_b[:, None] + self._offsets[None, :]
        prefetch(self.tokens, src_bs)
        windows_bs = np.asarray(self.tokens[src_bs])
        if self._lazy_vocab_check:
            self._check_vocab(windows_bs)
        windows_bs = windows_bs.astype(np.int32)
        return {"inputs": windows_bs[:, :-1], "targets": windows_bs[:, 1:]}

    def next(self) -> dict[str, np.ndarray]:
        out = self.batch_at(self._step)
        self._step += 1
        return out

    def state(self) -> dict[str, Any]:
        """JSON-serialisable position: ``{"step": int, "seed": int, "sampler": "windows"|"documents"}``."""
        return {"step": self._step, "seed": self._seed, "sampler": self.sampler}

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from a saved ``state()`` (adopts its step and seed). A state without "sampler"
        (written before documents were packed) is accepted by either sampler."""
        if not isinstance(state, dict) or "step" not in state or "seed" not in state:
            raise ValueError(f"BatchIterator.restore: need a dict with 'step' and 'seed', got {state!r}")
        if state.get("sampler", self.sampler) != self.sampler:
            raise ValueError(
                f"BatchIterator.restore: the checkpoint's batches came from the {state['sampler']} sampler but this "
                f"data gives {self.sampler} (document boundaries are {'known' if self.sampler == 'documents' else 'unknown'}"
                f" now); fix: resume with the --data the run was trained on"
            )
        self._step = _check_int("step", state["step"], 0)
        self._seed = _check_int("seed", state["seed"], 0)


DOC_STREAM: int = 0x646F6373  # "docs": keeps the document sampler's random streams apart from the windows'


def check_docs(docs: Any, n_tokens: int, where: str = "DocumentIterator") -> np.ndarray:
    """``docs`` as int64 document start offsets: 1-D, first 0, strictly ascending, last < ``n_tokens``."""
    d = np.asarray(docs)
    if d.ndim != 1 or d.size == 0 or not np.issubdtype(d.dtype, np.integer):
        raise ValueError(f"{where}: document starts must be a non-empty 1-D integer array, got shape {d.shape} "
                         f"dtype {d.dtype}; fix: pass the start offset of every document (first 0)")
    d = d.astype(np.int64)
    if d[0] != 0 or (d.size > 1 and not bool(np.all(d[1:] > d[:-1]))) or d[-1] >= n_tokens:
        raise ValueError(f"{where}: document starts must begin at 0, ascend strictly and stay below the "
                         f"{n_tokens} tokens, got {d[:4].tolist()}{'...' if d.size > 4 else ''} (last {int(d[-1])}); "
                         f"fix: rebuild the data folder (boostjax tokenize)")
    return d


class DocumentIterator(BatchIterator):
    """Documents packed into rows of ``seq + 1`` tokens; batch ``k`` depends only on ``(seed, k)``.

    Global row ``g = k * batch + i`` is row ``g % R`` of epoch ``g // R`` (``R = (len - 1) // seq`` rows
    per epoch). Epoch ``e`` draws, from ``np.random.default_rng([seed, DOC_STREAM, e])``, an order of
    the documents (concatenated, each with its separator) and an order of the ``R`` rows; row ``j``
    covers stream positions ``[j * seq, j * seq + seq]``. Only the rows' tokens are read (a memmap
    stays on disk); the per-epoch state is two permutations and a cumulative sum (O(documents + R)).
    With ``segments``, ``next()`` also returns ``segments: int32[b, seq]``, the document number of each
    input position counted from 0 in its row (positions attend only within their document under
    ``--doc-mask``).
    """

    sampler = "documents"

    def __init__(self, tokens: np.ndarray, docs: np.ndarray, batch: int, seq: int, seed: int, *,
                 segments: bool = False, **kwargs: Any) -> None:
        super().__init__(tokens, batch, seq, seed, **kwargs)
        self.docs = check_docs(docs, len(self.tokens))
        self.lens = np.diff(np.append(self.docs, len(self.tokens)))
        self.rows_per_epoch = (len(self.tokens) - 1) // self.seq
        self.segments = bool(segments)
        self._epochs: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def _epoch(self, e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(document order, cumulative lengths in that order [n + 1], row order) of epoch ``e``."""
        key = (self._seed, e)
        if key not in self._epochs:
            rng = np.random.default_rng([self._seed, DOC_STREAM, e])
            order = rng.permutation(len(self.docs))
            cum = np.zeros(len(order) + 1, np.int64)
            np.cumsum(self.lens[order], out=cum[1:])
            rows = rng.permutation(self.rows_per_epoch)
            while len(self._epochs) >= 2:  # a batch spans at most two epochs unless it is larger than one
                self._epochs.pop(next(iter(self._epochs)))
            self._epochs[key] = (order, cum, rows)
        return self._epochs[key]

    def epochs(self, steps: int) -> float:
        """The epochs ``steps`` global batches cover: rows read over rows per epoch (epoch ``e`` ends
        after global row ``(e + 1) * R - 1``)."""
        return steps * self.batch / self.rows_per_epoch

    def positions(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(token index into ``tokens``, document index) of this process's rows of batch ``step``:
        int64[b, seq + 1] each."""
        lo = self.process_index * self.local_batch
        return self.row_positions(step * self.batch + lo + np.arange(self.local_batch, dtype=np.int64))

    def row_positions(self, g_b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(token index, document index) of the global rows ``g_b`` (int64[b]): int64[b, seq + 1] each."""
        src_bs = np.empty((len(g_b), self.seq + 1), np.int64)
        doc_bs = np.empty_like(src_bs)
        for e in np.unique(g_b // self.rows_per_epoch):
            sel = g_b // self.rows_per_epoch == e
            order, cum, rows = self._epoch(int(e))
            pos = rows[g_b[sel] % self.rows_per_epoch][:, None] * self.seq + self._offsets[None, :]
            idx = np.searchsorted(cum, pos, side="right") - 1  # position -> place in this epoch's order
            src_bs[sel] = self.docs[order[idx]] + (pos - cum[idx])
            doc_bs[sel] = idx
        return src_bs, doc_bs

    def batch_at(self, step: int) -> dict[str, np.ndarray]:
        """This process's share of global batch ``step`` (does not move the iterator)."""
        return self.gather(*self.positions(step))

    def rows(self, g_b: np.ndarray) -> dict[str, np.ndarray]:
        """The global rows ``g_b`` (int64[b]) in the format of `next` (does not move the iterator)."""
        return self.gather(*self.row_positions(g_b))

    def gather(self, src_bs: np.ndarray, doc_bs: np.ndarray) -> dict[str, np.ndarray]:
        """The rows whose token and document indices `row_positions` gave."""
        prefetch(self.tokens, src_bs)
        windows_bs = np.asarray(self.tokens[src_bs])
        if self._lazy_vocab_check:
            self._check_vocab(windows_bs)
        windows_bs = windows_bs.astype(np.int32)
        out = {"inputs": windows_bs[:, :-1], "targets": windows_bs[:, 1:]}
        if self.segments:
            out["segments"] = (doc_bs[:, :-1] - doc_bs[:, :1]).astype(np.int32)
        return out


MIX_STREAM: int = 0x6D6978  # "mix": keeps the mixture's draws apart from the other random streams


class MixtureIterator(_Batches):
    """Rows drawn from several document streams by weight; batch ``k`` depends only on ``(seed, k)``
    and the rows each stream gave before it.

    Row ``i`` of global batch ``k`` comes from stream ``s`` where ``u = default_rng([seed, MIX_STREAM,
    k]).random(batch)[i]`` falls in ``s``'s share of the cumulative weights. Each stream keeps its own
    `DocumentIterator` (packed documents, its own epochs): its ``n``-th row drawn is its global row
    ``n``, so the rows of stream ``s`` in batch ``k`` are the next ones after those of batches ``0 ..
    k - 1``. `state` carries those counts, so a resume continues exactly; the draws are for the whole
    global batch, so the batch is the same for any process count (each process reads its block of
    rows). Same interface as `BatchIterator` (``next``, ``batch_at``, ``state``, ``restore``, ``epochs``).
    """

    sampler = "mixture"

    def __init__(self, streams: list[tuple[np.ndarray, np.ndarray]], weights: list[float], batch: int, seq: int,
                 seed: int, *, segments: bool = False, step: int = 0, process_index: int = 0,
                 process_count: int = 1, vocab_size: int | None = None, names: list[str] | None = None) -> None:
        w = np.asarray(weights, np.float64)
        if len(streams) == 0 or w.shape != (len(streams),) or not np.all(np.isfinite(w)) or np.any(w < 0) \
                or not w.sum() > 0:
            raise ValueError(f"MixtureIterator: need one weight >= 0 per stream with a sum > 0, got {list(weights)} "
                             f"for {len(streams)} streams; fix: e.g. --data A:0.7,B:0.3")
        self.weights = w / w.sum()
        self.names = list(names) if names is not None else [str(i + 1) for i in range(len(streams))]
        self._edges = np.cumsum(self.weights)[:-1]  # u in [edge[s - 1], edge[s]) draws stream s
        self.streams = [DocumentIterator(tokens, docs, batch, seq, seed, segments=segments, vocab_size=vocab_size)
                        for tokens, docs in streams]  # one process's view: rows by global number
        first = self.streams[0]
        self.batch, self.seq, self._seed = first.batch, first.seq, first.seed
        self._step = _check_int("step", step, 0, "MixtureIterator")
        self.process_count = _check_int("process_count", process_count, 1, "MixtureIterator")
        self.process_index = _check_int("process_index", process_index, 0, "MixtureIterator")
        if self.process_index >= self.process_count or self.batch % self.process_count:
            raise ValueError(f"MixtureIterator: need process_index < process_count and a global batch divisible by "
                             f"process_count, got {process_index}, {process_count}, {batch}; fix: use a --batch "
                             f"that is a multiple of {process_count}")
        self.local_batch = self.batch // self.process_count
        self.segments = bool(segments)
        self._rows = self._rows_before(self._step, 0, np.zeros(len(self.streams), np.int64))

    def choices(self, step: int) -> np.ndarray:
        """The stream of each row of global batch ``step``: int64[batch]."""
        u = np.random.default_rng([self._seed, MIX_STREAM, step]).random(self.batch)
        return np.searchsorted(self._edges, u, side="right").astype(np.int64)

    def _count(self, step: int) -> np.ndarray:
        return np.bincount(self.choices(step), minlength=len(self.streams)).astype(np.int64)

    def _rows_before(self, step: int, at: int, rows: np.ndarray) -> np.ndarray:
        """The rows each stream gave before batch ``step``, counted on from ``rows`` before batch ``at``."""
        if step < at:
            at, rows = 0, np.zeros_like(rows)
        rows = rows.copy()
        for k in range(at, step):
            rows += self._count(k)
        return rows

    def epochs(self, steps: int) -> float:
        """The epochs of the most-read stream that ``steps`` global batches cover (expected: rows drawn
        by weight over the stream's rows per epoch); `stream_epochs` gives each."""
        return max(self.stream_epochs(steps))

    def stream_epochs(self, steps: int) -> list[float]:
        """Each stream's expected epochs after ``steps`` global batches."""
        return [float(w) * steps * self.batch / it.rows_per_epoch for w, it in zip(self.weights, self.streams)]

    def batch_at(self, step: int) -> dict[str, np.ndarray]:
        """This process's share of global batch ``step`` (does not move the iterator)."""
        rows = self._rows if step == self._step else self._rows_before(step, self._step, self._rows)
        src_b = self.choices(step)
        lo = self.process_index * self.local_batch
        out: dict[str, np.ndarray] = {}
        for s, it in enumerate(self.streams):
            mine = src_b == s
            row_b = rows[s] + np.cumsum(mine) - 1  # the stream's global row of each row it gives
            at = np.flatnonzero(mine[lo:lo + self.local_batch])
            if at.size == 0:
                continue
            got = it.rows(row_b[lo + at])
            for key, v in got.items():
                if key not in out:
                    out[key] = np.empty((self.local_batch,) + v.shape[1:], v.dtype)
                out[key][at] = v
        return out

    def next(self) -> dict[str, np.ndarray]:
        out = self.batch_at(self._step)
        self._rows += self._count(self._step)
        self._step += 1
        return out

    def state(self) -> dict[str, Any]:
        """JSON-serialisable position: ``{"step", "seed", "sampler": "mixture", "rows": [rows per stream]}``."""
        return {"step": self._step, "seed": self._seed, "sampler": self.sampler, "rows": self._rows.tolist()}

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from a saved ``state()``; without "rows" they are counted again from batch 0."""
        if not isinstance(state, dict) or "step" not in state or "seed" not in state:
            raise ValueError(f"MixtureIterator.restore: need a dict with 'step' and 'seed', got {state!r}")
        if state.get("sampler") != self.sampler:
            raise ValueError(f"MixtureIterator.restore: the checkpoint's batches came from the "
                             f"{state.get('sampler', 'windows')} sampler, not a mixture; fix: resume with the --data "
                             f"the run was trained on")
        step = _check_int("step", state["step"], 0, "MixtureIterator")
        self._seed = _check_int("seed", state["seed"], 0, "MixtureIterator")
        rows = state.get("rows")
        if rows is None:
            rows = self._rows_before(step, 0, np.zeros(len(self.streams), np.int64))
        elif not (isinstance(rows, list) and len(rows) == len(self.streams)
                  and all(isinstance(r, int) and r >= 0 for r in rows)):
            raise ValueError(f"MixtureIterator.restore: need one row count per stream ({len(self.streams)}), got "
                             f"{rows!r}; fix: resume with the --data the run was trained on")
        self._step, self._rows = step, np.asarray(rows, np.int64)
        for it in self.streams:
            it.restore({"step": 0, "seed": self._seed, "sampler": it.sampler})


def batch_iterator(tokens: np.ndarray, docs: np.ndarray | None, batch: int, seq: int, seed: int, *,
                   segments: bool = False, **kwargs: Any) -> BatchIterator:
    """`DocumentIterator` when the document starts ``docs`` are known, else `BatchIterator` (random
    windows; ``segments`` then needs documents: ValueError)."""
    if docs is not None:
        return DocumentIterator(tokens, docs, batch, seq, seed, segments=segments, **kwargs)
    if segments:
        raise ValueError("batch_iterator: segments need document boundaries, and this data has none; "
                         "fix: pass the documents' start offsets (a data folder or a tokenised folder)")
    return BatchIterator(tokens, batch, seq, seed, **kwargs)


def eval_batches(
    tokens: np.ndarray,
    batch: int,
    seq: int,
    n: int,
    seed: int = 1234,
    *,
    process_index: int = 0,
    process_count: int = 1,
    vocab_size: int | None = None,
    docs: np.ndarray | None = None,
    segments: bool = False,
) -> list[dict[str, np.ndarray]]:
    """A fixed list of ``n`` validation batches (same format as `BatchIterator.next`; packed documents
    when their starts ``docs`` are known, see `batch_iterator`)."""
    n = _check_int("n", n, 0, where="eval_batches")
    it = batch_iterator(
        tokens, docs, batch, seq, seed, segments=segments,
        process_index=process_index, process_count=process_count, vocab_size=vocab_size,
    )
    return [it.next() for _ in range(n)]
