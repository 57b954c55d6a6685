"""Distillation (`boostjax.training.distill`, `train --distill-from`) and `train --eval-at-start`: the KL term
against a numpy transcription, W = 0 against plain training, gradients to the student only, the sharded
placements against one device, the one-line refusals, the teacher kept on resume, the step-0 evaluation."""

from __future__ import annotations

import json
import pathlib
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from boostjax.cli import main
from boostjax.config import Config, ConfigError, ModelConfig, TrainConfig
from boostjax.data import fingerprint
from boostjax.data.tokenize import tokenize_corpus
from boostjax.data.tokenizers import train_tokenizer
from boostjax.interop import hf
from boostjax.models.collectives import LOCAL
from boostjax.models.llama import abstract_model, init_model
from boostjax.placement import choose, local_loss_fn
from boostjax.training import distill
from boostjax.training.step import build_step_fns
from boostjax.training.trainer import train
from helpers import one_error_line, random_params, random_tokens, rel, rel_by_path

TEACHER = ModelConfig(kind="llama", vocab_size=256, d_model=32, n_layers=1, n_heads=4, d_ff=64, init_std=0.2)
STUDENT = ModelConfig(kind="cola", vocab_size=256, d_model=32, n_layers=1, n_heads=4, d_ff=64, rank=8)
RUN = ["--batch", "4", "--seq", "16", "--eval-batches", "1", "--no-progress", "--no-tensorboard"]
TOL = 2e-5  # two programs (sharded vs one device) in fp32: reordered sums, relative to the norm (tests/test_tp.py)


def _teacher(folder: pathlib.Path, cfg: ModelConfig = TEACHER, seed: int = 0) -> pathlib.Path:
    params = random_params(abstract_model(Config(cfg))[1], np.random.default_rng(seed), cfg.init_std, norm_scale=0.2)
    return hf.to_hf((cfg, params), folder)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(teacher folder, a text file of bytes)."""
    root = tmp_path_factory.mktemp("distill")
    (root / "notes.txt").write_text("def f(x):\n    return x + 1\n" * 300)
    return _teacher(root / "teacher"), root / "notes.txt"


def _numpy_kl(s_btv, t_btv, temp):
    """KL(softmax(t/T) || softmax(s/T)) per token, averaged, in float64."""
    s, t = np.asarray(s_btv, np.float64) / temp, np.asarray(t_btv, np.float64) / temp
    log_ps = s - np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1, keepdims=True)) - s.max(-1, keepdims=True)
    log_pt = t - np.log(np.exp(t - t.max(-1, keepdims=True)).sum(-1, keepdims=True)) - t.max(-1, keepdims=True)
    return float(np.mean(np.sum(np.exp(log_pt) * (log_pt - log_ps), -1)))


@pytest.mark.parametrize("temp", [1.0, 2.5])
def test_kl_term_matches_numpy(temp):
    rng = np.random.default_rng(1)
    s, t = rng.normal(size=(2, 5, 11)) * 3, rng.normal(size=(2, 5, 11)) * 3
    targets = rng.integers(0, 11, (2, 5))
    kl, ce = distill.kl_and_ce(jnp.asarray(s, jnp.float32), jnp.asarray(targets), jnp.asarray(t, jnp.float32), temp,
                               LOCAL)
    want = _numpy_kl(s, t, temp)
    assert abs(float(kl) - want) <= 1e-5 * want
    assert float(distill.kl_and_ce(jnp.asarray(s, jnp.float32), jnp.asarray(targets), jnp.asarray(s, jnp.float32),
                                   temp, LOCAL)[0]) == pytest.approx(0.0, abs=1e-6)  # KL(p || p) = 0
    loss, parts = distill.objective(temp, 0.3)(jnp.asarray(s, jnp.float32), {"targets": jnp.asarray(targets),
                                                                           "teacher": jnp.asarray(t, jnp.float32)}, LOCAL)
    assert float(loss) == pytest.approx(0.3 * temp ** 2 * float(kl) + 0.7 * float(ce), rel=1e-6)
    assert parts["kl"] == kl and parts["ce"] == ce  # the same eager ops on the same inputs: the same program twice


def _inputs(cfg: Config, seed: int = 0):
    graphdef, params = init_model(cfg)
    rng = np.random.default_rng(seed)
    params = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape) * 0.1 + (p.ndim == 1), jnp.float32), params)
    t = cfg.train
    batch = {k: jnp.asarray(random_tokens(cfg.model.vocab_size, (t.batch, t.seq), seed + i))
             for i, k in enumerate(("inputs", "targets"))}
    tparams = random_params(abstract_model(Config(TEACHER))[1], rng, TEACHER.init_std, norm_scale=0.2)
    return graphdef, params, batch, tparams


def test_weight_zero_is_plain_training_and_only_the_student_learns():
    cfg = Config(STUDENT, TrainConfig(batch=2, seq=8))
    graphdef, params, batch, tparams = _inputs(cfg)
    forward = distill.forward(TEACHER, None)
    with_teacher = lambda tp: {**batch, "teacher": forward(tp, batch)}  # noqa: E731
    plain_loss, plain_grads = jax.jit(jax.value_and_grad(local_loss_fn(cfg, graphdef)))(params, batch)
    zero = local_loss_fn(cfg, graphdef, objective=distill.objective(2.0, 0.0))
    (loss, parts), grads = jax.jit(jax.value_and_grad(zero, has_aux=True))(params, with_teacher(tparams))
    assert abs(float(loss - plain_loss)) <= 1e-6 * abs(float(plain_loss)) and float(parts["ce"]) == float(loss)
    assert rel(grads, plain_grads) < 1e-6
    half = local_loss_fn(cfg, graphdef, objective=distill.objective(2.0, 0.5))
    # the teacher's parameters get no gradient (stop_gradient: exactly zero); the student's do
    t_grads = jax.jit(jax.grad(lambda tp: half(params, with_teacher(tp))[0]))(tparams)
    assert all(not np.any(np.asarray(g)) for g in jax.tree.leaves(t_grads))
    s_grads = jax.jit(jax.grad(lambda p: half(p, with_teacher(tparams))[0]))(params)
    assert rel(s_grads, plain_grads) > 1e-3  # the KL term moves the student


@pytest.mark.parametrize("strategy,kind,mesh,docs", [("none", "cola", "data=4", False),
                                                     ("fullrank-tp", "llama", "data=2,model=4", False),
                                                     ("btp", "cola", "data=2,model=2", True),
                                                     ("vanilla-tp", "svd", "data=1,model=2", False)])
def test_sharded_distillation_matches_one_device(strategy, kind, mesh, docs):
    """The teacher's logits (split like a dense model) and the student's loss, parts and gradients under each
    placement against one device (`docs`: with document segment ids, as --doc-mask batches carry them)."""
    cfg = Config(replace(STUDENT, kind=kind), TrainConfig(batch=8, seq=8, strategy=strategy, mesh=mesh))
    graphdef, params, batch, tparams = _inputs(cfg, seed=3)
    if docs:  # two documents per row, split at a different place in each row
        batch["segments"] = jnp.asarray((np.arange(8)[None, :] >= np.arange(1, 9)[:, None]).astype(np.int32))
    t = distill.Teacher("t", "huggingface", TEACHER, tparams, "blake3:0")
    obj = distill.objective(2.0, 0.5)
    with jax.default_matmul_precision("highest"):
        ref_t = distill.forward(TEACHER, None)(tparams, batch)
        (ref, ref_parts), ref_grads = jax.value_and_grad(local_loss_fn(cfg, graphdef, objective=obj), has_aux=True)(
            params, {**batch, "teacher": ref_t})
        pl = replace(choose(cfg, graphdef, params), objective=obj)
        like = jax.eval_shape(pl.to_state, params)
        placed = jax.device_put(params, pl.place("params", pl.param_specs(like), like))
        rows = jax.device_put(batch, pl.batch_sharding)
        logits = jax.jit(distill.forward(TEACHER, pl.mesh))(distill.place(t, pl.mesh, 0, "float32"), rows)
        (loss, parts), grads = jax.jit(jax.value_and_grad(pl.loss_fn, has_aux=True))(placed, {**rows, "teacher": logits})
    assert rel(logits, ref_t) < TOL
    assert abs(float(loss - ref)) < TOL * abs(float(ref))
    assert all(abs(float(parts[k] - ref_parts[k])) < TOL * abs(float(ref_parts[k])) for k in ("kl", "ce"))
    bad = {k: e for k, e in rel_by_path(grads, ref_grads).items() if e >= TOL}
    assert not bad, bad


def test_zero3_step_with_accumulation_matches_one_device(files):
    """A whole step (teacher forward, grad accumulation, ZeRO-3 state) on data=4 against one device."""
    teacher = distill.load(str(files[0]))
    out = {}
    for mesh in (None, "data=4"):
        cfg = Config(STUDENT, TrainConfig(batch=4, seq=8, grad_accum=2, mesh=mesh, zero=3 if mesh else 0))
        graphdef, params, batch, _ = _inputs(replace(cfg, train=replace(cfg.train, batch=8)), seed=5)
        fns = build_step_fns(cfg, graphdef, jax.eval_shape(lambda: params), teacher=teacher)
        state = fns.init(params)
        step = fns.compile(state, batch)
        _, m = step(state, fns.put_batch(batch))
        out[mesh] = {k: float(v) for k, v in m.items()}
    one, dp = out[None], out["data=4"]
    assert set(one) >= {"loss", "kl", "ce", "grad_norm"}
    assert all(abs(dp[k] - one[k]) < TOL * abs(one[k]) for k in ("loss", "kl", "ce", "grad_norm")), (one, dp)


def test_a_gguf_teacher_is_the_folder_of_the_same_weights(files, tmp_path):
    pytest.importorskip("gguf")
    from test_gguf import write_gguf

    folder = files[0]
    with_ids = replace(TEACHER, bos_token_id=1, eos_token_ids="2")  # llama.cpp files name both
    gguf_file = write_gguf(tmp_path / "teacher.gguf", with_ids, hf.read_hf(folder)[1])
    a, b = distill.load(str(folder)), distill.load(str(gguf_file))
    assert (a.format, b.format) == ("huggingface", "gguf") and b.fingerprint == fingerprint.of_file(gguf_file)
    tokens = {"inputs": jnp.asarray(random_tokens(256, (2, 16)))}
    assert rel(distill.forward(b.model, None)(b.params, tokens), distill.forward(a.model, None)(a.params, tokens)) < 1e-6


def _error(capsys, *args) -> str:
    assert main(["train", *args]) == 2
    return one_error_line(capsys.readouterr().err)


def test_bad_teachers_and_values_are_one_line(files, tmp_path, capsys):
    folder, notes = files
    base = ["--model", "cola", "--d-model", "32", "--n-layers", "1", "--n-heads", "4", "--d-ff", "64", "--rank", "8",
            "--data", str(notes), "--out", str(tmp_path / "run"), *RUN]
    assert "train.distill_weight: 1.5 outside [0, 1]" in _error(capsys, *base, "--distill-from", str(folder),
                                                                "--distill-weight", "1.5")
    assert "train.distill_temperature: 0.0 must be finite and > 0" in _error(
        capsys, *base, "--distill-from", str(folder), "--distill-temperature", "0")
    assert "does not exist" in _error(capsys, *base, "--distill-from", str(tmp_path / "nowhere"))
    other = _teacher(tmp_path / "other", replace(TEACHER, vocab_size=288))
    assert "has a vocabulary of 288 tokens, the student 256" in _error(capsys, *base, "--distill-from", str(other))
    assert "not implemented across pipeline stages" in _error(
        capsys, *base, "--distill-from", str(folder), "--mesh", "data=1,stage=2,model=1", "--n-layers", "2")
    (other / "model.safetensors").write_bytes(b"not safetensors")  # a teacher whose weights cannot be read
    assert "cannot read the teacher" in _error(capsys, *base, "--vocab-size", "288", "--distill-from", str(other))
    assert not (tmp_path / "run" / "config.json").exists()


def test_a_teacher_of_another_tokenizer_is_refused(tmp_path, capsys):
    texts = tmp_path / "text"
    texts.mkdir()
    for i in range(4):
        (texts / f"{i}.txt").write_text(f"def f{i}(x):\n    return x + {i}\n" * 20)
    mine = train_tokenizer(["def f(x):\n    return x + 1\n", "import os\n"] * 8, 288)
    theirs = train_tokenizer(["the quick brown fox\n", "jumps over the lazy dog\n"] * 8, 288)
    (tmp_path / "tok").mkdir()
    mine.save(tmp_path / "tok")
    tokenize_corpus(texts, tmp_path / "data", str(tmp_path / "tok"), progress=False)
    vocab = json.loads((tmp_path / "data" / "meta.json").read_text())["vocab_size"]
    teacher = _teacher(tmp_path / "teacher", replace(TEACHER, vocab_size=vocab))  # the data's vocabulary
    theirs.save(teacher)
    line = _error(capsys, "--model", "llama", "--d-model", "32", "--n-layers", "1", "--data", str(tmp_path / "data"),
                  "--distill-from", str(teacher), "--out", str(tmp_path / "run"), *RUN)
    assert line.startswith("boostjax: error: train.distill_from: ") and "was tokenised with" in line


def test_eval_at_start_once_and_the_teacher_kept_on_resume(files, tmp_path):
    folder, notes = files
    teacher = _teacher(tmp_path / "teacher")
    run = tmp_path / "run"
    t = TrainConfig(steps=2, batch=4, seq=16, eval_every=2, eval_batches=1, log_every=1, progress=False,
                    tensorboard=False, data=str(notes), out=str(run), distill_from=str(teacher), eval_at_start=True)
    first = train(Config(STUDENT, t))
    assert [m["step"] for m in first.metrics if "val_loss" in m] == [0, 2]
    assert {"loss", "kl", "ce"} <= set(first.metrics[1]) and "teacher" in first.summary and "val " in first.summary
    record = json.loads((run / distill.RECORD).read_text())
    assert record["format"] == "huggingface" and record["fingerprint"].startswith("blake3:")
    as_teacher = distill.load(str(run))  # a run folder is a teacher too: its newest checkpoint
    assert (as_teacher.format, as_teacher.step, as_teacher.model) == ("run", 2, STUDENT)
    tokens = {"inputs": jnp.asarray(random_tokens(256, (2, 16)))}
    assert rel(jax.jit(distill.forward(STUDENT, None))(as_teacher.params, tokens), first.model(tokens["inputs"])) < 1e-6
    again = train(Config(STUDENT, replace(t, steps=3)))
    assert [m["step"] for m in again.metrics if "val_loss" in m] == [0, 2, 3]  # step 0 not evaluated again
    _teacher(teacher, seed=1)  # other weights at the same path
    with pytest.raises(ConfigError, match=r"^train.distill_from: .* is another teacher than the run's"):
        train(Config(STUDENT, replace(t, steps=4)))
