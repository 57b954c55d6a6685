"""Starting from pretrained weights (`boostjax.interop.pretrained`): the dense import, the SVD factoring of
each projection for svd/cola/lax, the report, and `train --init-from-hf` on one device and under BTP."""

from __future__ import annotations

import json
import pathlib
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from boostjax.interop import hf
from boostjax.interop import pretrained
from boostjax.cli import main
from boostjax.config import Config, ConfigError, ModelConfig, TrainConfig
from boostjax.data import batch_iterator, load_corpus, resolve_source
from boostjax.models import ops
from boostjax.models.collectives import LOCAL
from boostjax.data.tokenizers import TOKENIZER_FILE, train_tokenizer
from boostjax.data.tokenize import tokenize_corpus
from boostjax.models.llama import abstract_model
from boostjax.training.trainer import train
from helpers import random_params, random_tokens, rel

DENSE = ModelConfig(kind="llama", vocab_size=288, d_model=32, n_layers=2, n_heads=4, d_ff=64, norm_eps=1e-5)
# the training runs: one layer (half the program to compile) and logits of O(1), far from uniform, so a
# misplaced shard changes the loss visibly (with std 0.2 the model is chaotic enough that its logits
# error at low rank is not monotone in r: the factoring tests use DENSE's std 0.02)
SMALL = replace(DENSE, n_layers=1, init_std=0.2)
RUN = ["--batch", "2", "--seq", "16", "--eval-batches", "1", "--no-progress", "--no-tensorboard"]


def _dense(cfg: ModelConfig, folder: pathlib.Path):
    """(dense params, Hugging Face folder with a tokenizer): random weights, norms away from 1."""
    params = random_params(abstract_model(Config(cfg))[1], np.random.default_rng(0), cfg.init_std, norm_scale=0.2)
    folder = hf.to_hf((cfg, params), folder)
    train_tokenizer(["def f(x):\n    return x + 1\n", "import os\n"] * 8, 288).save(folder)
    return params, folder


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return _dense(DENSE, tmp_path_factory.mktemp("hf") / "model")


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """One layer: what the training runs compile is half the program."""
    return _dense(SMALL, tmp_path_factory.mktemp("hf1") / "model")


def _tokens(seed: int = 0):
    return jnp.asarray(random_tokens(DENSE.vocab_size, (2, 16), seed))


def _logits(cfg: ModelConfig, params):
    return hf.build_model(cfg, params)(_tokens())


def test_online_norm_down_is_norm_then_matmul():
    rng = np.random.default_rng(1)
    x, g, a = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((2, 5, 32), (32,), (32, 3, 8)))
    ours = ops.online_norm_down(x, g, a, LOCAL, d_model=32, eps=1e-5, name="t")
    ref = jnp.einsum("btd,dgr->btgr", ops.rms_norm(x, g, 1e-5), a, precision="highest")
    assert rel(ours, ref) < 1e-6


def test_svd_full_rank_reproduces_the_dense_logits(source):
    params, _ = source
    svd = replace(DENSE, kind="svd", rank=32, auto_dense=False)  # = min(in, out) of every projection
    lr_params, report = pretrained.lowrank_from_dense(svd, params)
    assert rel(_logits(svd, lr_params), _logits(DENSE, params)) < 1e-5
    assert report["max"] < 1e-6 and len(report["matrices"]) == 7 * DENSE.n_layers
    for k in ("embed", "head", "norm"):  # copied as they are
        np.testing.assert_array_equal(lr_params[k], params[k])


def test_svd_full_rank_tied_gqa_head_dim():
    """Today's checkpoint shapes: tied embeddings (no head), grouped-query heads, head_dim != d/heads
    (q and o are [32, 64] / [64, 32]), llama3 RoPE; full rank = min(in, out) = 32 everywhere."""
    cfg = replace(DENSE, n_kv_heads=2, attn_head_dim=16, tie_embeddings=True, rope_type="llama3", rope_factor=8.0,
                  rope_original_max_len=8)
    rng = np.random.default_rng(2)
    dense = jax.tree.map(lambda a: jnp.asarray((1 if a.ndim == 1 else 0) + 0.1 * rng.normal(size=a.shape), jnp.float32),
                         abstract_model(Config(cfg))[1])
    assert "head" not in dense
    svd = replace(cfg, kind="svd", rank=32, auto_dense=False)
    lr_params, report = pretrained.lowrank_from_dense(svd, dense)
    assert len(report["matrices"]) == 7 * cfg.n_layers
    assert rel(_logits(svd, lr_params), _logits(cfg, dense)) < 1e-5 and report["max"] < 1e-6


def test_error_falls_as_the_rank_grows(source):
    params, _ = source
    ref = _logits(DENSE, params)
    logit_errs, reports = [], []
    for r in (4, 8, 16):
        cfg = replace(DENSE, kind="svd", rank=r, auto_dense=False)  # r = 16 factorises q/o at break-even
        lr_params, report = pretrained.lowrank_from_dense(cfg, params)
        logit_errs.append(rel(_logits(cfg, lr_params), ref))
        reports.append(report)
        if r == 8:  # the reported error is ||W - A B|| / ||W|| of the stored factors
            attn = lr_params["layers"][1]["attn"]
            ab = attn["a_qkv"][:, 1] @ attn["b_kv"][0]
            direct = rel(ab, params["layers"][1]["attn"]["w_k"])
            assert abs(report["matrices"]["layers.1.attn.k"] - direct) < 1e-5
    assert all(a > b for a, b in zip(logit_errs, logit_errs[1:])), logit_errs
    for small, big in zip(reports, reports[1:]):
        assert big["mean"] < small["mean"]
        assert all(big["matrices"][k] <= small["matrices"][k] + 1e-7 for k in small["matrices"])


def test_cola_and_lax_pairs_are_exact_through_silu(source):
    """silu(z) - silu(-z) = z: cola/lax at rank 2k compute the rank-k SVD model exactly; an odd rank's
    free column changes nothing; LaX's gates start at zero."""
    params, _ = source
    svd = replace(DENSE, kind="svd", rank=4)
    svd_params, svd_report = pretrained.lowrank_from_dense(svd, params)
    ref = _logits(svd, svd_params)
    for kind, r in (("cola", 8), ("lax", 8), ("cola", 9)):
        cfg = replace(DENSE, kind=kind, rank=r, only_lr_act=False)  # the checkpoint's SwiGLU (resolve_config)
        lr_params, report = pretrained.lowrank_from_dense(cfg, params)
        assert rel(_logits(cfg, lr_params), ref) < 1e-5, (kind, r)
        assert report["kind"] == kind and report["rank"] == r
        assert report["matrices"] == pytest.approx(svd_report["matrices"], abs=1e-6)
        if kind == "lax":
            assert all(float(jnp.abs(lr_params["layers"][i][b]["cross"]).max()) == 0
                       for i in range(2) for b in ("attn", "mlp"))
    line = pretrained.summary_line({"source": "x", **report})
    assert "ranks: attn 9, kv 9, mlp 9" in line and "mean" in line and "down" in line


def _batch0(t: TrainConfig):
    corpus = load_corpus(t.data, t.data_dtype)  # the rows train's first step reads (packed documents here)
    b = batch_iterator(corpus.train, corpus.train_docs, t.batch, t.seq, t.seed, vocab_size=DENSE.vocab_size).batch_at(0)
    return {k: jnp.asarray(v) for k, v in b.items()}


def test_train_from_hf_dense_then_resume(small, tmp_path, monkeypatch, capsys):
    params, folder = small
    run, data = tmp_path / "run", tmp_path / "ids.bin"  # ids of the checkpoint's tokenizer: it is copied
    np.random.default_rng(0).integers(0, SMALL.vocab_size, 4096).astype(np.uint16).tofile(data)
    args = ["--init-from-hf", str(folder), "--out", str(run), "--data", str(data), *RUN]
    assert main(["train", *args, "--steps", "1"]) == 0
    assert "initialised llama from" in capsys.readouterr().err
    cfg = Config.from_dict(json.loads((run / "config.json").read_text()))
    # shapes, kind and the SwiGLU MLP (only_lr_act False) from the checkpoint
    assert cfg.model == replace(SMALL, only_lr_act=False) and cfg.train.init_from_hf == str(folder)
    assert json.loads((run / pretrained.REPORT_FILE).read_text())["source"] == str(folder.resolve())
    assert (run / TOKENIZER_FILE).read_bytes() == (folder / TOKENIZER_FILE).read_bytes()
    batch = _batch0(cfg.train)
    want = float(hf.build_model(SMALL, params).loss(batch["inputs"], batch["targets"]))
    got = next(json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
               if "loss" in json.loads(line))
    assert abs(got - want) / want < 1e-5, (got, want)

    def no_import(*a, **k):
        raise AssertionError("a resumed run re-imported the checkpoint")

    monkeypatch.setattr(hf, "read_hf", no_import)
    folder.rename(folder.with_name("moved"))  # the shapes come from the run's config.json then
    try:
        assert main(["train", *args, "--steps", "2"]) == 0
    finally:
        folder.with_name("moved").rename(folder)
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps[0] == 1 and steps[-1] == 2


def test_tokenizer_goes_with_token_ids_only(source, tmp_path):
    """The checkpoint's tokenizer.json is the run's when the data holds token ids (a .bin file, a folder
    tokenised with it); a folder tokenised with another one is refused; text keeps the run byte level."""
    _, folder = source
    cfg = lambda data: Config(train=TrainConfig(init_from_hf=str(folder), data=data))  # noqa: E731
    (tmp_path / "ids.bin").write_bytes(b"\0\0")
    (tmp_path / "text").mkdir()
    for i in range(4):
        (tmp_path / "text" / f"{i}.txt").write_text(f"def f{i}(x):\n    return x + {i}\n" * 20)
    tokenize_corpus(tmp_path / "text", tmp_path / "same", str(folder), progress=False)
    tokenize_corpus(tmp_path / "text", tmp_path / "bytes", "byte", progress=False)
    def copied(data: str):  # what the run folder gets, after the check validate runs
        pretrained.check_source_tokenizer(cfg(data), resolve_source(data))
        return pretrained.source_tokenizer(cfg(data), resolve_source(data))

    assert copied(str(tmp_path / "ids.bin")) == folder / TOKENIZER_FILE
    assert copied(str(tmp_path / "same")) == folder / TOKENIZER_FILE
    assert copied("") is None
    assert copied(str(tmp_path / "text")) is None
    with pytest.raises(ConfigError, match=r"^train.init_from_hf: .* was tokenised with .*; fix: tokenise"):
        copied(str(tmp_path / "bytes"))


def test_python_api_takes_the_checkpoint_shapes(source):
    """`train(cfg)`: shape fields left at their defaults become the checkpoint's; a set one that
    disagrees is refused; kind, rank and the attention kernel stay the caller's."""
    _, folder = source
    cfg = pretrained.resolve_config(Config(ModelConfig(kind="cola", rank=6, attention="xla"),
                                           TrainConfig(init_from_hf=str(folder))))
    assert cfg.model == replace(DENSE, kind="cola", rank=6, attention="xla", only_lr_act=False)  # SwiGLU kept
    with pytest.raises(ConfigError, match=r"^model.only_lr_act: True contradicts the checkpoint"):
        pretrained.resolve_config(Config(ModelConfig(kind="cola"), TrainConfig(init_from_hf=str(folder))),
                                  explicit={"only_lr_act"})
    with pytest.raises(ConfigError, match=r"^model.d_ff: 96 contradicts the checkpoint .*; fix: drop --d-ff"):
        pretrained.resolve_config(Config(ModelConfig(d_ff=96), TrainConfig(init_from_hf=str(folder))))


def test_btp_from_init_matches_one_device(small, tmp_path):
    """svd rank 8 on data=1,model=2 (BTP), started with `init=` from the dense params (factored on the
    way): the first step's loss is the single-device loss of the factored model (a misplaced shard
    changes it; the TP gradients themselves are tests/test_tp.py's), and the caller's arrays survive
    the step's buffer donation."""
    params, _ = small
    cfg = Config(replace(SMALL, kind="svd", rank=8),
                 TrainConfig(strategy="btp", mesh="data=1,model=2", steps=1, batch=2, seq=16, eval_batches=1,
                             progress=False, tensorboard=False, out=str(tmp_path / "btp")))
    res = train(cfg, init=params)
    report = json.loads((tmp_path / "btp" / pretrained.REPORT_FILE).read_text())
    assert report["source"] == "python" and report["rank"] == 8 and res.extra["init"]["mean"] == report["mean"]
    lr_params, _ = pretrained.lowrank_from_dense(cfg.model, params)
    batch = _batch0(cfg.train)
    want = float(hf.build_model(cfg.model, lr_params).loss(batch["inputs"], batch["targets"]))
    got = next(m["loss"] for m in res.metrics if "loss" in m)
    assert abs(got - want) / want < 1e-5, (got, want)
    # the check can fail: half of b_q's rows in the other order (a shard placed wrongly) moves the loss
    wrong = jax.tree.map(lambda x: x, lr_params)
    b_q = wrong["layers"][0]["attn"]["b_q"]
    wrong["layers"][0]["attn"]["b_q"] = jnp.concatenate([b_q[4:], b_q[:4]])
    moved = float(hf.build_model(cfg.model, wrong).loss(batch["inputs"], batch["targets"]))
    assert abs(moved - want) / want > 1e-3, (moved, want)
    np.testing.assert_array_equal(params["embed"], hf.read_hf(small[1])[1]["embed"])  # not donated


def test_gqa_rank_above_the_kv_width_keeps_k_and_v_dense(tmp_path, capsys):
    """A GQA checkpoint (k/v [32, 16]) at --rank 12, wider than k/v's break-even (12 x 48 >= 32 x 16):
    k and v are copied dense, q/o and the MLP factored; the run says so in its summary and
    init_report.json. --rank-kv 4 factorises k/v too (a_q and a_kv at their own ranks)."""
    cfg = replace(DENSE, n_kv_heads=2, n_layers=1)
    params, folder = _dense(cfg, tmp_path / "gqa")
    m = replace(cfg, kind="svd", rank=12)
    lr, report = pretrained.lowrank_from_dense(m, params)
    assert report["dense"] == ["k", "v"] and report["ranks"] == {"attn": 12, "kv": "dense", "mlp": 12}
    np.testing.assert_array_equal(lr["layers"][0]["attn"]["w_k"], params["layers"][0]["attn"]["w_k"])
    assert sorted(k.rsplit(".", 1)[-1] for k in report["matrices"]) == ["down", "gate", "o", "q", "up"]
    mixed, _ = pretrained.lowrank_from_dense(replace(m, rank_kv=4), params)
    assert mixed["layers"][0]["attn"]["a_q"].shape == (32, 12) and mixed["layers"][0]["attn"]["a_kv"].shape == (32, 2, 4)
    run, data = tmp_path / "run", tmp_path / "ids.bin"
    np.random.default_rng(0).integers(0, cfg.vocab_size, 4096).astype(np.uint16).tofile(data)
    assert main(["train", "--init-from-hf", str(folder), "--model", "svd", "--rank", "12", "--steps", "1",
                 "--data", str(data), *RUN, "--out", str(run)]) == 0
    assert "kept dense, their factors would not be smaller: k, v" in capsys.readouterr().err
    assert json.loads((run / pretrained.REPORT_FILE).read_text())["dense"] == ["k", "v"]
