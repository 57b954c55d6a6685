"""A pretrained start as a product: a `.gguf` file's own tokenizer (`tokenize --tokenizer FILE.gguf`, the
same ids as transformers' tokenizer of the file; kept with its chat template in a run folder started
from it), the data/model tokenizer check from every source (a Hugging Face folder, a `.gguf`, a run
folder), and `eval --init-from-hf` (the start scored without training). The model, tokenizer and GGUF
are tiny and made here."""

from __future__ import annotations

import json
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from boostjax.cli import main  # noqa: E402
from boostjax.config import Config, ModelConfig, TrainConfig  # noqa: E402
from boostjax.data.source import resolve_source  # noqa: E402
from boostjax.data.token_folder import token_split  # noqa: E402
from boostjax.data.tokenizers import TOKENIZER_FILE, load_tokenizer, same_tokenizer, train_tokenizer  # noqa: E402
from boostjax.interop import hf, pretrained  # noqa: E402
from boostjax.models.llama import abstract_model  # noqa: E402
from helpers import one_error_line, random_params  # noqa: E402

TEXTS = ["def f(x):\n    return x + 1\n", "import os\nprint('hello world')\n", "class A:\n    pass\n"]
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
SAMPLE = "def g(y):\n    return y * 2  # héllo, wörld\n\nclass B:\n    pass\n"
VOCAB = 300
CFG = ModelConfig(kind="llama", vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                  max_seq_len=128, bos_token_id=0, eos_token_ids="0")
QUIET = ["--no-progress"]
RUN = ["--batch", "2", "--seq", "16", "--eval-batches", "1", "--log-every", "1", "--no-progress", "--no-tensorboard",
       "--lr", "1e-3"]
LAYER_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


def _permute(w_oi: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (convert_hf_to_gguf): each head's rotate-half halves interleaved."""
    return w_oi.reshape(heads, 2, w_oi.shape[0] // heads // 2, *w_oi.shape[1:]).swapaxes(1, 2).reshape(w_oi.shape)


def write_gguf(path: pathlib.Path, cfg: ModelConfig, params, tok=None) -> pathlib.Path:
    """A F32 GGUF of `cfg`'s weights with `tok` (a byte-level BPE) as llama.cpp stores a GPT-2 style
    vocabulary: tokens, merges, token types (the end-of-text token a control token) and a chat template;
    without `tok`, placeholder tokens and no merges (no tokenizer transformers can build)."""
    w = gguf.GGUFWriter(str(path), "llama")
    for add, v in (("context_length", cfg.max_seq_len), ("embedding_length", cfg.d_model),
                   ("block_count", cfg.n_layers), ("feed_forward_length", cfg.d_ff), ("head_count", cfg.n_heads),
                   ("head_count_kv", cfg.kv_heads), ("rope_dimension_count", cfg.head_dim),
                   ("rope_freq_base", cfg.rope_theta), ("layer_norm_rms_eps", cfg.norm_eps)):
        getattr(w, f"add_{add}")(v)
    w.add_tokenizer_model("gpt2")
    if tok is None:
        w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    else:
        d = json.loads(tok.tok.to_str())
        tokens = [""] * tok.vocab_size
        for t, i in d["model"]["vocab"].items():
            tokens[i] = t
        for a in d["added_tokens"]:
            tokens[a["id"]] = a["content"]
        w.add_tokenizer_pre("gpt2")
        w.add_token_list(tokens)
        w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in d["model"]["merges"]])
        w.add_token_types([3 if t == "<|endoftext|>" else 1 for t in tokens])
        w.add_bos_token_id(tok.eos_id)
        w.add_eos_token_id(tok.eos_id)
        w.add_chat_template(TEMPLATE)
    tensors = hf.params_to_hf(cfg, params)
    w.add_tensor("token_embd.weight", tensors["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", tensors["model.norm.weight"])
    if "lm_head.weight" in tensors:
        w.add_tensor("output.weight", tensors["lm_head.weight"])
    for i in range(cfg.n_layers):
        for ours, theirs in LAYER_NAMES.items():
            a = tensors[f"model.layers.{i}.{ours}.weight"]
            heads = {"attn_q": cfg.n_heads, "attn_k": cfg.kv_heads}.get(theirs)
            w.add_tensor(f"blk.{i}.{theirs}.weight", _permute(a, heads) if heads else a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The tokenizer, params, a Hugging Face folder and a GGUF of them, text, and token folders
    tokenised with the GGUF and with another BPE."""
    root = tmp_path_factory.mktemp("product")
    tok = train_tokenizer(TEXTS * 8, VOCAB)
    params = random_params(abstract_model(Config(CFG))[1], np.random.default_rng(0), 0.2)
    folder = hf.to_hf((CFG, params), root / "hf")
    tok.save(folder)
    file = write_gguf(root / "m.gguf", CFG, params, tok)
    (root / "text").mkdir()
    for i in range(6):
        (root / "text" / f"{i}.py").write_text((TEXTS[i % 3] + f"x{i} = {i}\n") * 12)
    assert main(["tokenize", "--tokenizer", str(file), "--data", str(root / "text"), "--out", str(root / "same"),
                 "--val-every", "3", *QUIET]) == 0
    (root / "bpe").mkdir()
    train_tokenizer(["lorem ipsum dolor sit amet\n"] * 8, 280).save(root / "bpe")  # ids < VOCAB, other text
    assert main(["tokenize", "--tokenizer", str(root / "bpe"), "--data", str(root / "text"),
                 "--out", str(root / "other"), "--val-every", "3", *QUIET]) == 0
    return {"root": root, "tok": tok, "params": params, "hf": folder, "gguf": file}


def test_tokenize_with_a_gguf_gives_transformers_ids(world):
    """`tokenize --tokenizer FILE.gguf` writes the file's tokenizer as tokenizer.json: its ids are
    transformers' from the same file, and the BPE the file was made from (compared by content)."""
    file, same = world["gguf"], world["root"] / "same"
    theirs = transformers.AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    ours = load_tokenizer(same)
    assert ours.encode(SAMPLE).tolist() == theirs(SAMPLE, add_special_tokens=False)["input_ids"]
    assert ours.encode(SAMPLE).tolist() == world["tok"].encode(SAMPLE).tolist()
    assert same_tokenizer(ours, world["tok"]) and same_tokenizer(load_tokenizer(file), ours)
    assert not same_tokenizer(ours, load_tokenizer(world["root"] / "other"))
    meta = json.loads((same / "meta.json").read_text())
    assert meta["tokenizer"] == TOKENIZER_FILE and meta["vocab_size"] == VOCAB
    ids = np.asarray(token_split(same, meta, "train")[0])
    assert world["tok"].decode(ids[:40]) == ours.decode(ids[:40])


@pytest.mark.parametrize("source", ["hf", "gguf", "hf-without-tokenizer", "gguf-without-tokenizer"])
def test_mismatch_refused_from_each_checkpoint(world, tmp_path, capsys, source):
    """Data tokenised with another tokenizer than the checkpoint's: one line naming both, exit 2, nothing
    written; the checkpoint's own tokenizer passes the same check. A folder without tokenizer.json is
    byte level, so BPE ids are refused there too; a GGUF whose tokenizer cannot be built refuses any."""
    src = world[source.split("-")[0]]
    if source == "hf-without-tokenizer":
        src = tmp_path / "bare"
        src.mkdir()
        for f in ("config.json", "model.safetensors"):
            (src / f).write_bytes((world["hf"] / f).read_bytes())
    if source == "gguf-without-tokenizer":
        src = write_gguf(tmp_path / "placeholders.gguf", CFG, world["params"])
    out = tmp_path / "run"
    data = world["root"] / ("same" if source == "gguf-without-tokenizer" else "other")
    rc = main(["train", "--init-from-hf", str(src), "--data", str(data), "--out", str(out), "--steps", "1", *RUN])
    err = capsys.readouterr().err
    assert rc == 2 and not out.exists(), err
    if source == "gguf-without-tokenizer":
        one_error_line(err, "train.init_from_hf", "transformers cannot build a tokenizer from", str(src))
        return
    line = one_error_line(err, "train.init_from_hf", str(data), "fix: tokenise the text", f"--tokenizer {src}")
    assert ("holds no tokenizer.json" in line) == (source == "hf-without-tokenizer"), line
    cfg = Config(train=TrainConfig(init_from_hf=str(src)))
    if source != "hf-without-tokenizer":
        pretrained.check_source_tokenizer(cfg, resolve_source(str(world["root"] / "same")))  # passes


def test_run_from_gguf_keeps_its_tokenizer_and_chat_template(world, tmp_path, capsys):
    """A run started from the GGUF on data tokenised with it holds the GGUF's tokenizer and chat template;
    export-hf carries them (transformers' tokenizer of the export has the template); resuming it, or
    scoring it, with data of another tokenizer is refused in one line."""
    run, same, other = tmp_path / "run", str(world["root"] / "same"), str(world["root"] / "other")
    assert main(["train", "--init-from-hf", str(world["gguf"]), "--data", same, "--out", str(run), "--steps", "1",
                 *RUN]) == 0
    assert same_tokenizer(load_tokenizer(run), world["tok"])
    assert (run / "chat_template.jinja").read_text() == TEMPLATE
    assert json.loads((run / "tokenizer_config.json").read_text())["chat_template"] == TEMPLATE
    assert main(["export-hf", "--run", str(run), "--out", str(tmp_path / "exp")]) == 0
    exported = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "exp"))
    assert exported.chat_template == TEMPLATE
    assert exported(SAMPLE, add_special_tokens=False)["input_ids"] == world["tok"].encode(SAMPLE).tolist()
    capsys.readouterr()
    for argv, field in ((["train", "--init-from-hf", str(world["gguf"]), "--data", other, "--out", str(run),
                          "--steps", "2", *RUN], "train."),
                        (["eval", "--run", str(run), "--data", other], "eval.data")):
        assert main(argv) == 2
        one_error_line(capsys.readouterr().err, field, other, "tokenised with")


def _nll(cfg: ModelConfig, params, ids: np.ndarray, seq: int) -> float:
    """Mean next-token loss over non-overlapping windows of `seq` predictions, in numpy float64 from the
    model's logits (the windows of `boostjax.inference.evaluation`, written out)."""
    model = hf.build_model(cfg, params)
    total, n = 0.0, 0
    for lo in range(0, len(ids) - 1, seq):
        chunk = ids[lo:lo + seq + 1].astype(np.int32)
        logits = np.asarray(model(jnp.asarray(chunk[None, :-1])), np.float64)[0]
        lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
        total += float(np.sum(lse - logits[np.arange(len(chunk) - 1), chunk[1:]]))
        n += len(chunk) - 1
    return total / n


def _eval(capsys, *args) -> dict:
    assert main(["eval", *map(str, args), "--json", "--no-progress"]) == 0
    return json.loads(capsys.readouterr().out)


def test_eval_of_a_start(world, capsys):
    """`eval --init-from-hf`: the dense start's loss is the loss written out in numpy (fp32 model, 1e-5);
    the GGUF of the same weights scores the same; svd at full rank with nothing kept dense is the dense
    model again (up to fp32 rounding); a whitened CoLA start is scored too; the text output has the
    `scored:` line."""
    same = world["root"] / "same"
    meta = json.loads((same / "meta.json").read_text())
    val = np.concatenate([[meta["eos_id"]], np.asarray(token_split(same, meta, "val")[0])])
    want = _nll(CFG, world["params"], val, 16)
    dense = _eval(capsys, "--init-from-hf", world["hf"], "--data", same, "--seq", 16, "--batch", 2)
    assert dense["step"] == 0 and dense["start"]["kind"] == "llama" and dense["tokens"] == len(val) - 1
    assert abs(dense["loss"] - want) / want < 1e-5, (dense["loss"], want)
    from_gguf = _eval(capsys, "--init-from-hf", world["gguf"], "--data", same, "--seq", 16, "--batch", 2)
    assert abs(from_gguf["loss"] - dense["loss"]) / dense["loss"] < 1e-6
    full = _eval(capsys, "--init-from-hf", world["hf"], "--data", same, "--seq", 16, "--batch", 2, "--model", "svd",
                 "--rank", 16, "--rank-attn", 32, "--rank-mlp", 32, "--no-auto-dense")
    assert full["start"]["dense"] == [] and abs(full["loss"] - dense["loss"]) / dense["loss"] < 1e-4
    cola = _eval(capsys, "--init-from-hf", world["gguf"], "--data", same, "--seq", 16, "--batch", 2, "--model", "cola",
                 "--rank", 8, "--init-factor", "whitened", "--calib-tokens", 64)
    assert cola["start"]["init_factor"] == "whitened" and np.isfinite(cola["loss"]) and cola["loss"] != dense["loss"]
    half = _eval(capsys, "--init-from-hf", world["hf"], "--data", same, "--seq", 16, "--batch", 2, "--model", "svd",
                 "--rank-budget", 0.5)
    assert half["start"]["kind"] == "svd" and set(half["start"]["ranks"]) == {"attn", "kv", "mlp"}
    assert main(["eval", "--init-from-hf", str(world["hf"]), "--data", str(same), "--seq", "16", "--no-progress"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("scored: the validation split of") and "eval: the pretrained start" in out[1]


def test_eval_of_a_start_stops_on_a_signal_while_factoring(world, capsys, monkeypatch):
    """A signal during the start's phases (reading, factoring) ends `eval --init-from-hf` with the
    signal's exit status and a line saying nothing was written, not a traceback."""
    import os
    import signal
    import time

    from boostjax.runtime.interrupt import phase

    def work(_):  # the phase's work, in its worker thread: the signal reaches the main thread's handler
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1.0)

    def factoring(cfg, init=None, corpus=None):
        return phase("factoring", work, after=0)

    monkeypatch.setattr(pretrained, "initial_params", factoring)
    code = main(["eval", "--init-from-hf", str(world["hf"]), "--data", str(world["root"] / "same"), "--seq", "16",
                 "--no-progress"])
    err = capsys.readouterr().err
    assert code == 130, err
    assert "boostjax: factoring" in err and "stopped by SIGINT before scoring; nothing was written" in err


@pytest.mark.parametrize("extra,needles", [
    ([], ["eval.run:", "--init-from-hf MODEL"]),
    (["--run", "RUN", "--init-from-hf", "HF"], ["eval.init_from_hf:", "pass one of them"]),
    (["--run", "RUN", "--rank", "8"], ["eval.rank:", "drop --rank"]),
    (["--init-from-hf", "HF", "--model", "svd", "--rank", "8", "--calib-tokens", "64"], ["eval.calib_tokens:"]),
    (["--init-from-hf", "HF", "--seq", "512"], ["eval.seq:", "max_seq_len 128"]),
    (["--init-from-hf", "HF", "--data", "OTHER"], ["eval.data:", "not the checkpoint's own tokenizer"]),
    (["--init-from-hf", "NOPE"], ["eval.init_from_hf:", "does not exist"]),
    (["--init-from-hf", "HF", "--model", "svd"], ["eval.rank:", "needs its ranks"]),
    (["--init-from-hf", "HF", "--model", "svd", "--rank", "8", "--rank-budget", "0.5"], ["eval.rank_budget:"]),
])
def test_eval_start_bad_input_one_line(world, capsys, tmp_path, extra, needles):
    names = {"HF": str(world["hf"]), "RUN": str(tmp_path), "OTHER": str(world["root"] / "other"),
             "NOPE": str(tmp_path / "nope")}
    argv = ["eval", *[names.get(a, a) for a in extra]]
    if "--data" not in argv:
        argv += ["--data", str(world["root"] / "same")]
    assert main(argv) == 2
    one_error_line(capsys.readouterr().err, *needles)
