"""What a run shows: TensorBoard event files holding the metrics.jsonl scalars (read back here with a
small TFRecord reader and tensorboardX's protobufs, no TensorFlow), a resume that TensorBoard shows
without duplicated steps, a `--profile START:STOP` trace of those steps only, and MFU by hand."""

import gzip
import json
import pathlib
import shutil
import struct

import numpy as np
import pytest
from tensorboardX.proto.event_pb2 import Event, SessionLog

from boostjax.cli import main
from boostjax.runtime.hardware import PROFILES, profile_for_device

D, L, F, V, SEQ, BATCH = 32, 2, 64, 256, 16, 4
FLAGS = ["train", "--model", "llama", "--d-model", D, "--n-layers", L, "--n-heads", 2, "--d-ff", F, "--vocab-size", V,
         "--seq", SEQ, "--batch", BATCH, "--no-progress", "--log-every", 1, "--eval-every", 3, "--eval-batches", 1,
         "--ckpt-every", 3, "--steps", 6]


def _train(out: pathlib.Path, *extra) -> None:
    assert main([str(a) for a in [*FLAGS, "--out", out, *extra]]) == 0


def _records(path: pathlib.Path):
    """The events of one TFRecord file (length, its masked CRC, payload, its masked CRC)."""
    data, i = path.read_bytes(), 0
    while i < len(data):
        (n,) = struct.unpack("<Q", data[i:i + 8])
        yield Event.FromString(data[i + 12:i + 12 + n])
        i += 12 + n + 4


def _scalars(folder: pathlib.Path) -> tuple[dict[tuple[str, int], float], list[int]]:
    """{(tag, step): value} as TensorBoard shows it (files in name order; a session start at step s
    hides the earlier files' points at steps >= s), and the steps of the session starts."""
    shown: dict[tuple[str, int], float] = {}
    starts = []
    for f in sorted(folder.glob("events.out.tfevents.*")):
        for ev in _records(f):
            if ev.HasField("session_log") and ev.session_log.status == SessionLog.START:
                starts.append(ev.step)
                shown = {k: v for k, v in shown.items() if k[1] < ev.step}
            for v in ev.summary.value:
                assert (v.tag, ev.step) not in shown, ("a step logged twice in one session", v.tag, ev.step)
                shown[(v.tag, ev.step)] = v.simple_value
    return shown, starts


def _metrics(run: pathlib.Path) -> dict[tuple[str, int], float]:
    out = {}
    for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()):
        out.update({(k, m["step"]): v for k, v in m.items() if k != "step" and isinstance(v, (int, float))})
    return out


def _assert_same(shown: dict, metrics: dict) -> None:
    assert shown.keys() == metrics.keys()
    for k, v in metrics.items():
        assert shown[k] == np.float32(v), (k, shown[k], v)  # TensorBoard stores float32


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("observe") / "run"
    _train(out, "--hardware", "A100-80GB", "--profile", "1:3")
    return out


def test_tensorboard_holds_the_metrics(run):
    shown, starts = _scalars(run / "tensorboard")
    assert starts == [1]
    assert {"loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "mfu"} <= {tag for tag, _ in shown}
    _assert_same(shown, _metrics(run))


def test_mfu_is_the_hand_formula(run):
    """6 x (matmul weights: 4 d^2 attention + 3 d f MLP per layer, d V head) + 12 L s d attention
    FLOPs per token, times tokens/s, over the A100's 312 TFLOP/s on the one device."""
    per_token = 6 * (L * (4 * D * D + 3 * D * F) + D * V) + 12 * L * SEQ * D
    records = [m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in m]
    assert len(records) == 6
    for m in records:
        assert m["mfu"] == pytest.approx(per_token * m["tokens_per_s"] / 312e12, rel=1e-12)
        assert m["tokens_per_s"] == pytest.approx(BATCH * SEQ / m["step_s"], rel=1e-12)


def test_profile_traces_the_asked_steps_only(run):
    traces = list((run / "profile").rglob("*.xplane.pb"))
    assert len(traces) == 1
    names = {e.get("name") for f in traces[0].parent.glob("*.trace.json.gz")
             for e in json.load(gzip.open(f))["traceEvents"]}
    assert {n for n in names if str(n).startswith("step ")} == {"step 1", "step 2"}


def test_resume_from_an_older_checkpoint_shows_each_step_once(run, tmp_path):
    """Checkpoint 6 lost after its metrics were written: the resume restarts at 3 and relogs 4..6;
    TensorBoard (session start at 4) shows them once, equal to the trimmed metrics.jsonl."""
    resumed = tmp_path / "run"
    shutil.copytree(run, resumed)
    shutil.move(resumed / "checkpoints" / "6", tmp_path / "lost-6")
    _train(resumed)  # no --hardware: detection on this CPU finds no peak, so no MFU after the resume
    shown, starts = _scalars(resumed / "tensorboard")
    assert starts == [1, 4]
    metrics = _metrics(resumed)
    assert {s for (k, s) in metrics if k == "mfu"} == {1, 2, 3}
    _assert_same(shown, metrics)
    assert len(list((resumed / "profile").rglob("*.xplane.pb"))) == 1  # the span lies before step 3


def test_no_tensorboard(tmp_path):
    _train(tmp_path / "run", "--no-tensorboard")  # the same program as `run`: compiled once
    assert not (tmp_path / "run" / "tensorboard").exists() and not (tmp_path / "run" / "profile").exists()


@pytest.mark.parametrize("kind,name", [("NVIDIA H100 80GB HBM3", "H800-80GB"), ("NVIDIA H200", "H200-141GB"),
                                       ("NVIDIA A100-SXM4-40GB", "A100-40GB"), ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
                                       ("NVIDIA GeForce RTX 3090", "RTX3090-24GB"), ("cpu", None), ("TPU v4", None)])
def test_device_kind_detection(kind, name):
    got = profile_for_device(kind)
    assert (got.name if got else None) == name
    assert name is None or got is PROFILES[name]
