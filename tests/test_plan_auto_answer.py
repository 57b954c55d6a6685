"""`boostjax plan --auto` answers in full: the model it planned (a warning when the vocabulary is the
preset's default), a legend of the table's labels, the winner's complete train command (`--data`,
`--out`, `--steps`), compiled measurements kept under the user's cache folder and read by the next
plan, tie rows that say so; and plan's help: `--auto` in its summary, the flags needed with it, and
train's `--attention` (its old materialized/flash values kept, `--attention-memory` the new flag)."""

from __future__ import annotations

import argparse
import json
import shlex
from dataclasses import replace

import pytest

from boostjax.cli import build_parser, main
from boostjax.config import ConfigError, ModelConfig
from boostjax.planning import measure
from helpers import MICRO, model_flags, one_error_line

# one device of a GPU cluster (profile rates, no CPU calibration) and one sequence per step: a single
# compile key (remat none fits, so lowrank / full are never compiled)
AUTO = ["plan", "--auto", "--preset", "tiny", *model_flags(MICRO), "--seq", "32", "--global-batch", "1",
        "--cluster", "1x1:A100-80GB", "--top", "1"]


def _run(capsys, *argv) -> tuple[str, str]:
    assert main([*AUTO, *map(str, argv)]) == 0
    got = capsys.readouterr()
    return got.out, got.err


def _command(out: str) -> str:
    """The winner's train command line in the summary."""
    return next(line.strip() for line in out.splitlines() if line.startswith("  boostjax train"))


def test_the_answer_in_full_and_the_cache_read_by_the_next_plan(tmp_path, capsys, monkeypatch):
    from boostjax.cli.train import train_config

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(measure, "_MEMO", {})  # nothing measured in this process yet
    cache = tmp_path / "xdg" / "boostjax" / "plan-auto"

    out, err = _run(capsys, "--out", tmp_path / "a.json")
    doc = json.loads((tmp_path / "a.json").read_text())
    assert (doc["search"]["compiled"], doc["search"]["cached"], doc["search"]["cache_dir"]) == (1, 0, str(cache))
    assert len(list(cache.glob("*.json"))) == 1
    assert f"compiled measurements kept in {cache}: 0 read from it, 1 compiled now" in out
    # the model planned, and the warning: the vocabulary is the preset's, nobody gave it
    m = doc["planned_model"]
    assert (m["kind"], m["vocab_size"], m["vocab_source"], m["n_layers"]) == ("cola", 256, "preset", 2)
    assert f"vocabulary 256 (the preset's default), {m['parameters']:,} parameters" in out
    assert len(doc["warnings"]) == 1 and "--vocab-size" in doc["warnings"][0]
    assert "warning: vocabulary 256 is the tiny preset's default" in out
    assert "boostjax: warning: vocabulary 256 is the tiny preset's default" in err  # before the compiles
    # the legend explains every part of a label once
    win = doc["candidates"][0]["label"]
    assert win == "D1 TP1 mb1x1 remat none ZeRO0" and out.count("labels: ") == 1
    legend = " ".join(out[out.index("labels: "):out.index("winner: ")].split())
    for part in ("D = data-parallel", "PP N SCHEDULE = N pipeline stages", "TP N STRATEGY = tensor-parallel",
                 "mbAxB = A sequences per micro-batch", "remat = what the backward recomputes", "ZeRO0/1/3 = "):
        assert part in legend, part
    # the command is complete: the configuration, then --data, --out and --steps for the user to fill
    line = _command(out)
    assert line == doc["candidates"][0]["run_command"]
    assert line == doc["candidates"][0]["train_command"] + " --data DATA --out RUN --steps STEPS"
    assert "DATA = the corpus" in out and "RUN = the run folder" in out and "STEPS = optimizer steps" in out
    text = tmp_path / "text.txt"
    text.write_text("the planned run reads this text. " * 200)
    filled = line.replace("DATA", str(text)).replace("RUN", str(tmp_path / "run")).replace("STEPS", "7")
    cfg = train_config(build_parser().parse_args(shlex.split(filled)[1:]))
    bare = train_config(build_parser().parse_args(shlex.split(doc["candidates"][0]["train_command"])[1:]))
    assert cfg.model == bare.model
    assert cfg.train == replace(bare.train, data=str(text), out=str(tmp_path / "run"), steps=7)

    # the next plan (a new process: nothing in memory) reads the measurement and compiles nothing; --data
    # and --steps go into its command, and a text corpus is byte-level: no warning
    monkeypatch.setattr(measure, "_MEMO", {})
    out, err = _run(capsys, "--data", text, "--steps", 7, "--out", tmp_path / "b.json")
    doc = json.loads((tmp_path / "b.json").read_text())
    assert (doc["search"]["compiled"], doc["search"]["cached"]) == (0, 1)
    assert f"compiled measurements kept in {cache}: 1 read from it, 0 compiled now" in out
    assert "cached TP1 none mb1 remat none" in err
    assert doc["warnings"] == [] and "warning" not in out + err
    assert doc["planned_model"]["vocab_source"] == "byte-level: --data is a text file"
    assert _command(out).endswith(f" --data {text} --out RUN --steps 7")

    # --no-cache: nothing kept (the measurement comes from this process's memory)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "other"))
    out, _ = _run(capsys, "--no-cache", "--vocab-size", 256, "--json")
    doc = json.loads(out)
    assert doc["search"]["cache_dir"] is None and not (tmp_path / "other").exists()
    assert doc["planned_model"]["vocab_source"] == "given by --vocab-size" and doc["warnings"] == []


def test_a_tie_says_so_and_no_row_reads_plus_zero():
    from boostjax.planning.search import _why

    def row(step, peak, compute):
        return {"step_s": step, "peak_bytes_per_device": peak, "time_s": {"compute": compute, "memory": step - compute}}

    rows = [row(1.0, 1 << 30, 0.5), row(1.0, 1 << 30, 0.4), row(1.0, 3 << 29, 0.5), row(1.00001, 1 << 30, 0.50001),
            row(1.5, 1 << 30, 1.0)]
    _why(rows)
    assert [r["why_slower"] for r in rows] == [
        "fastest", "tie: same predicted time", "tie: same predicted time, 0.5 GiB more peak memory",
        "+0.001%: more GEMM time (+0.01 ms)", "+50.0%: more GEMM time (+500 ms)"]


def test_the_vocabulary_comes_from_where_train_takes_it(tmp_path):
    from boostjax.cli.plan import vocab_from_args
    from boostjax.data.tokenize import tokenize_corpus

    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(6):
        (docs / f"d{i}.txt").write_text(f"document {i}: " + "a plan for the run that reads it. " * 20)
    meta = tokenize_corpus(docs, tmp_path / "tok", "train:300", val_every=3, progress=False)
    (tmp_path / "ids.bin").write_bytes(bytes(64))

    def vocab(**kw):
        return vocab_from_args(argparse.Namespace(**{"vocab_size": None, "data": None, **kw}))

    assert vocab() == ({}, "preset")
    assert vocab(vocab_size=1000, data=str(tmp_path / "tok")) == ({}, "given by --vocab-size")
    assert meta["vocab_size"] != 256  # the BPE's own vocabulary (what it learnt, at most 300)
    assert vocab(data=str(tmp_path / "tok")) == ({"vocab_size": meta["vocab_size"]},
                                                 f"from {tmp_path / 'tok'}'s meta.json")
    assert vocab(data=str(docs)) == ({}, "byte-level: --data is a text folder")
    assert vocab(data="") == ({}, "byte-level: --data is the stdlib corpus")
    assert vocab(data=str(tmp_path / "ids.bin")) == ({}, "preset")  # a token file names no vocabulary


@pytest.mark.parametrize("argv, needles", [
    (["--cache-dir", "{tmp}", "--no-cache"], ("plan.cache_dir", "--no-cache")),
    (["--cache-dir", "{tmp}/file.txt/cache"], ("plan.cache_dir", "not a writable folder")),
    (["--attention", "xla"], ("plan.auto", "drop --attention")),
    (["--attention-memory", "flash"], ("plan.auto", "drop --attention-memory")),
    (["--steps", "0"], ("plan.steps", ">= 1")),
    (["--data", "{tmp}/missing"], ("plan.data",)),
])
def test_bad_auto_input_is_one_line_and_writes_nothing(tmp_path, capsys, monkeypatch, argv, needles):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    (tmp_path / "file.txt").write_text("a file, not a folder")
    out = tmp_path / "plan.json"
    assert main([*AUTO, "--out", str(out), *(a.format(tmp=tmp_path) for a in argv)]) == 2
    one_error_line(capsys.readouterr().err, *needles)
    assert not out.exists() and not (tmp_path / "xdg").exists()


def test_plan_without_auto_refuses_its_flags(capsys):
    for flag, value in (("--steps", "5"), ("--no-cache", None)):
        assert main(["plan", "--preset", "tiny", flag, *([value] if value else [])]) == 2
        one_error_line(capsys.readouterr().err, f"plan: {flag} plans a whole configuration", "add --auto")


def _options(command: str) -> dict:
    sub = build_parser()._subparsers._group_actions[0]
    return {s: a for a in sub.choices[command]._actions for s in a.option_strings}, sub


def test_plans_help_names_auto_and_the_flags_it_needs():
    plan, sub = _options("plan")
    summary = next(a.help for a in sub._choices_actions if a.dest == "plan")
    assert "--auto" in summary and "offload plan" in summary
    for flag in ("--cluster", "--global-batch"):
        assert "required with it" in plan[flag].help, flag
    assert "needs --cluster and --global-batch" in plan["--auto"].help
    assert "--steps needs --auto" in " ".join(sub.choices["plan"].format_help().split())


def test_plans_attention_is_trains_and_its_old_values_still_set_the_memory():
    from boostjax.cli.plan import attention_memory

    plan, _ = _options("plan")
    train, _ = _options("train")
    a, b = plan["--attention"], train["--attention"]
    assert (a.choices, a.help, a.config_default, a.type) == (b.choices, b.help, b.config_default, b.type)
    assert plan["--attention-memory"].choices == ("materialized", "flash")
    parse = build_parser().parse_args
    assert parse(["plan", "--attention", "flash"]).attention == "flash"  # the old spelling still parses
    with pytest.raises(SystemExit):
        parse(["plan", "--attention", "paged"])

    def memory(kernel=None, given=None, seq=128, dtype="float32"):
        model = ModelConfig(**({"attention": kernel} if kernel in ("auto", "xla", "cudnn", "chunked") else {}))
        args = argparse.Namespace(attention=kernel, attention_memory=given)
        return attention_memory(args, model, seq, dtype)

    # the kernel, as a CUDA GPU runs it (block 512): what train checks a plan's memory against
    assert memory("xla", seq=4096, dtype="bfloat16") == "materialized"
    assert memory("cudnn", dtype="bfloat16") == "flash"
    assert (memory("chunked", seq=512), memory("chunked", seq=1024)) == ("materialized", "flash")
    assert (memory("auto", dtype="bfloat16"), memory("auto"), memory("auto", seq=1024)) == \
        ("flash", "materialized", "flash")
    assert memory() == "materialized"  # no flag: the preset's auto, float32, seq 128
    # the memory itself: the new flag, or --attention's old values
    assert memory(given="flash") == memory("flash") == "flash"
    assert memory("materialized", "materialized") == "materialized"
    with pytest.raises(ConfigError, match="disagree"):
        memory("flash", "materialized")
    with pytest.raises(ConfigError, match="--attention xla keeps materialized"):
        memory("xla", "flash")
