"""Bad input on every entry point: one line `boostjax: error: <field or file>: <what>; fix: <what to do>`
on stderr, exit status 2, no traceback, before anything is compiled or written, and nothing a user owns
is overwritten. The CLI runs in-process (`boostjax.cli.main`) with `jax.jit` and `Lowered.compile`
disabled, so a case that reaches a compile fails; the two cases that need a fresh process (the
simulated-device cap, a multi-host job whose peer never starts) run one."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pathlib
import socket
import subprocess
import time

import jax
import numpy as np
import pytest

import boostjax.data
import boostjax.inference.generation
import boostjax.runtime.launch
import boostjax.offload.apply
import boostjax.placement
import boostjax.training.step
import boostjax.training.trainer
from boostjax.interop import hf
from boostjax.cli import main
from boostjax.config import ModelConfig
from helpers import cli_command, cli_env, model_flags, one_error_line

SHAPE = model_flags()  # --d-model 32 --n-layers 2 --n-heads 2 --d-ff 64 --rank 8
TRAIN = ["train", *SHAPE, "--batch", "4", "--seq", "32", "--steps", "2", "--no-progress"]
PLAN = ["plan", *SHAPE, "--batch", "4", "--seq", "32", "--dtype", "float32", "--optimizer", "adamw",
        "--memory-cap", "0.1", "--time-limit", "5"]


@pytest.fixture(autouse=True)
def no_compile(monkeypatch):
    """Bad input must be refused before anything is traced for compilation or compiled."""
    def refuse(*a, **k):
        raise AssertionError("bad input reached a compile")

    monkeypatch.setattr(jax, "jit", refuse)
    monkeypatch.setattr(jax.stages.Lowered, "compile", refuse)


def _refused(capsys, argv, *needles) -> str:
    rc = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert rc == 2, (rc, err)
    assert "Traceback" not in err
    return one_error_line(err, *needles)


def _digest(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------------------ numbers and fields

@pytest.mark.parametrize("flags,field", [
    (["--lr", "inf"], "train.lr"), (["--lr", "nan"], "train.lr"), (["--lr", "-1"], "train.lr"),
    (["--rope-theta", "0"], "model.rope_theta"), (["--rope-theta", "nan"], "model.rope_theta"),
    (["--rope-theta", "inf"], "model.rope_theta"), (["--norm-eps", "nan"], "model.norm_eps"),
    (["--init-std", "inf"], "model.init_std"), (["--min-lr-ratio", "nan"], "train.min_lr_ratio"),
    (["--weight-decay", "inf"], "train.weight_decay"), (["--b1", "nan"], "train.b1"), (["--b2", "1.5"], "train.b2"),
    (["--clip", "-inf"], "train.clip"), (["--rot-beta", "nan"], "train.rot_beta"),
    (["--rot-damping", "-1"], "train.rot_damping"),
    (["--init-timeout", "0"], "train.init_timeout"), (["--seed", "-3"], "train.seed"),
    (["--batch", "0"], "train.batch"), (["--batch", "1048576", "--seq", "4096"], "train.batch"),
    (["--max-seq-len", "1073741824"], "model.max_seq_len"), (["--vocab-size", "0"], "model.vocab_size"),
    (["--lr", "abc"], "train.lr"), (["--model", "mamba"], "model.kind"), (["--mesh", "data=2,data=2"], "train.mesh"),
    (["--mesh", "gpu=2"], "train.mesh"), (["--mesh", "data=0"], "train.mesh"), (["--out", ""], "train.out"),
    (["--seed", str(1 << 64)], "train.seed"),
    (["--pipeline-schedule", "2f2b", "--mesh", "stage=2"], "train.pipeline_schedule"),
    (["--pipeline-schedule", "1f1b"], "train.pipeline_schedule"), (["--pipeline-schedule", "1f1b", "--mesh", "data=2"],
                                                                   "train.pipeline_schedule"),
    (["--attention", "bogus"], "model.attention"), (["--attention-block", "0"], "model.attention_block"),
    (["--grad-accum", "0"], "train.grad_accum"), (["--grad-accum", "-2"], "train.grad_accum"),
    (["--grad-accum", "1048576", "--seq", "4096"], "train.grad_accum"),
    (["--zero", "2"], "train.zero"), (["--zero", "-1"], "train.zero"),
    (["--strategy", "zero3"], "train.strategy"), (["--optimizer", "sgd"], "train.optimizer"),  # Literal choices
    (["--remat", "some"], "train.remat"), (["--rot-source", "third"], "train.rot_source"),
    (["--rot-order", "current", "--rot-source", "first"], "train.rot_order"),
    (["--data-dtype", "int8"], "train.data_dtype"), (["--dtype", "float8"], "train.dtype"),
    (["--profile", "abc"], "train.profile"), (["--profile", "1:1"], "train.profile"),
    (["--profile", "0:3"], "train.profile"), (["--profile", "-1:2"], "train.profile"),
    (["--profile", "1:2:3"], "train.profile"), (["--profile", "1.5:2"], "train.profile"),
    (["--hardware", "tpu9"], "train.hardware"),
    (["--doc-mask", "--attention", "cudnn", "--dtype", "bfloat16"], "train.doc_mask"),
    (["--doc-mask", "--mesh", "stage=2"], "train.doc_mask"),
])
def test_train_numbers_and_fields(capsys, tmp_path, flags, field):
    _refused(capsys, [*TRAIN, "--out", tmp_path / "run", *flags], field)


def test_doc_mask_needs_documents(capsys, tmp_path):
    """A single file (a .bin token stream or a text file) has no document boundaries to mask at."""
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "tokens.bin")
    (tmp_path / "notes.txt").write_text("some text " * 20)
    for name in ("tokens.bin", "notes.txt"):
        _refused(capsys, [*TRAIN, "--out", tmp_path / "run", "--doc-mask", "--data", tmp_path / name],
                 "train.doc_mask", name)
        assert not (tmp_path / "run").exists()
    assert not (tmp_path / "run").exists()


def test_cudnn_attention_off_a_cuda_gpu(capsys, tmp_path):
    """cuDNN flash attention: refused in fp32 (by validate) and on this CPU backend (before the step is built)."""
    _refused(capsys, [*TRAIN, "--out", tmp_path / "run", "--attention", "cudnn"], "model.attention", "float32",
             "--dtype bfloat16")
    _refused(capsys, [*TRAIN, "--out", tmp_path / "run", "--attention", "cudnn", "--dtype", "bfloat16"],
             "model.attention", "CUDA GPU", "'cpu'", "--attention chunked")
    assert not (tmp_path / "run").exists()


def test_a_bad_allocator_setting(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("BOOSTJAX_KEEP_SCRATCH", "yes")
    _refused(capsys, [*TRAIN, "--out", tmp_path / "run"], "BOOSTJAX_KEEP_SCRATCH='yes'", "export BOOSTJAX_KEEP_SCRATCH=1")
    assert not (tmp_path / "run").exists()


def test_unknown_command_and_flag(capsys):
    _refused(capsys, ["bogus"], "command", "invalid choice")
    _refused(capsys, ["plan", "--batch", "x"], "plan.batch", "invalid int")


# ------------------------------------------------------------------------------ device meshes

def test_mesh_over_the_simulated_device_cap(capsys, tmp_path, monkeypatch):
    _refused(capsys, [*TRAIN, "--out", tmp_path / "run", "--mesh", "data=100000", "--batch", "100000"], "train.mesh",
             "100000", "64")
    _refused(capsys, ["comm", "--preset", "tiny", "--mesh", "data=1,model=128"], "comm.mesh", "128")
    monkeypatch.setenv("BOOSTJAX_MAX_CPU_DEVICES", "many")
    _refused(capsys, [*TRAIN, "--out", tmp_path / "run", "--mesh", "data=2"], "BOOSTJAX_MAX_CPU_DEVICES")
    assert not (tmp_path / "run").exists()


def test_huge_mesh_in_a_fresh_process_is_refused_before_jax(tmp_path):
    """The CLI would otherwise ask XLA for 100000 CPU devices (tens of GB) before any message."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cli_command("train", "--mesh", "data=100000", "--batch", "100000", "--out", tmp_path / "run"),
                            env=cli_env(XLA_FLAGS=None), stderr=subprocess.PIPE, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    err = proc.stderr.read().decode()
    assert os.waitstatus_to_exitcode(status) == 2, err
    assert err.count("\n") == 1 and err.startswith("boostjax: error: train.mesh: 100000 devices"), err
    # KiB. The child alone needs ~0.2 GB, but its high-water mark may include the pages of the forked
    # pytest worker (1-2 GB late in a run) before exec; the failure this guards against is tens of GB.
    assert time.monotonic() - t0 < 60 and usage.ru_maxrss < 4_000_000
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------ boostjax plan

@pytest.mark.parametrize("flags,field", [
    (["--memory-cap", "inf"], "plan.memory_cap"), (["--memory-cap", "nan"], "plan.memory_cap"),
    (["--memory-cap", "1e300"], "plan.memory_cap"), (["--memory-cap", "-1"], "plan.memory_cap"),
    (["--time-limit", "inf"], "plan.time_limit"), (["--time-limit", "nan"], "plan.time_limit"),
    (["--time-limit", "0"], "plan.time_limit"), (["--hardware", "tpu9"], "plan.hardware"),
    (["--batch", "0"], "plan.batch"), (["--seq", "-1"], "plan.seq"), (["--seq", "100000000"], "plan.seq"),
    (["--batch", "1000000000000"], "plan.batch"), (["--n-layers", "5000"], "plan.n_layers"),
    (["--d-model", "-1"], "model.d_model"), (["--preset", "huge"], "preset"),
    # --strategy / --mesh: one device's share of a mesh, refused as the trainer refuses the run
    (["--strategy", "tp9", "--mesh", "model=2"], "plan.strategy"), (["--mesh", "data=2,pipe=2"], "plan.mesh"),
    (["--strategy", "btp"], "plan.mesh"), (["--mesh", "data=1,model=2"], "plan.mesh"),
    (["--strategy", "fullrank-tp", "--mesh", "model=2"], "plan.strategy"),
    (["--strategy", "btp", "--mesh", "model=3"], "model.d_model"),
    (["--strategy", "vanilla-tp", "--mesh", "model=16"], "model.rank"),
    (["--mesh", "data=3"], "plan.batch"), (["--mesh", "data=1,stage=3"], "model.n_layers"),
    (["--mesh", "stage=2", "--batch", "1", "--seq", "3"], "plan.seq"),
    (["--instance", "lazytrain-27b", "--mesh", "data=2"], "plan.instance"),
])
def test_plan_flags(capsys, tmp_path, flags, field):
    _refused(capsys, [*PLAN, "--out", tmp_path / "plan.json", *flags], field)
    assert not (tmp_path / "plan.json").exists()


def test_plan_out_is_checked_before_the_solve(capsys, tmp_path, monkeypatch):
    import boostjax.cli.plan as plan_cli

    monkeypatch.setattr(plan_cli, "solve", lambda *a, **k: pytest.fail("solved before --out was checked"))
    _refused(capsys, [*PLAN, "--out", tmp_path / "missing" / "plan.json"], "plan.out", "does not exist")
    _refused(capsys, [*PLAN, "--out", tmp_path], "plan.out", "is a folder")
    (tmp_path / "notes.txt").write_text("mine\n")
    _refused(capsys, [*PLAN, "--out", tmp_path / "notes.txt" / "plan.json"], "plan.out", "not a folder")
    for content in (b"my thesis\n", b'{"decisions": 1}', b"\xff\xfe garbage"):
        (tmp_path / "mine.json").write_bytes(content)
        _refused(capsys, [*PLAN, "--out", tmp_path / "mine.json"], "plan.out", "is not a boostjax plan")
        assert (tmp_path / "mine.json").read_bytes() == content  # untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.json", "notes.txt"]


def test_plan_out_replaces_only_a_plan(capsys, tmp_path, monkeypatch):
    out = tmp_path / "plan.json"
    assert main([*PLAN, "--out", str(out)]) == 0
    capsys.readouterr()
    first = json.loads(out.read_text())
    assert first["format"] == "boostjax-plan" and first["planned_for"]["train.batch"] == 4
    assert main([*PLAN, "--out", str(out), "--memory-cap", "0.2"]) == 0  # our own plan: replaced
    capsys.readouterr()
    assert json.loads(out.read_text())["budget_bytes"] == 0.2e9
    before = _digest(out)

    def full(self, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pathlib.Path, "write_text", full)
    _refused(capsys, [*PLAN, "--out", out], "plan.out", "No space left")
    assert _digest(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


# ------------------------------------------------------------------------------ train --offload-plan

@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan") / "plan.json"
    assert main([*PLAN, "--out", str(out)]) == 0
    return out


@pytest.mark.parametrize("flags,needles", [
    (["--d-model", "64"], ["model.d_model=32", "model.d_model=64"]),
    (["--n-kv-heads", "1"], ["model.n_kv_heads=2", "model.n_kv_heads=1"]),
    (["--vocab-size", "512"], ["model.vocab_size=256", "model.vocab_size=512"]),
    (["--batch", "8"], ["train.batch=4", "train.batch=8"]),
    (["--seq", "64"], ["train.seq=32", "train.seq=64"]),
    (["--dtype", "bfloat16"], ["train.dtype='float32'", "train.dtype='bfloat16'"]),
    (["--optimizer", "adam8bit"], ["train.optimizer='adamw'", "train.optimizer='adam8bit'"]),
    (["--optimizer", "rotation"], ["train.optimizer='adamw'", "train.optimizer='rotation'"]),  # once priced as adamw
    (["--n-layers", "4"], ["the plan has 2 layers", "n_layers=4"]),
    (["--strategy", "btp", "--mesh", "data=1,model=2"], ["train.strategy='none'", "train.strategy='btp'"]),
    (["--mesh", "data=2"], ["train.mesh=''", "train.mesh='data=2,model=1'"]),
])
def test_offload_plan_for_another_run(capsys, tmp_path, plan_file, flags, needles):
    line = _refused(capsys, [*TRAIN, "--out", tmp_path / "run", "--offload-plan", plan_file, *flags],
                    "train.offload_plan", str(plan_file), *needles)
    assert "re-run boostjax plan" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flags,field", [(["--grad-accum", "2"], "train.grad_accum"), (["--zero", "1"], "train.zero")])
def test_offload_plan_without_accumulation_or_zero(capsys, tmp_path, plan_file, flags, field):
    _refused(capsys, [*TRAIN, "--out", tmp_path / "run", "--offload-plan", plan_file, *flags], field, "--offload-plan")
    assert not (tmp_path / "run").exists()


def test_offload_plan_files_that_are_not_plans(capsys, tmp_path, plan_file):
    run = ["--out", tmp_path / "run"]
    assert main([*TRAIN, "--out", str(tmp_path / "run"), "--offload-plan", str(plan_file), "--steps", "0"]) == 2  # the plan itself is fine
    assert "train.steps" in capsys.readouterr().err
    cases = {"garbage.json": os.urandom(4096), "text.json": b"not json at all", "list.json": b"[1, 2, 3]",
             "other.json": json.dumps({"x": 1}).encode(), "empty.json": b""}
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
        line = _refused(capsys, [*TRAIN, *run, "--offload-plan", tmp_path / name], "train.offload_plan",
                        tmp_path / name, "is not a plan file")
        assert len(line) < 400, line  # one short line, not the file's bytes
    old = json.loads(plan_file.read_text())
    for key in ("format", "version", "planned_for"):
        old.pop(key)
    (tmp_path / "old.json").write_text(json.dumps(old))  # a plan file of the first format: no record
    _refused(capsys, [*TRAIN, *run, "--offload-plan", tmp_path / "old.json"], "does not record", "re-run boostjax plan")
    bad = json.loads(plan_file.read_text())
    bad["decisions"]["boundary"][0] = "moon"
    (tmp_path / "edited.json").write_text(json.dumps(bad))
    _refused(capsys, [*TRAIN, *run, "--offload-plan", tmp_path / "edited.json"], "decisions.boundary[0]")
    _refused(capsys, [*TRAIN, *run, "--offload-plan", tmp_path], "is a directory")
    os.mkfifo(tmp_path / "fifo.json")  # never opened: reading a FIFO would block
    _refused(capsys, [*TRAIN, *run, "--offload-plan", tmp_path / "fifo.json"], "is not a regular file")
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------ boostjax comm

@pytest.mark.parametrize("flags,field", [
    (["--batch", "0"], "comm.batch"), (["--seq", "0"], "comm.seq"), (["--seq", "99999999"], "comm.seq"),
    (["--mesh", "data=2,data=2"], "comm.mesh"), (["--mesh", "data"], "comm.mesh"), (["--mesh", "data=x"], "comm.mesh"),
    (["--mesh", "gpu=4"], "comm.mesh"), (["--mesh", ""], "comm.mesh"), (["--mesh", "data=2,stage=3"], "model.n_layers"),
    (["--optimizer", "sgd"], "optimizer"), (["--microbatches", "3", "--mesh", "data=1,stage=2,model=2"], "comm.microbatches"),
    (["--pipeline-schedule", "zb"], "pipeline_schedule"), (["--zero", "2"], "comm.zero"), (["--grad-accum", "0"], "comm.grad_accum"), (["--attention", "flash"], "attention"),
    (["--mesh", "data=1,model=3"], "comm.mesh"), (["--batch", "3", "--mesh", "data=2,model=2"], "comm.batch"),
    (["--preset", "nope"], "preset"), (["--strategy", "zero"], "comm.strategy"),
])
def test_comm_flags(capsys, flags, field):
    # comm's former defaults (mesh data=1,model=4, batch 4, bf16), given: it now takes train's
    _refused(capsys, ["comm", "--preset", "tiny", "--seq", "16", "--mesh", "data=1,model=4", "--batch", "4",
                      "--dtype", "bfloat16", *flags], field)


def test_comm_dump_hlo_is_checked_before_compiling(capsys, tmp_path):
    f = tmp_path / "file.txt"
    f.write_text("mine\n")
    tp4 = ["--mesh", "data=1,model=4"]  # comm's former default mesh, given: it now takes train's ('')
    _refused(capsys, ["comm", "--preset", "tiny", *tp4, "--dump-hlo", f], "comm.dump_hlo", "is a file")
    _refused(capsys, ["comm", "--preset", "tiny", *tp4, "--dump-hlo", f / "sub"], "comm.dump_hlo",
             f"under the file {f}")
    d = tmp_path / "dumps"
    d.mkdir()
    (d / "btp.fwd.hlo.txt").write_text("my notes\n")
    _refused(capsys, ["comm", "--preset", "tiny", "--strategy", "btp", "--mesh", "data=1,model=2", "--dump-hlo", d],
             "comm.dump_hlo", "is not an HLO dump")
    assert f.read_text() == "mine\n" and (d / "btp.fwd.hlo.txt").read_text() == "my notes\n"
    assert sorted(p.name for p in d.iterdir()) == ["btp.fwd.hlo.txt"]


# ------------------------------------------------------------------------------ launch

@pytest.mark.parametrize("argv,field", [
    (["launch", "-n", "0", "--", "train"], "launch.num_processes"),
    (["launch", "-n", "1", "--", "train"], "launch.num_processes"),
    (["launch", "-n", "100000", "--", "train"], "launch.num_processes"),
    (["launch", "--port", "99999", "--", "train"], "launch.port"),
    (["launch", "--port", "0", "--", "train"], "launch.port"),
    (["launch"], "launch"),
    (["launch", "--", "plan"], "launch"),
    (["launch", "--", "train", "--coordinator", "h:1"], "launch"),
    (["launch", "--", "train", "--process-id=1"], "launch"),
    (["launch", "-n", "3", "--", "train", "--mesh", "data=2"], "train.mesh"),
    (["launch", "--", "train", "--mesh", "data=200", "--batch", "200"], "train.mesh"),
    (["launch", "--", "train", "--mesh", "data=2", "--lr", "nan"], "train.lr"),
    (["launch", "--", "train", "--mesh", "data=2", "--lr", "x"], "train.lr"),
    (["launch", "--nodes", "2", "--", "train", "--mesh", "data=2"], "launch.nodes"),
    (["launch", "--scheduler", "slurm", "--nodes", "3", "--", "train", "--mesh", "data=2"], "launch.nodes"),
    (["launch", "--scheduler", "k8s", "--nodes", "1", "--", "train", "--mesh", "data=2"], "launch.nodes"),
])
def test_launch_starts_nothing_on_bad_input(capsys, monkeypatch, argv, field):
    monkeypatch.setattr(boostjax.runtime.launch.subprocess, "Popen", lambda *a, **k: pytest.fail("a process was started"))
    _refused(capsys, argv, field)


def test_launch_port_in_use(capsys, monkeypatch):
    monkeypatch.setattr(boostjax.runtime.launch.subprocess, "Popen", lambda *a, **k: pytest.fail("a process was started"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        _refused(capsys, ["launch", "--port", port, "--", "train", "--mesh", "data=2"], "launch.port", "in use")


# ------------------------------------------------------------------------------ generate

@pytest.fixture
def config_only_run(tmp_path):
    """A run folder with a config.json (max_seq_len 128) and no checkpoint: every check below comes first."""
    from boostjax.config import Config

    run = tmp_path / "run"
    run.mkdir()
    cfg = Config(model=ModelConfig(d_model=32, n_layers=2, n_heads=2, d_ff=64, rank=8, max_seq_len=128))
    (run / "config.json").write_text(cfg.to_json())
    return run


@pytest.mark.parametrize("flags,needles", [
    (["--prompt", ""], ["generate", "prompt is empty"]),
    (["--max-new-tokens", "126"], ["generate", "max_seq_len=128", "--max-new-tokens <= 125"]),
    (["--max-new-tokens", "0"], ["generate", "max_new_tokens"]),
    (["--temperature", "-0.5"], ["generate", "temperature"]), (["--temperature", "nan"], ["generate", "temperature"]),
    (["--top-p", "0"], ["generate", "top_p"]), (["--top-p", "1.5"], ["generate", "top_p"]),
    (["--top-k", "-1"], ["generate", "top_k"]), (["--seed", "-1"], ["generate", "seed"]),
    (["--step", "-2"], ["generate", "--step"]), (["--top-k", "x"], ["generate.top_k", "invalid int"]),
    ([], ["no checkpoint"]),  # the arguments are fine: the (empty) checkpoints folder is what is refused
])
def test_generate_flags(capsys, config_only_run, flags, needles):
    _refused(capsys, ["generate", "--run", config_only_run, "--prompt", "abc", *flags], *needles)


def test_generate_without_a_run(capsys, tmp_path):
    _refused(capsys, ["generate", "--run", tmp_path / "missing", "--prompt", "abc"], "run:", "is not a folder")
    (tmp_path / "empty").mkdir()
    _refused(capsys, ["generate", "--run", tmp_path / "empty", "--prompt", "abc"], "run:", "no config.json")


def test_multihost_peer_that_never_starts(tmp_path):
    """Process 0 of a 2-process job alone: one line naming the coordinator and the process count after
    --init-timeout seconds (jax 0.10.2 would abort from C++ with a stack trace, after 300 s)."""
    port = boostjax.runtime.launch.free_port()
    t0 = time.monotonic()
    r = subprocess.run(cli_command(*TRAIN, "--mesh", "data=2", "--coordinator", f"127.0.0.1:{port}",
                                   "--num-processes", "2", "--process-id", "0", "--init-timeout", "2",
                                   "--out", tmp_path / "run"), env=cli_env(), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("boostjax: error: train.coordinator: "), r.stderr
    assert f"127.0.0.1:{port}" in lines[0] and "of 2" in lines[0] and "--init-timeout" in lines[0]
    # far below the 300 s C++ abort; the margin is for the process start under load (85 s measured at a load
    # average of 15 on 2 cores, with a 2 s --init-timeout)
    assert time.monotonic() - t0 < 200
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------ data

def test_token_ids_above_the_vocabulary_deep_in_a_bin_file(capsys, tmp_path, monkeypatch):
    ids = np.arange(1_000_000, dtype=np.uint16) % 256
    ids[987_654] = 4000
    path = tmp_path / "tokens.bin"
    ids.tofile(path)
    monkeypatch.setattr(boostjax.data.corpus, "SCAN_BYTES", 1 << 16)  # many chunks: the max is in a late one
    boostjax.data.corpus._MAX_CACHE.clear()
    _refused(capsys, [*TRAIN, "--out", tmp_path / "run", "--data", path], f"data: {path}", "token id 4000",
             "model.vocab_size is 256", "--vocab-size 4001")
    (tmp_path / "odd.bin").write_bytes(b"\x00" * 7)
    _refused(capsys, [*TRAIN, "--out", tmp_path / "run", "--data", tmp_path / "odd.bin"], "not a multiple of uint16")
    (tmp_path / "text.txt").write_text("héllo wörld " * 100)  # byte tokens up to 0xc3
    _refused(capsys, [*TRAIN, "--out", tmp_path / "run", "--data", tmp_path / "text.txt", "--vocab-size", "128"],
             "token id 195", "--vocab-size 196")
    assert not (tmp_path / "run").exists()


def _fail_for(target: pathlib.Path, exc: OSError):
    real = pathlib.Path.read_bytes

    def read_bytes(self):
        if pathlib.Path(self) == target:
            raise exc
        return real(self)

    return read_bytes


@pytest.mark.parametrize("exc,why", [
    (PermissionError(errno.EACCES, "Permission denied"), "Permission denied"),
    (OSError(errno.EIO, "Input/output error"), "Input/output error"),
])
def test_unreadable_data(capsys, tmp_path, monkeypatch, exc, why):
    text = tmp_path / "corpus.txt"
    text.write_text("hello world\n" * 200)
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(3):
        (folder / f"f{i}.txt").write_text(f"file {i}\n" * 100)
    out = tmp_path / "run"
    with monkeypatch.context() as m:
        m.setattr(pathlib.Path, "read_bytes", _fail_for(text, exc))
        _refused(capsys, [*TRAIN, "--out", out, "--data", text], f"data: cannot read {text}", why)
    with monkeypatch.context() as m:  # one unreadable file in a folder
        m.setattr(pathlib.Path, "read_bytes", _fail_for(folder / "f1.txt", exc))
        _refused(capsys, [*TRAIN, "--out", out, "--data", folder], f"{folder / 'f1.txt'}", why)
    real_scandir = os.scandir
    with monkeypatch.context() as m:  # a folder that cannot be listed
        m.setattr(os, "scandir", lambda p=".": (_ for _ in ()).throw(type(exc)(exc.errno, exc.strerror, str(p)))
                  if str(p) == str(folder) else real_scandir(p))
        _refused(capsys, [*TRAIN, "--out", out, "--data", folder], f"data: cannot read {folder}", why)
    binary = tmp_path / "tokens.bin"
    (np.arange(5000, dtype=np.uint16) % 256).tofile(binary)
    boostjax.data.corpus._MAX_CACHE.clear()
    with monkeypatch.context() as m:  # the .bin scan reads with open(): an I/O error there
        m.setattr(boostjax.data.corpus, "open", lambda *a, **k: (_ for _ in ()).throw(exc), raising=False)
        _refused(capsys, [*TRAIN, "--out", out, "--data", binary], f"data: cannot read {binary}", why)
    assert not out.exists()


def test_data_that_is_not_a_file(capsys, tmp_path):
    fifo = tmp_path / "stream.txt"
    os.mkfifo(fifo)  # never opened: reading a FIFO would block
    _refused(capsys, [*TRAIN, "--out", tmp_path / "run", "--data", fifo], "data:", "is a FIFO")
    _refused(capsys, [*TRAIN, "--out", tmp_path / "run", "--data", tmp_path / "missing.bin"], "no such file")
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------ Hugging Face folders

@pytest.fixture()
def hf_folder(tmp_path):
    cfg = ModelConfig(kind="llama", vocab_size=64, d_model=16, n_layers=1, n_heads=2, d_ff=32)
    (tmp_path / hf.CONFIG_NAME).write_text(json.dumps(hf.hf_config(cfg)))
    from safetensors.numpy import save_file

    save_file({"model.norm.weight": np.ones(16, np.float32), "lm_head.weight": np.zeros((64, 16), np.float32)},
              str(tmp_path / hf.WEIGHTS_NAME))
    return tmp_path


def _hf_refused(folder, *needles):
    for fn in (hf.read_hf, hf.from_hf):
        with pytest.raises(ValueError) as e:
            fn(folder)
        msg = str(e.value)
        assert "\n" not in msg and "fix:" in msg and len(msg) < 500, msg
        for n in needles:
            assert str(n) in msg, (n, msg)


@pytest.mark.parametrize("damage", ["truncated", "random", "empty"])
def test_hf_damaged_weights(hf_folder, damage):
    w = hf_folder / hf.WEIGHTS_NAME
    raw = w.read_bytes()
    w.write_bytes({"truncated": raw[: len(raw) // 2], "random": os.urandom(len(raw)), "empty": b""}[damage])
    _hf_refused(hf_folder, w, "not a readable safetensors file")


@pytest.mark.parametrize("content,needle", [
    (b"{not json", "is not valid JSON"), (b"\xff\xfe\x00", "not UTF-8"), (b"[1, 2]", "JSON list"),
    (b'"llama"', "JSON str"), (json.dumps({"hidden_size": "16"}).encode(), "hidden_size"),
])
def test_hf_bad_config(hf_folder, content, needle):
    (hf_folder / hf.CONFIG_NAME).write_bytes(content)
    _hf_refused(hf_folder, hf_folder / hf.CONFIG_NAME, needle)


@pytest.mark.parametrize("change,needle", [
    ({"rope_scaling": "linear"}, "rope_scaling"), ({"rms_norm_eps": "tiny"}, "rms_norm_eps"),
    ({"rope_theta": 0, "rope_parameters": {"rope_theta": 0}}, "model.rope_theta"), ({"rope_parameters": {"rope_theta": None}}, "rope_theta"),
    ({"max_position_embeddings": 2.5}, "max_position_embeddings"), ({"num_hidden_layers": True}, "num_hidden_layers"),
])
def test_hf_config_values(hf_folder, change, needle):
    d = json.loads((hf_folder / hf.CONFIG_NAME).read_text())
    (hf_folder / hf.CONFIG_NAME).write_text(json.dumps({**d, **change}))
    _hf_refused(hf_folder, hf_folder / hf.CONFIG_NAME, needle)


def test_hf_unreadable_config(hf_folder, monkeypatch):
    monkeypatch.setattr(pathlib.Path, "read_bytes",
                        _fail_for(hf_folder / hf.CONFIG_NAME, PermissionError(errno.EACCES, "Permission denied")))
    _hf_refused(hf_folder, hf_folder / hf.CONFIG_NAME, "Permission denied")


# ------------------------------------------------------------------------------ Hugging Face interop

@pytest.mark.parametrize("flags,field", [
    (["--rope-type", "yarn"], "model.rope_type"), (["--rope-factor", "0.5", "--rope-type", "linear"], "model.rope_factor"),
    (["--rope-factor", "8"], "model.rope_factor"), (["--rope-factor", "nan", "--rope-type", "linear"], "model.rope_factor"),
    (["--rope-type", "llama3", "--rope-factor", "8", "--rope-low-freq-factor", "4", "--rope-high-freq-factor", "1"],
     "model.rope_high_freq_factor"),
    (["--rope-type", "llama3", "--rope-original-max-len", "-1"], "model.rope_original_max_len"),
    (["--attn-head-dim", "-2"], "model.attn_head_dim"), (["--attn-head-dim", "7"], "model.attn_head_dim"),
    (["--d-model", "30", "--n-heads", "4"], "model.d_model"),
    (["--bos-token-id", "256"], "model.bos_token_id"), (["--pad-token-id", "-2"], "model.pad_token_id"),
    (["--eos-token-ids", "1,x"], "model.eos_token_ids"), (["--eos-token-ids", "300"], "model.eos_token_ids"),
    (["--model", "llama", "--tie-embeddings", "--strategy", "fullrank-tp", "--mesh", "model=2"], "model.tie_embeddings"),
    (["--model", "llama", "--tie-embeddings", "--mesh", "stage=2"], "model.tie_embeddings"),
])
def test_hf_interop_fields(capsys, tmp_path, flags, field):
    _refused(capsys, [*TRAIN, "--out", tmp_path / "run", *flags], field)
    assert not (tmp_path / "run").exists()


def test_export_bad_shard_size(capsys, tmp_path):
    _refused(capsys, ["export-hf", "--run", tmp_path / "missing", "--out", tmp_path / "hf", "--max-shard-size", "5XB"],
             "export.max_shard_size")
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("change,needle", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}}, "rope_type='yarn'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
    ({"model_type": "mistral", "sliding_window": 16}, "sliding_window=16"), ({"head_dim": 9}, "head_dim=9"),
])
def test_hf_unsupported_shapes(hf_folder, change, needle):
    d = json.loads((hf_folder / hf.CONFIG_NAME).read_text())
    (hf_folder / hf.CONFIG_NAME).write_text(json.dumps({**d, **change}))
    _hf_refused(hf_folder, hf_folder / hf.CONFIG_NAME, needle)


# ------------------------------------------------------------------------------ tokenize and eval

@pytest.fixture()
def texts(tmp_path):
    d = tmp_path / "texts"
    d.mkdir()
    for i in range(4):
        (d / f"{i}.txt").write_text(f"document {i} " * 20)
    return d


def _tokenized(texts, out, tokenizer="byte"):
    from boostjax.data.tokenize import tokenize_corpus

    return tokenize_corpus(texts, out, tokenizer, val_every=2, progress=False)


def test_tokenize_bad_input(capsys, tmp_path, texts):
    out = tmp_path / "tok"
    tok = ["tokenize", "--out", out]
    _refused(capsys, [*tok, "--data", tmp_path / "missing"], "tokenize.data:", "no such file")
    (tmp_path / "empty").mkdir()
    _refused(capsys, [*tok, "--data", tmp_path / "empty"], "tokenize.data:", "no *.txt")
    (tmp_path / "empty.txt").write_text("")
    _refused(capsys, [*tok, "--data", tmp_path / "empty.txt"], "tokenize.data:", "holds no text")
    (tmp_path / "one.txt").write_text("a single document without blank lines\n")
    _refused(capsys, [*tok, "--data", tmp_path / "one.txt"], "tokenize.data:", "1 non-empty document", "--doc-sep line")
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9\n\nau lait".encode("latin-1"))
    _refused(capsys, [*tok, "--data", tmp_path / "latin1.txt"], "tokenize.data:", "not UTF-8", "byte 3")
    for spec in ("train:abc", "train:100", "train:", "train:99999999"):
        _refused(capsys, [*tok, "--data", texts, "--tokenizer", spec], "tokenize.tokenizer:", "train:4096")
    _refused(capsys, [*tok, "--data", texts, "--tokenizer", tmp_path / "nope.json"], "tokenize.tokenizer:",
             "does not exist")
    (tmp_path / "bad.json").write_text("{not json")
    _refused(capsys, [*tok, "--data", texts, "--tokenizer", tmp_path / "bad.json"], "tokenize.tokenizer:",
             "not a Hugging Face tokenizers file")
    (tmp_path / "hf_model").mkdir()  # e.g. a checkpoint with only a sentencepiece tokenizer.model
    _refused(capsys, [*tok, "--data", texts, "--tokenizer", tmp_path / "hf_model"], "tokenize.tokenizer:",
             "holds no tokenizer.json")
    _refused(capsys, [*tok, "--data", texts, "--doc-sep", "page"], "tokenize.doc_sep")
    _refused(capsys, [*tok, "--data", texts, "--val-every", "1"], "tokenize.val_every")
    assert not out.exists()


def test_tokenize_never_overwrites_a_users_folder(capsys, tmp_path, texts):
    users = tmp_path / "mine"
    users.mkdir()
    (users / "train.bin").write_bytes(b"precious")  # a name tokenize writes, but not its output
    _refused(capsys, ["tokenize", "--data", texts, "--out", users], "tokenize.out:", "not an earlier boostjax tokenize")
    _refused(capsys, ["tokenize", "--data", texts, "--out", texts], "tokenize.out:")
    assert (users / "train.bin").read_bytes() == b"precious" and sorted(os.listdir(users)) == ["train.bin"]
    _tokenized(texts, tmp_path / "tok")
    _refused(capsys, ["tokenize", "--data", tmp_path / "tok", "--out", tmp_path / "again"], "already a tokenised folder")
    (tmp_path / "tok" / "notes.txt").write_text("mine")  # an earlier output with a user's file in it
    _refused(capsys, ["tokenize", "--data", texts, "--out", tmp_path / "tok"], "tokenize.out:")


def test_train_on_a_tokenised_folder_bad_input(capsys, tmp_path, texts):
    tok = tmp_path / "tok"
    meta = _tokenized(texts, tok, "train:300")
    run = ["--out", tmp_path / "run", "--data", tok]
    _refused(capsys, [*TRAIN, *run, "--vocab-size", "100"], "model.vocab_size: 100", f"--vocab-size {meta['vocab_size']}")
    (tok / "val-00000.bin").write_bytes((tok / "val-00000.bin").read_bytes()[:-2])  # cut short
    _refused(capsys, [*TRAIN, *run], "val-00000.bin", "the metadata says")
    (tok / "meta.json").write_text(json.dumps({**meta, "version": 7}))
    _refused(capsys, [*TRAIN, *run], "meta.json", "version 7")
    (tok / "meta.json").write_text('{"format": "boostjax-tokens", "version": 1, "incomplete": true}')
    _refused(capsys, [*TRAIN, *run], "interrupted boostjax tokenize", "boostjax tokenize --out")
    assert not (tmp_path / "run").exists()


def test_eval_bad_input(capsys, tmp_path, texts):
    run = tmp_path / "run"
    run.mkdir()
    cfg = {"model": {"kind": "llama", "vocab_size": 256, "d_model": 32, "n_layers": 2, "n_heads": 2, "d_ff": 64},
           "train": {"seq": 32, "batch": 4}}
    (run / "config.json").write_text(json.dumps(cfg))  # a byte-level run (no tokenizer.json)
    _tokenized(texts, tmp_path / "bpe", "train:300")
    ev = ["eval", "--run", run]
    _refused(capsys, [*ev, "--data", tmp_path / "bpe"], "eval.data:", "tokenizer.json", "not with the run's tokenizer")
    _refused(capsys, [*ev, "--data", texts, "--split", "test"], "eval.split:")
    _refused(capsys, [*ev, "--data", tmp_path / "missing"], "eval.data:", "no such file")
    _refused(capsys, [*ev, "--data", texts, "--seq", "0"], "eval.seq")
    _refused(capsys, [*ev, "--data", texts, "--seq", "8192"], "eval.seq", "max_seq_len")
    _refused(capsys, ["eval", "--run", tmp_path / "norun", "--data", texts], "run:")


# ------------------------------------------------------------------------------ --init-from-hf

INIT = ["train", "--batch", "2", "--seq", "16", "--steps", "1", "--no-progress"]
INIT_CFG = ModelConfig(kind="llama", vocab_size=256, d_model=16, n_layers=1, n_heads=2, d_ff=32)


@pytest.fixture()
def init_folder(tmp_path):
    """A complete small Hugging Face folder (numpy weights: nothing is traced)."""
    from boostjax.config import Config
    from boostjax.models.llama import abstract_model

    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda a: rng.normal(size=a.shape).astype(np.float32), abstract_model(Config(INIT_CFG))[1])
    return hf.to_hf((INIT_CFG, params), tmp_path / "hf")


@pytest.mark.parametrize("case,flags,field,needle", [
    ("missing", [], "train.init_from_hf", "does not exist"),
    ("file", [], "train.init_from_hf", "is a file"),
    ("empty", [], "train.init_from_hf", "no config.json"),
    ("no-weights", [], "train.init_from_hf", "no model.safetensors"),
    ("damaged", [], "train.init_from_hf", "not a readable safetensors file"),
    ("ok", ["--d-model", "32"], "model.d_model", "contradicts the checkpoint"),
    ("ok", ["--preset", "60m"], "train.init_from_hf", "drop --preset"),
    ("ok", ["--model", "svd", "--rank", "17", "--no-auto-dense"], "model.rank", "--rank <= 16"),
    ("ok", ["--model", "svd", "--rank", "17"], "model.rank", "every projection would stay dense"),
    ("ok", ["--model", "svd", "--rank", "4", "--rank-kv", "-1"], "model.rank_kv", "must be >= 0"),
    ("tokenizers", ["--data", "DATA"], "train.init_from_hf", "was tokenised with"),
])
def test_init_from_hf_refused(capsys, tmp_path, init_folder, case, flags, field, needle):
    src = {"missing": tmp_path / "nowhere", "file": init_folder / hf.CONFIG_NAME,
           "empty": tmp_path / "empty"}.get(case, init_folder)
    if case == "empty":
        src.mkdir()
    if case == "no-weights":
        (init_folder / hf.WEIGHTS_NAME).unlink()
    if case == "damaged":
        w = init_folder / hf.WEIGHTS_NAME
        w.write_bytes(w.read_bytes()[:100])
    data = tmp_path / "data"
    if case == "tokenizers":  # the data was tokenised byte level, the checkpoint has a BPE tokenizer
        from boostjax.data.tokenizers import train_tokenizer
        from boostjax.data.tokenize import tokenize_corpus

        (tmp_path / "text").mkdir()
        for i in range(4):
            (tmp_path / "text" / f"{i}.txt").write_text(f"hello {i}\n" * 20)
        tokenize_corpus(tmp_path / "text", data, "byte", progress=False)
        train_tokenizer(["hello world"] * 4, 258).save(init_folder)
    flags = [str(data) if f == "DATA" else f for f in flags]
    _refused(capsys, [*INIT, "--init-from-hf", src, "--out", tmp_path / "run", *flags], field, needle)
    assert not (tmp_path / "run").exists()


def test_init_params_refused(tmp_path, init_folder):
    """The Python API: `init=` params that fit neither the model nor its dense twin, and two sources."""
    from boostjax.config import Config, ConfigError, TrainConfig
    from boostjax.training.trainer import train

    t = TrainConfig(steps=1, batch=2, seq=16, progress=False, out=str(tmp_path / "run"))
    with pytest.raises(ConfigError, match=r"^train.init: the params fit neither this svd model"):
        train(Config(ModelConfig(kind="svd", d_model=32, rank=4), t), init={"embed": np.zeros((256, 16))})
    with pytest.raises(ConfigError, match=r"^train.init: both"):
        train(Config(ModelConfig(kind="llama"), TrainConfig(init_from_hf=str(init_folder))), init={})
    assert not (tmp_path / "run").exists()
