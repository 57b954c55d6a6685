"""The batch iterator alone, for a 7B-shaped global batch, from a tokenised folder on disk (docs/data.md).

    python -m experiments.data.loader_speed

Writes a synthetic tokenised folder (`boostjax.data.token_folder`'s layout: meta.json, the shards
train-00000.bin, ... / val-00000.bin of uint16 ids cut as `boostjax tokenize --shard-tokens` cuts them,
train.docs.npy / val.docs.npy) of `--tokens` training tokens in documents of random lengths into a
temporary folder (removed at the end), opens it as `boostjax train --data` does (`resolve_source`,
`open_source`: the splits as `TokenShards`, which read a batch's rows with `os.preadv`) and builds
`batch_iterator` as the trainer does (packed documents, with and without `--doc-mask` segments; random
windows for a file without documents), as process 0 of 1 and of 8. After `--warmup` batches, each of
`--batches` batches is timed alone; the result is the median, as tokens/s per host (this process's rows
x seq over the seconds). The files were just written, so their pages are in the page cache; the `cold`
rows evict them (`posix_fadvise(DONTNEED)`) before every timed batch, so each batch's rows come from the
disk. Goal: >= 1M tokens/s per host. Writes <out>/loader_speed.json and .md."""

from __future__ import annotations

import argparse
import json
import os
import resource
import pathlib
import shutil
import statistics
import tempfile
import time

import numpy as np

from experiments import common

from boostjax.data.batches import batch_iterator
from boostjax.data.source import open_source, resolve_source
from boostjax.data.tokenize import SHARD_TOKENS

GOAL = 1_000_000  # tokens/s per host
VOCAB = 32_000
CHUNK = 8_000_000  # tokens written at a time


def shard_edges(starts: np.ndarray, n: int, shard_tokens: int | None) -> list[int]:
    """Where the shards of a stream of `n` tokens whose documents start at `starts` begin and end, as
    `boostjax tokenize --shard-tokens` cuts them (at the first document end from `shard_tokens` on)."""
    edges = [0]
    while shard_tokens is not None and edges[-1] + shard_tokens < n:
        nxt = starts[np.searchsorted(starts, edges[-1] + shard_tokens)] if starts[-1] >= edges[-1] + shard_tokens else n
        if nxt >= n:
            break
        edges.append(int(nxt))
    return edges + [n]


def write_folder(folder: pathlib.Path, n_train: int, n_val: int, mean_doc: int, seed: int = 0,
                 shard_tokens: int | None = None) -> dict:
    """A tokenised folder of random uint16 ids in [1, VOCAB), documents of geometric lengths (mean
    `mean_doc`) each ending with EOS (0): version 1 (train.bin, val.bin) or, with `shard_tokens`,
    version 2 in shards. Returns its meta.json."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    splits = {}
    for name, n in (("train", n_train), ("val", n_val)):
        lens = rng.geometric(1 / mean_doc, size=n // mean_doc * 2 + 16)
        starts = np.concatenate([[0], np.cumsum(lens)])
        starts = starts[starts < n].astype(np.int64)
        edges = shard_edges(starts, n, shard_tokens)
        files = [f"{name}.bin"] if shard_tokens is None else [f"{name}-{i:05d}.bin" for i in range(len(edges) - 1)]
        outs = [open(folder / f, "wb") for f in files]
        for lo in range(0, n, CHUNK):
            ids = rng.integers(1, VOCAB, min(CHUNK, n - lo), dtype=np.uint16)
            ends = starts[(starts > lo) & (starts <= lo + len(ids))] - 1 - lo  # the token before a start
            ids[ends] = 0
            if lo + len(ids) == n:
                ids[-1] = 0  # the last document ends with EOS too
            for i, f in enumerate(outs):  # each shard's part of this chunk
                a, b = max(edges[i], lo), min(edges[i + 1], lo + len(ids))
                if a < b:
                    ids[a - lo:b - lo].tofile(f)
        for f in outs:
            f.flush()
            os.fsync(f.fileno())  # clean pages, so that the cold rows can evict them
            f.close()
        np.save(folder / f"{name}.docs.npy", starts)
        splits[name] = {"docs_file": f"{name}.docs.npy", "documents": len(starts), "tokens": n, "bytes": n * 2}
        if shard_tokens is None:
            splits[name]["file"] = files[0]
        else:
            splits[name]["shards"] = [{"file": f, "tokens": b - a} for f, a, b in zip(files, edges, edges[1:])]
    meta = {"format": "boostjax-tokens", "version": 1 if shard_tokens is None else 2, "tokenizer": "byte",
            "dtype": "uint16", "vocab_size": VOCAB, "eos_id": 0, "bos_id": None,
            "source": "synthetic (experiments/data/loader_speed.py)", "splits": splits}
    if shard_tokens is not None:  # a name for the data, not its hash: this folder is never resumed
        meta["fingerprint"] = "blake3:" + f"{seed:064x}"
    (folder / "meta.json").write_text(json.dumps(meta, indent=1))
    return meta


def evict(path: pathlib.Path) -> None:
    """Drop the file's pages from the page cache (no root needed: the pages are clean)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_bytes() -> int:
    """Bytes this process has had read from storage (Linux's /proc/self/io; 0 where there is none)."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))
    except (OSError, StopIteration, ValueError):
        return 0


def measure(corpus, *, documents: bool, segments: bool, processes: int, batch: int, seq: int, warmup: int,
            batches: int, cold: pathlib.Path | None = None, seed: int = 0) -> dict:
    """Times `batches` batches of process 0's iterator after `warmup`; the first batch separately.
    `cold`: the token folder, its training files evicted from the page cache and opened afresh before
    every timed batch (with another `seed` than the warm rows, so that no row was read before)."""
    it = batch_iterator(corpus.train, corpus.train_docs if documents else None, batch, seq, seed, segments=segments,
                        vocab_size=VOCAB, process_index=0, process_count=processes)

    def reopen() -> None:  # evict the split's pages, open its files again
        it.tokens = None
        for f in sorted(cold.glob("train*.bin")):
            evict(f)
        it.tokens = open_source(resolve_source(str(cold))).train

    if cold is not None:
        reopen()
    t = time.perf_counter()
    it.next()
    first_s = time.perf_counter() - t
    for _ in range(warmup - 1):
        it.next()
    times, faults, reads = [], [], []
    for _ in range(batches):
        if cold is not None:
            reopen()
        f0, r0 = resource.getrusage(resource.RUSAGE_SELF).ru_majflt, read_bytes()
        t = time.perf_counter()
        out = it.next()
        times.append(time.perf_counter() - t)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_majflt - f0)
        reads.append(read_bytes() - r0)
    rows = out["inputs"].shape[0]
    med = statistics.median(times)
    return {"sampler": it.sampler, "segments": segments, "processes": processes, "cache": "cold" if cold else "warm",
            "rows": rows, "tokens_per_batch": rows * seq, "first_ms": round(first_s * 1e3, 2),
            "median_ms": round(med * 1e3, 3), "min_ms": round(min(times) * 1e3, 3),
            "max_ms": round(max(times) * 1e3, 3), "tokens_per_s": round(rows * seq / med),
            "major_faults_per_batch": statistics.median(faults),
            "disk_kib_per_batch": round(statistics.median(reads) / 1024)}


def markdown(res: dict) -> str:
    lines = [
        "# Loader speed: the batch iterator alone",
        "",
        f"Global batch {res['batch']} x {res['seq']} tokens from a synthetic tokenised folder of "
        f"{res['train_tokens'] / 1e6:.0f}M uint16 training tokens ({res['documents']:,} documents, mean "
        f"{res['mean_doc']} tokens) in shards of {res['shard_tokens'] / 1e6:.0f}M tokens, read as `boostjax train --data` "
        f"reads it (`TokenShards`: the rows' byte ranges with `os.preadv`); `batch_iterator` as the "
        f"trainer builds it, process 0 of 1 or 8. Median of {res['batches']} timed batches after "
        f"{res['warmup']} warm-up batches. {res['cpus']} CPUs, load average {res['load_before'][0]:.2f} before and "
        f"{res['load_after'][0]:.2f} after (1 min); a shared machine. Goal: >= {GOAL / 1e6:.0f}M tokens/s per host.",
        "",
        "| sampler | --doc-mask segments | processes | page cache | rows per process | first batch ms "
        "| median ms | tokens/s per host | x goal | read from disk, KiB per batch |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        lines.append(f"| {r['sampler']} | {'yes' if r['segments'] else 'no'} | {r['processes']} | {r['cache']} | "
                     f"{r['rows']} | {r['first_ms']:.1f} | {r['median_ms']:.2f} | {r['tokens_per_s'] / 1e6:.1f}M | "
                     f"{r['tokens_per_s'] / GOAL:.0f}x | {r['disk_kib_per_batch']:,} |")
    lines += ["", "First batch: the iterator's construction is outside it, the epoch's permutations (documents) "
              "and its first reads are in it. Cold: the token file's pages evicted before every timed batch "
              "(`posix_fadvise(DONTNEED)`), so the rows come from the disk (a virtual disk here, which the host may "
              "cache); the reader asks for all of a batch's byte ranges at once (`posix_fadvise(WILLNEED)`) before "
              "it reads them (boostjax/data/shards.py; docs/data.md gives the times before)."]
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    """The command line's flags (`main` parses them)."""
    ap = common.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--out", default=str(common.RESULTS),
                    help="folder for loader_speed.json and .md (default: experiments/results)")
    ap.add_argument("--tokens", type=int, default=200_000_000,
                    help="training tokens of the synthetic folder (uint16: 2 bytes each; default 200M)")
    ap.add_argument("--mean-doc", type=int, default=1000, help="mean document length in tokens (default 1000)")
    ap.add_argument("--batch", type=int, default=64, help="global batch, rows (default 64)")
    ap.add_argument("--seq", type=int, default=4096, help="tokens per row (default 4096)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed batches first, the first one included "
                    "(default 3)")
    ap.add_argument("--batches", type=int, default=30, help="timed batches per row of the table (default 30)")
    ap.add_argument("--shard-tokens", type=int, default=SHARD_TOKENS,
                    help="tokens per shard of the synthetic folder, as boostjax tokenize --shard-tokens (default "
                         "%(default)s)")
    ap.add_argument("--tmp", default=None, help="where the temporary folder goes (default: the system's temp dir)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    for name in ("tokens", "mean_doc", "batch", "seq", "warmup", "batches", "shard_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    if args.tokens < 2 * args.seq + 2:
        ap.error(f"--tokens: {args.tokens} is fewer than two rows of --seq {args.seq}; fix: more --tokens")
    t0 = time.perf_counter()
    load_before = os.getloadavg()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="loader_speed-", dir=args.tmp))
    try:
        folder = tmp / "tokens"
        common.log(f"writing {args.tokens / 1e6:.0f}M tokens ({args.tokens * 2 / 1e9:.2f} GB) to {folder}")
        meta = write_folder(folder, args.tokens, max(args.tokens // 100, 2 * args.seq + 2), args.mean_doc,
                            shard_tokens=args.shard_tokens)
        src = resolve_source(str(folder))
        corpus = open_source(src)
        rows = []
        cases = [(True, False), (True, True), (False, False)]
        for documents, segments in cases:
            for processes in (1, 8):
                if args.batch % processes:
                    continue
                r = measure(corpus, documents=documents, segments=segments, processes=processes, batch=args.batch,
                            seq=args.seq, warmup=args.warmup, batches=args.batches)
                common.log(f"{r['sampler']} segments={segments} processes={processes}: {r['median_ms']:.2f} ms, "
                               f"{r['tokens_per_s'] / 1e6:.1f}M tokens/s per host")
                rows.append(r)
        corpus = open_source(src)  # fresh readers
        for documents, processes in ((True, 1), (True, 8), (False, 1)):
            if args.batch % processes:
                continue
            r = measure(corpus, documents=documents, segments=False, processes=processes, batch=args.batch,
                        seq=args.seq, warmup=args.warmup, batches=args.batches, cold=folder,
                        seed=1 + documents)
            common.log(f"{r['sampler']} processes={processes} cold: {r['median_ms']:.2f} ms, "
                           f"{r['tokens_per_s'] / 1e6:.1f}M tokens/s per host")
            rows.append(r)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res = {"batch": args.batch, "seq": args.seq, "train_tokens": args.tokens, "mean_doc": args.mean_doc,
           "shard_tokens": args.shard_tokens, "shards": len(meta["splits"]["train"]["shards"]),
           "documents": meta["splits"]["train"]["documents"], "warmup": args.warmup, "batches": args.batches,
           "cpus": os.cpu_count(), "load_before": [round(x, 2) for x in load_before],
           "load_after": [round(x, 2) for x in os.getloadavg()], "goal_tokens_per_s": GOAL,
           "slowest_warm_tokens_per_s": min(r["tokens_per_s"] for r in rows if r["cache"] == "warm"), "rows": rows}
    common.write(args.out, "loader_speed", data=res, md=lambda: markdown(res),
                     command=common.command_line("loader_speed", argv), started=t0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
