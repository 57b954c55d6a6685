"""`boostjax tokenize --workers N` against Hugging Face `datasets.map(batched=True, num_proc=N)` on the same
JSONL files with the same tokenizer (docs/tokenised-data.md).

    python -m experiments.data.tokenize_speed

Generates JSONL files of `--sizes` MB (random words from a fixed vocabulary, documents of 50-400
words; the same bytes every time), trains one small byte-level BPE (`--vocab`, on the first 2,000
documents, `boostjax.data.tokenizers.train_tokenizer`) and runs every cell as its own process pinned to N
cores (`sched_setaffinity`): `boostjax tokenize --workers N --no-progress` (`boostjax`), the same with
`--workers 1` on N cores (`boostjax-threads`: one process, the `tokenizers` batch API's own Rust threads),
and `datasets.load_dataset("json")` then `.map(batched=True, num_proc=N)` encoding with the same
tokenizer's `encode_batch` (`datasets`; its JSON-to-Arrow load is part of its time, as reading the JSONL
is part of boostjax's). A byte-level run does the same with UTF-8 bytes as tokens. Per cell: wall
seconds, MB/s of input (and per core), tokens/s (each tool's own count: boostjax counts the separator
after each document) and the peak RSS of the whole process tree (psutil, sampled every 50 ms). Every
cell's output is deleted after it; the work folder (`--work`, default a temporary folder) at the end.
Resumable: cells already in <out>/tokenize_speed.json are skipped. Goal: boostjax >= 1.5x the
throughput of datasets.map, and peak memory flat in the corpus size. Writes <out>/tokenize_speed.json
and .md."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import shutil
import subprocess
import sys
import tempfile
import time

import psutil

from experiments import common

GOAL = 1.5  # boostjax's MB/s over datasets.map's
TOOLS = ("boostjax", "boostjax-threads", "datasets")
BOOSTJAX = [sys.executable, "-c", "import sys; from boostjax.cli import main; sys.exit(main())"]

DATASETS = r"""
import json, os, sys, time
import numpy as np
import datasets
datasets.disable_progress_bars()
data, tok_path, n, cache = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
if tok_path == "byte":
    def encode(batch):
        return {"ids": [np.frombuffer(t.encode("utf-8"), np.uint8) for t in batch["text"]]}
else:
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(tok_path)
    def encode(batch):
        return {"ids": [e.ids for e in tok.encode_batch(batch["text"], add_special_tokens=False)]}
t0 = time.perf_counter()
ds = datasets.load_dataset("json", data_files=data, split="train", cache_dir=cache)
t1 = time.perf_counter()
out = ds.map(encode, batched=True, num_proc=None if n == 1 else n, remove_columns=ds.column_names)
t2 = time.perf_counter()
import pyarrow.compute as pc
tokens = sum(int(pc.sum(pc.list_value_length(c)).as_py() or 0) for c in out.data.column("ids").chunks)
print(json.dumps({"load_s": t1 - t0, "map_s": t2 - t1, "tokens": tokens}))
"""


def generate(path: pathlib.Path, mb: float, seed: int = 0) -> None:
    """JSONL of `mb` MB: {"text": ...} records of 50-400 random words (a fixed 5,000-word vocabulary)."""
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(5000)]
    target, n = int(mb * 1e6), 0
    with open(path, "w") as f:
        while n < target:
            line = json.dumps({"text": " ".join(rng.choices(words, k=rng.randint(50, 400))) + "."}) + "\n"
            f.write(line)
            n += len(line)


def measure(cmd: list[str], cores: list[int], env: dict | None = None) -> dict:
    """Run `cmd` pinned to `cores`: wall seconds, peak RSS (MB) of its process tree, its stdout."""
    t0 = time.perf_counter()
    proc = psutil.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                        preexec_fn=lambda: os.sched_setaffinity(0, cores))
    peak = 0
    while proc.poll() is None:
        rss = 0
        try:
            for p in [proc, *proc.children(recursive=True)]:
                rss += p.memory_info().rss
        except psutil.Error:
            pass
        peak = max(peak, rss)
        time.sleep(0.05)
    wall = time.perf_counter() - t0
    out, err = proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd[:4])} failed ({proc.returncode}): {err.strip()[-2000:]}")
    return {"wall_s": wall, "peak_rss_mb": peak / 1e6, "stdout": out}


def run_cell(tool: str, data: pathlib.Path, tok: str, n: int, work: pathlib.Path) -> dict:
    cores = sorted(os.sched_getaffinity(0))[:n]
    out = work / "out"
    shutil.rmtree(out, ignore_errors=True)
    if tool == "datasets":
        env = dict(os.environ, HF_DATASETS_CACHE=str(out), HF_DATASETS_OFFLINE="1")
        r = measure([sys.executable, "-c", DATASETS, str(data), tok, str(n), str(out)], cores, env)
        extra = json.loads(r["stdout"].strip().splitlines()[-1])
        tokens = extra["tokens"]
        r.update(load_s=round(extra["load_s"], 2), map_s=round(extra["map_s"], 2))
    else:
        workers = n if tool == "boostjax" else 1
        r = measure([*BOOSTJAX, "tokenize", "--data", str(data), "--out", str(out), "--tokenizer", tok,
                     "--workers", str(workers), "--no-progress"], cores)
        meta = json.loads((out / "meta.json").read_text())
        tokens = sum(s["tokens"] for s in meta["splits"].values())
    shutil.rmtree(out, ignore_errors=True)
    mb = data.stat().st_size / 1e6
    return {"wall_s": round(r["wall_s"], 2), "mb_s": round(mb / r["wall_s"], 3),
            "mb_s_per_core": round(mb / r["wall_s"] / n, 3), "tokens": tokens,
            "tokens_s": round(tokens / r["wall_s"]), "peak_rss_mb": round(r["peak_rss_mb"], 1),
            **{k: r[k] for k in ("load_s", "map_s") if k in r}}


def key(tool: str, tokenizer: str, mb: float, n: int) -> str:
    return f"{tool}/{tokenizer}/{mb:g}MB/{n}"


def markdown(res: dict) -> str:
    cells = res["cells"]
    lines = ["# boostjax tokenize vs datasets.map", "",
             f"Same JSONL files, same tokenizer, each cell pinned to N cores; {res['cores']} cores on this machine. "
             f"Goal: boostjax >= {GOAL}x datasets.map's MB/s, and peak memory flat in corpus size.", "",
             "| tokenizer | input MB | N | tool | wall s | MB/s | MB/s per core | tokens/s | peak RSS MB | vs datasets |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for tokenizer in ("bpe", "byte"):
        for mb in res["sizes"]:
            for n in res["workers"]:
                base = cells.get(key("datasets", tokenizer, mb, n))
                for tool in TOOLS:
                    c = cells.get(key(tool, tokenizer, mb, n))
                    if c is None:
                        continue
                    ratio = f"{c['mb_s'] / base['mb_s']:.2f}x" if base and tool != "datasets" else ""
                    lines.append(f"| {tokenizer} | {mb:g} | {n} | {tool} | {c['wall_s']:.1f} | {c['mb_s']:.2f} | "
                                 f"{c['mb_s_per_core']:.2f} | {c['tokens_s'] / 1e6:.2f}M | {c['peak_rss_mb']:.0f} | "
                                 f"{ratio} |")
    lines += ["", "boostjax-threads: `--workers 1` on N cores (the tokenizers batch API's Rust threads in one "
              "process). datasets: load_dataset('json') + map(batched=True, num_proc=N); its tokens exclude "
              "separators, boostjax's count one per document."]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    """The command line's flags (`main` parses them)."""
    ap = common.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(common.RESULTS),
                    help="folder for tokenize_speed.json and .md (default: experiments/results)")
    ap.add_argument("--sizes", type=float, nargs="+", default=[3, 30, 300],
                    help="JSONL sizes in MB, the 1x, 10x and 100x input (default: 3 30 300)")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="core counts N (default: 1 2)")
    ap.add_argument("--vocab", type=int, default=4096, help="the BPE's vocabulary (default: 4096)")
    ap.add_argument("--work", default=None, help="folder for the generated inputs (default: a temporary folder)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    out = pathlib.Path(args.out)
    path = out / "tokenize_speed.json"
    res = json.loads(path.read_text()) if path.exists() else {"cells": {}}
    res.update(sizes=args.sizes, workers=args.workers, vocab=args.vocab, cores=len(os.sched_getaffinity(0)))
    work = pathlib.Path(args.work or tempfile.mkdtemp(prefix="tokenize_speed-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        from boostjax.data.tokenizers import train_tokenizer

        tok_dir = work / "tok"
        for mb in sorted(args.sizes):
            data = work / f"docs-{mb:g}MB.jsonl"
            todo = [(tool, t, n) for t in ("bpe", "byte") for n in args.workers for tool in TOOLS
                    if not (tool == "boostjax-threads" and (t == "byte" or n == 1))
                    and key(tool, t, mb, n) not in res["cells"]]
            if not todo:
                continue
            common.log(f"generating {mb:g} MB of JSONL")
            generate(data, mb)
            if not (tok_dir / "tokenizer.json").exists():
                with open(data) as f:
                    docs = [json.loads(ln)["text"] for ln, _ in zip(f, range(2000))]
                tok_dir.mkdir()
                train_tokenizer(docs, args.vocab).save(tok_dir)
            for tool, t, n in todo:
                tok = str(tok_dir / "tokenizer.json") if t == "bpe" else "byte"
                c = run_cell(tool, data, tok, n, work)
                res["cells"][key(tool, t, mb, n)] = c
                common.log(f"{key(tool, t, mb, n)}: {c['mb_s']:.2f} MB/s, {c['tokens_s'] / 1e6:.2f}M tokens/s, "
                               f"peak {c['peak_rss_mb']:.0f} MB")
                common.write(out, "tokenize_speed", data=res, md=lambda: markdown(res), echo=False)
            data.unlink()
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    res["command"] = common.command_line("tokenize_speed", argv)
    common.write(out, "tokenize_speed", data=res, md=lambda: markdown(res), started=t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
