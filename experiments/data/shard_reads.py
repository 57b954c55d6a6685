"""Bytes each process of a multi-host run reads from a tokenised folder in shards (docs/tokenised-data.md).

    python -m experiments.data.shard_reads

Writes a synthetic tokenised folder (`loader_speed.write_folder`: uint16 ids, documents of random
lengths, the training split in shards cut as `boostjax tokenize --shard-tokens` cuts them) into a
temporary folder (removed at the end). For P in 1, 2, 4, 8 (`--processes`) and each process p < P, one subprocess opens
the folder as `boostjax train --data` does and runs process p's `batch_iterator` (packed documents) for
`--steps` global batches (default: one epoch). It reports the bytes the kernel counted it reading
(`/proc/self/io` rchar, from before the folder is opened to after the last batch: meta.json, the
documents' index and the rows) beside the reader's own count (`TokenShards.bytes_read`: the rows
alone). The table compares both with the split's bytes / P. Writes <out>/shard_reads.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import tempfile
import time

from experiments import common
from experiments.data.loader_speed import write_folder


def rchar() -> tuple[int, int]:
    """(bytes this process has read through system calls, the length of this read of /proc/self/io,
    which the kernel counts after it)."""
    text = open("/proc/self/io").read()
    return int(text.split("rchar:")[1].split()[0]), len(text)


def child(folder: str, count: int, index: int, steps: int, batch: int, seq: int) -> dict:
    """Process `index` of `count`: `steps` batches of its rows; the bytes read, by the kernel and the reader."""
    import numpy as np

    from boostjax.data.batches import batch_iterator
    from boostjax.data.source import open_source, resolve_source

    warm = batch_iterator(np.zeros(4 * seq, np.uint16), np.array([0, seq], np.int64), 2, seq, 0)
    warm.next()  # what numpy imports lazily on a first batch is read now, not counted below
    (r0, own), t0 = rchar(), time.perf_counter()
    corpus = open_source(resolve_source(folder))
    it = batch_iterator(corpus.train, corpus.train_docs, batch, seq, 0, process_index=index, process_count=count)
    for _ in range(steps):
        it.next()
    seconds = time.perf_counter() - t0
    kernel = rchar()[0] - r0 - own
    return {"processes": count, "index": index, "kernel_bytes": kernel, "reader_bytes": it.tokens.bytes_read,
            "rows": steps * it.local_batch, "seconds": round(seconds, 3)}


def markdown(res: dict) -> str:
    split = res["split_bytes"]
    lines = [
        "# Bytes read per process from a tokenised folder in shards",
        "",
        f"A synthetic training split of {res['tokens'] / 1e6:.0f}M uint16 tokens ({split / 1e6:.0f} MB, "
        f"{res['documents']:,} documents, index {res['index_bytes'] / 1e6:.2f} MB) in {res['shards']} shards of about "
        f"{res['shard_tokens'] / 1e6:.0f}M tokens. Each process runs its share of {res['steps']} global batches of "
        f"{res['batch']} x {res['seq']} tokens ({res['epochs']:.2f} epochs) in its own subprocess. Kernel: its "
        f"`/proc/self/io` rchar from before it opens the folder to after its last batch (meta.json, the index, "
        "the rows); reader: `TokenShards.bytes_read` (the rows).",
        "",
        "| P | process | rows | reader MB | kernel MB | split / P, MB | kernel / (split / P) | kernel - reader, MB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        share = split / r["processes"]
        lines.append(f"| {r['processes']} | {r['index']} | {r['rows']:,} | {r['reader_bytes'] / 1e6:.2f} | "
                     f"{r['kernel_bytes'] / 1e6:.2f} | {share / 1e6:.2f} | {r['kernel_bytes'] / share:.4f} | "
                     f"{(r['kernel_bytes'] - r['reader_bytes']) / 1e6:.3f} |")
    lines += ["", "Reader bytes are the rows' bytes exactly: rows x (seq + 1) tokens x 2 bytes (a row holds seq + 1 "
              "tokens, so one epoch reads (seq + 1) / seq of the split). Kernel - reader is what opening the folder "
              "reads besides: meta.json and the documents' indexes (train.docs.npy, val.docs.npy), the same for "
              "every process."]
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    """The command line's flags (`main` parses them)."""
    ap = common.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--out", default=str(common.RESULTS),
                    help="folder for shard_reads.json and .md (default: experiments/results)")
    ap.add_argument("--tokens", type=int, default=150_000_000,
                    help="training tokens of the synthetic folder (uint16: 2 bytes each; default 150M)")
    ap.add_argument("--shard-tokens", type=int, default=1 << 25,
                    help="tokens per shard, as boostjax tokenize --shard-tokens (default %(default)s)")
    ap.add_argument("--mean-doc", type=int, default=1000, help="mean document length in tokens (default 1000)")
    ap.add_argument("--batch", type=int, default=64, help="global batch, rows (default 64)")
    ap.add_argument("--seq", type=int, default=4096, help="tokens per row (default 4096)")
    ap.add_argument("--steps", type=int, default=0, help="global batches per process count (default 0: one epoch)")
    ap.add_argument("--processes", default="1,2,4,8",
                    help="the process counts P, comma-separated (default %(default)s)")
    ap.add_argument("--tmp", default=None, help="where the temporary folder goes (default: the system's temp dir)")
    ap.add_argument("--child", nargs=6, default=None, help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.child:
        folder, *ints = args.child
        print(json.dumps(child(folder, *map(int, ints))))
        return 0
    for name in ("tokens", "shard_tokens", "mean_doc", "batch", "seq"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    if args.steps < 0:
        ap.error(f"--steps: must be >= 0 (0: one epoch), got {args.steps}")
    try:
        counts = [int(p) for p in args.processes.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        ap.error(f"--processes: need process counts >= 1 like 1,2,4,8, got {args.processes!r}")
    if any(args.batch % p for p in counts):
        ap.error(f"--batch: {args.batch} is not a multiple of every process count in --processes {args.processes}; "
                 "fix: e.g. --batch 64")
    if args.tokens < 2 * args.seq + 2:
        ap.error(f"--tokens: {args.tokens} is fewer than two rows of --seq {args.seq}; fix: more --tokens")
    if not os.path.exists("/proc/self/io"):
        ap.error("the kernel's count of bytes read (/proc/self/io) is Linux's; fix: run this on Linux")
    t0 = time.perf_counter()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="shard_reads-", dir=args.tmp))
    try:
        folder = tmp / "tokens"
        common.log(f"writing {args.tokens / 1e6:.0f}M tokens ({args.tokens * 2 / 1e9:.2f} GB) to {folder}")
        meta = write_folder(folder, args.tokens, max(args.tokens // 100, 2 * args.seq + 2), args.mean_doc,
                            shard_tokens=args.shard_tokens)
        rows_per_epoch = (args.tokens - 1) // args.seq
        steps = args.steps or max(rows_per_epoch // args.batch, 1)
        rows = []
        for count in counts:
            for index in range(count):
                cmd = [*common.python_m("shard_reads"), "--child", str(folder), str(count), str(index), str(steps),
                       str(args.batch), str(args.seq)]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=common.with_root()).stdout
                rows.append(json.loads(out.strip().splitlines()[-1]))
                r = rows[-1]
                common.log(f"P={count} process {index}: reader {r['reader_bytes'] / 1e6:.2f} MB, kernel "
                               f"{r['kernel_bytes'] / 1e6:.2f} MB, {r['seconds']:.1f} s")
        index_bytes = (folder / "train.docs.npy").stat().st_size
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    train = meta["splits"]["train"]
    res = {"tokens": args.tokens, "split_bytes": args.tokens * 2, "shard_tokens": args.shard_tokens,
           "shards": len(train["shards"]), "documents": train["documents"], "index_bytes": index_bytes,
           "batch": args.batch, "seq": args.seq, "steps": steps, "epochs": steps * args.batch / rows_per_epoch,
           "cpus": os.cpu_count(), "rows": rows}
    common.write(args.out, "shard_reads", data=res, md=lambda: markdown(res),
                     command=common.command_line("shard_reads", argv), started=t0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
