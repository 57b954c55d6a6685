"""Documents, not windows: the packing sampler (coverage, determinism, resume, process count) and
`--doc-mask` attention (a packed row's logits and loss equal each document's alone; chunked against
the materialised reference; a TP strategy against one device; a training run that resumes)."""

from __future__ import annotations

import json
import os
import signal
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_tp import put_params

from boostjax import data
from helpers import random_params, rel
from boostjax.config import Config, ModelConfig, TrainConfig
from boostjax.training.checks import validate
from boostjax.data import DocumentIterator, batch_iterator, eval_batches, load_corpus
from boostjax.models import ops
from boostjax.runtime.signals import TrainingInterrupted
from boostjax.placement import choose, local_loss_fn
from boostjax.models.llama import abstract_model
from boostjax.training.trainer import train

EOS = 0
SMALL = ModelConfig(kind="llama", vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, rank=8,
                    attention="chunked", attention_block=8, max_seq_len=64)


def _docs_corpus(n_docs: int = 40, seed: int = 0, lo: int = 3, hi: int = 24) -> tuple[np.ndarray, np.ndarray]:
    """uint16 tokens of `n_docs` documents, each its ids in [1, 64) then EOS; and their start offsets."""
    rng = np.random.default_rng(seed)
    docs = [np.append(rng.integers(1, 64, rng.integers(lo, hi)), EOS) for _ in range(n_docs)]
    starts = np.concatenate([[0], np.cumsum([len(d) for d in docs[:-1]])]).astype(np.int64)
    return np.concatenate(docs).astype(np.uint16), starts


def _ce(logits_tv: np.ndarray, targets_t: np.ndarray) -> np.ndarray:
    """Per-position cross-entropy in float64 (numpy: no per-shape compiles in the test)."""
    x = np.asarray(logits_tv, np.float64)
    lse = np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1)) + x.max(-1)
    return lse - np.take_along_axis(x, targets_t[..., None].astype(np.int64), -1)[..., 0]


def _random_params(cfg: Config, seed: int):
    graphdef, params = abstract_model(cfg)  # shapes only: no initialiser runs (or compiles)
    # fresh values everywhere (norm scales around 1): a sharp model
    return graphdef, random_params(params, np.random.default_rng(seed), 0.3)


# ----------------------------------------------------------------------------- the sampler


def test_an_epoch_packs_every_document_once_in_rows_that_follow_the_documents():
    tokens, starts = _docs_corpus()
    seq, batch = 16, 4
    it = DocumentIterator(tokens, starts, batch, seq, seed=3, segments=True)
    rows = it.rows_per_epoch
    assert rows == (len(tokens) - 1) // seq
    doc_of = np.searchsorted(starts, np.arange(len(tokens)), side="right") - 1
    srcs = []
    for k in range(-(-rows // batch)):
        src_bs, _ = it.positions(k)
        b = it.batch_at(k)
        np.testing.assert_array_equal(b["inputs"], tokens[src_bs[:, :-1]])
        np.testing.assert_array_equal(b["targets"], tokens[src_bs[:, 1:]])
        # a segment is a run of one document's consecutive tokens; a new segment starts a new document
        # at its first token, after the previous document's EOS
        same = b["segments"][:, 1:] == b["segments"][:, :-1]
        np.testing.assert_array_equal(same, doc_of[src_bs[:, 1:-1]] == doc_of[src_bs[:, :-2]])
        assert np.all(np.where(same, src_bs[:, 1:-1] == src_bs[:, :-2] + 1, True))
        new = ~same
        assert np.all(np.isin(src_bs[:, 1:-1][new], starts)) and np.all(tokens[src_bs[:, :-2][new]] == EOS)
        assert np.all(b["segments"][:, 0] == 0) and np.all(np.diff(b["segments"], axis=1) >= 0)
        srcs.append(src_bs[:, :-1].reshape(-1))
    # one epoch's rows (the last batch runs into the next epoch): each stream position once
    epoch = np.concatenate(srcs)[: rows * seq]
    assert len(np.unique(epoch)) == rows * seq
    assert b["segments"].max() >= 1  # rows hold several documents


def test_document_batches_resume_bit_exactly_and_do_not_depend_on_the_process_count():
    tokens, starts = _docs_corpus(n_docs=12)
    seq, batch = 8, 8  # ~4 batches per epoch: the run crosses epochs
    whole = DocumentIterator(tokens, starts, batch, seq, seed=11, segments=True)
    ref = [whole.next() for _ in range(9)]
    first = DocumentIterator(tokens, starts, batch, seq, seed=11, segments=True)
    for _ in range(4):
        first.next()
    state = json.loads(json.dumps(first.state()))
    assert state == {"step": 4, "seed": 11, "sampler": "documents"}
    again = DocumentIterator(tokens, starts, batch, seq, seed=0, segments=True)
    again.restore(state)
    for k in range(4, 9):
        got = again.next()
        assert all(np.array_equal(got[key], ref[k][key]) for key in ("inputs", "targets", "segments"))
    for count in (2, 4):
        parts = [DocumentIterator(tokens, starts, batch, seq, seed=11, segments=True, process_index=i,
                                  process_count=count) for i in range(count)]
        for k in (0, 5):
            for key in ("inputs", "targets", "segments"):
                np.testing.assert_array_equal(np.concatenate([p.batch_at(k)[key] for p in parts]), ref[k][key])
    assert not np.array_equal(ref[0]["inputs"], DocumentIterator(tokens, starts, batch, seq, seed=12).next()["inputs"])
    windows = batch_iterator(tokens, None, batch, seq, seed=11)
    with pytest.raises(ValueError, match="documents sampler but this data gives windows"):
        windows.restore(state)
    windows.restore({"step": 2, "seed": 1})  # a checkpoint from before the samplers were named


def test_folder_corpus_knows_its_documents(tmp_path):
    texts = [f"file {i}\n" * (i + 1) for i in range(60)]
    for i, text in enumerate(texts):
        (tmp_path / f"{i:02d}.txt").write_text(text)
    c = load_corpus(str(tmp_path))
    sizes = [len(t) + 2 for t in texts]  # each file is followed by b"\n\n"
    is_val = [i % 50 == 49 for i in range(60)]
    np.testing.assert_array_equal(c.train_docs, data.corpus._starts([s for s, v in zip(sizes, is_val) if not v]))
    np.testing.assert_array_equal(c.val_docs, [0])
    assert c.train[c.train_docs[3]:c.train_docs[4]].tobytes() == texts[3].encode() + b"\n\n"
    few = tmp_path / "few"
    few.mkdir()
    for i in range(3):
        (few / f"{i}.txt").write_text("x" * 40 * (i + 1))
    c = load_corpus(str(few), val_fraction=0.25)  # too few files: the tail of the stream validates
    assert list(c.train_docs) == [0, 42, 124] and len(c.train) == 246 - 62 and list(c.val_docs) == [0]
    s = data.stdlib_corpus()
    assert s.train_docs[0] == 0 and s.train[s.train_docs[1] - 2:s.train_docs[1]].tobytes() == b"\n\n"
    assert len(eval_batches(s.val, 2, 16, 2, docs=s.val_docs, segments=True)[1]["segments"]) == 2


@pytest.mark.parametrize("docs", [[], [1, 5], [0, 5, 5], [0, 3, 2], [0, 1000], [[0, 1]], [0.0, 2.0]])
def test_bad_document_starts(docs):
    tokens, _ = _docs_corpus(n_docs=4)
    with pytest.raises(ValueError, match="document starts must"):
        DocumentIterator(tokens, np.asarray(docs), 2, 8, 0)


# ----------------------------------------------------------------------------- the mask


def test_a_packed_row_equals_its_documents_alone():
    """With segments, the logits at every position equal those of its document (the row's piece of
    it) run alone through the unmodified model, and the loss is their token-weighted mean. Each piece
    runs alone at positions 0.. (zero-padded at the end: causal, so the padding changes nothing)."""
    tokens, starts = _docs_corpus(seed=1)
    cfg = Config(SMALL, TrainConfig(batch=3, seq=32))  # chunked: four 8-position tiles
    graphdef, params = _random_params(cfg, seed=2)
    b = DocumentIterator(tokens, starts, 3, 32, seed=5, segments=True).next()
    pieces = [(r, b["segments"][r] == s) for r in range(3) for s in np.unique(b["segments"][r])]
    alone_in = np.zeros((len(pieces), 32), np.int32)
    for n, (r, at) in enumerate(pieces):
        alone_in[n, : at.sum()] = b["inputs"][r][at]

    @jax.jit
    def run(params, batch, alone_in):
        model = nnx.merge(graphdef, params)
        return model(batch["inputs"], segments=batch["segments"]), model(alone_in)

    with jax.default_matmul_precision("highest"):
        logits, alone = map(np.asarray, run(params, jax.tree.map(jnp.asarray, b), jnp.asarray(alone_in)))
    loss = _ce(logits, b["targets"]).mean()
    ce_sum = 0.0
    for n, (r, at) in enumerate(pieces):
        assert rel(logits[r][at], alone[n, : at.sum()]) < 1e-5
        ce_sum += _ce(alone[n, : at.sum()], b["targets"][r][at]).sum()
    assert len(pieces) > 3
    assert abs(float(loss) - ce_sum / b["inputs"].size) < 1e-5 * abs(float(loss))


def test_chunked_matches_the_reference_with_segments():
    """Op level: t = 40 in 16-position tiles (the last padded), segments that start inside a tile, on a
    tile boundary and on a tile's last position; grouped-query heads; output and q/k/v gradients."""
    ks = jax.random.split(jax.random.key(0), 4)
    q, k, v = (jax.random.normal(key, (2, 40, n, 8), jnp.float32) for key, n in zip(ks, (4, 2, 2)))
    w = jax.random.normal(ks[3], (2, 40, 4, 8), jnp.float32)
    seg = jnp.asarray(np.stack([np.searchsorted([0, 5, 16, 33], np.arange(40), side="right"),
                                np.searchsorted([0, 31, 32, 39], np.arange(40), side="right")]), jnp.int32)

    def run(impl):
        def f(q, k, v):
            o = ops.causal_attention(q, k, v, impl=impl, block=16, segments_bt=seg)
            return jnp.sum(o * w), o
        (_, o), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v)
        return (o, *grads)

    with jax.default_matmul_precision("highest"):
        errs = [rel(a, b) for a, b in zip(run("chunked"), run("xla"))]
    assert max(errs) < 1e-5, errs


def test_chunked_tensor_parallel_matches_one_device_xla_with_segments():
    """BTP over data=2 x model=2 with the chunked attention (8-position tiles) and per-block remat (the
    segment ids pass the tied checkpoint) against one device with the materialised attention: the
    loss and every gradient (fp32)."""
    tokens, starts = _docs_corpus(seed=6)
    cfg = validate(Config(replace(SMALL, kind="cola", vocab_size=256, n_layers=1),
                          TrainConfig(strategy="btp", mesh="data=2,model=2", batch=4, seq=32, remat="full",
                                      doc_mask=True)))
    graphdef, params = _random_params(cfg, seed=7)
    batch = jax.tree.map(jnp.asarray, DocumentIterator(tokens, starts, 4, 32, seed=2, segments=True).next())
    ref_cfg = replace(cfg, model=replace(cfg.model, attention="xla"), train=TrainConfig(batch=4, seq=32))
    with jax.default_matmul_precision("highest"):
        ref_loss, ref_grads = jax.jit(jax.value_and_grad(local_loss_fn(ref_cfg, abstract_model(ref_cfg)[0])))(params, batch)
        pl = choose(cfg, graphdef, params)
        loss, grads = jax.jit(jax.value_and_grad(pl.loss_fn))(put_params(pl, params),
                                                              jax.device_put(batch, pl.batch_sharding))
    errs = [rel(a, b) for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads))]
    assert abs(float(loss - ref_loss)) < 1e-5 * abs(float(ref_loss)) and max(errs) < 2e-5, (loss, ref_loss, max(errs))


def test_doc_mask_training_resumes_bit_exactly(tmp_path):
    """`train` with `doc_mask` and `grad_accum=2` on a folder of documents: stopped by SIGINT after
    step 2 and resumed, it gives the losses (and the validation loss) of 4 steps in one go."""
    folder = tmp_path / "texts"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(50):  # file 49 validates
        (folder / f"{i}.txt").write_text("".join(rng.choice(list("abcdefgh \n"), rng.integers(40, 120))))
    model = replace(SMALL, vocab_size=256, n_layers=1, attention="xla")
    t = TrainConfig(steps=4, batch=2, grad_accum=2, seq=24, data=str(folder), doc_mask=True, ckpt_every=2,
                    log_every=1, eval_every=4, eval_batches=1, progress=False)

    def stop_at_2(record):
        if record.get("step") == 2 and "loss" in record:
            os.kill(os.getpid(), signal.SIGINT)

    a = train(Config(model, replace(t, out=str(tmp_path / "a")))).metrics
    with pytest.raises(TrainingInterrupted):
        train(Config(model, replace(t, out=str(tmp_path / "b"))), on_log=stop_at_2)
    b = train(Config(model, replace(t, out=str(tmp_path / "b"))))
    assert b.resumed_from == 2
    b = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    pick = lambda ms, key: [(m["step"], m[key]) for m in ms if key in m]  # noqa: E731
    assert len(pick(a, "loss")) == 4 and pick(a, "loss") == pick(b, "loss")
    assert np.isfinite(pick(a, "val_loss")[-1][1]) and pick(a, "val_loss") == pick(b, "val_loss")
