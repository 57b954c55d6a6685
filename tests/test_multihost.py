"""Multi-host: a two-process CPU job (two simulated devices each, loopback coordinator, gloo) trains
step for step like the single-process four-device run, resumes from its own Orbax checkpoint, and
only process 0 writes; plus the process-group flags, environment variables and SLURM detection."""

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

from boostjax.config import Config, ConfigError, TrainConfig
from boostjax.training.checks import validate
from boostjax.runtime.launch import launch_local
from boostjax.runtime.multihost import ProcessGroup, resolve
from boostjax.runs.load import read_metrics
from boostjax.training.trainer import train
import helpers
from helpers import cli_command, cli_env, model_flags

MICRO = replace(helpers.MICRO, n_layers=1)  # the CLI tests' model, one layer
JOB = TrainConfig(steps=8, batch=8, seq=32, log_every=1, ckpt_every=4, eval_every=100, eval_batches=1,
                  strategy="btp", mesh="data=2,model=2", progress=False)
FLAGS = ["train", *model_flags(MICRO), "--norm-eps", str(MICRO.norm_eps),  # the CLI's preset has CoLA's 1e-6
         "--steps", "8", "--batch", "8", "--seq", "32", "--log-every", "1",
         "--ckpt-every", "4", "--eval-every", "100", "--eval-batches", "1", "--strategy", "btp", "--mesh", "data=2,model=2",
         "--no-progress"]
# Both runs execute the same partitioned program on the same 2 x 2 device grid; each all-reduce
# adds the same two fp32 operands (in-process, or over gloo between the processes), so the losses
# come out bit-identical (observed). The bound allows for a changed reduction order: even another
# partitioning altogether (one device, or data=4) moved the 8 losses by <= 2.7e-7 and the gradient
# norms by <= 1.1e-7 relative, so 3e-6 leaves 10x (1e-6 left 3.7x); a wrong data share (process 1
# loading process 0's rows) moves the step-1 loss by 7e-4 relative.
RTOL = 3e-6


def _records(out):
    return {r["step"]: r for r in read_metrics(out) if "loss" in r}


def _job(out, cache):
    # the second job reuses the first one's compiled programs (JAX's persistent cache): less CI time
    env = {"JAX_COMPILATION_CACHE_DIR": str(cache), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    results = launch_local([*FLAGS, "--out", str(out)], 2, env=env, timeout=240, echo=False)
    for r in results:
        assert r.returncode == 0, f"process {r.process_id}:\n{r.output[-3000:]}"
    return results


def test_two_processes_match_one_process_and_resume(tmp_path):
    out = tmp_path / "job"
    with ThreadPoolExecutor(1) as pool:  # the two-process job runs while this process trains the reference
        job = pool.submit(_job, out, tmp_path / "cache")
        ref = train(Config(MICRO, replace(JOB, out=str(tmp_path / "ref"))))  # one process, 4 of its 8 devices
        first = job.result()
    ref_recs = {m["step"]: m for m in ref.metrics if "loss" in m}
    assert sorted(ref_recs) == list(range(1, 9))
    assert "steps 0->8" in first[0].output and "done:" not in first[1].output  # only process 0 reports
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "loss" in r] == list(range(1, 9))  # one writer, no duplicates
    assert not list(out.glob("*.tmp"))
    got = _records(out)
    for step in range(1, 9):
        for key in ("loss", "grad_norm"):
            assert got[step][key] == pytest.approx(ref_recs[step][key], rel=RTOL, abs=0), (step, key)
    assert Config.from_dict(json.loads((out / "config.json").read_text())).train.num_processes == 2

    # a job killed during steps 5-8 leaves checkpoint 4 as its latest: rerun, continue, same losses
    assert sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == [4, 8]
    shutil.rmtree(out / "checkpoints" / "8")
    second = _job(out, tmp_path / "cache")
    assert "steps 4->8" in second[0].output and "done:" not in second[1].output
    resumed = _records(out)
    assert sorted(resumed) == list(range(1, 9))
    for step in range(1, 9):
        assert resumed[step]["loss"] == got[step]["loss"], step  # same program, same data: bit-identical


def _cfg(**kw):
    return Config(MICRO, TrainConfig(**{"mesh": "data=2,model=2", "strategy": "btp", **kw}))


@pytest.mark.parametrize("kw, match", [
    ({"coordinator": "127.0.0.1:1234", "num_processes": 2}, "train.process_id: a multi-host job needs"),
    ({"num_processes": 2, "process_id": 0}, "train.coordinator: a multi-host job needs"),
    ({"coordinator": "node0", "num_processes": 2, "process_id": 0}, "train.coordinator: 'node0' is not HOST:PORT"),
    ({"coordinator": "h:1", "num_processes": 2, "process_id": 2}, r"train.process_id: 2 is not in \[0, 2\)"),
    ({"coordinator": "h:1", "num_processes": 3, "process_id": 0}, "do not split evenly over 3 processes"),
    ({"coordinator": "h:1", "num_processes": 2, "process_id": 0, "mesh": "", "strategy": "none"},
     "needs a device mesh"),
    ({"num_processes": -1}, "train.num_processes: must be >= 1"),
    ({"num_processes": 1, "process_id": 1}, "single-process run"),
])
def test_bad_process_flags_name_the_fix(kw, match):
    with pytest.raises(ConfigError, match=match) as e:
        validate(_cfg(**kw))
    assert "fix:" in str(e.value)


def test_process_group_sources(monkeypatch):
    flags = _cfg(coordinator="10.0.0.1:1234", num_processes=2, process_id=1).train
    assert resolve(flags, {}) == ProcessGroup(2, 1, "10.0.0.1:1234", "flags")
    env = {"BOOSTJAX_COORDINATOR": "h:5", "BOOSTJAX_NUM_PROCESSES": "2", "BOOSTJAX_PROCESS_ID": "0"}
    assert resolve(_cfg().train, env) == ProcessGroup(2, 0, "h:5", "env")
    with pytest.raises(ConfigError, match="BOOSTJAX_PROCESS_ID: a multi-host job needs"):
        resolve(_cfg().train, {"BOOSTJAX_COORDINATOR": "h:5", "BOOSTJAX_NUM_PROCESSES": "2"})
    assert resolve(_cfg().train, {}) is None  # no flags, no variables, no cluster: one process
    slurm = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "gpu[01-02]", "SLURM_NTASKS": "2",
             "SLURM_PROCID": "1", "SLURM_LOCALID": "0"}
    for k, v in slurm.items():
        monkeypatch.setenv(k, v)
    assert resolve(_cfg().train, {}) == ProcessGroup(2, 1, None, "slurm")  # JAX's own detection
    assert resolve(_cfg(num_processes=1).train, {}) is None  # --num-processes 1 overrides the job
    with pytest.raises(ConfigError, match="do not split evenly over 2 processes"):
        resolve(_cfg(mesh="data=3").train, {})


def test_cluster_detection_skips_cluster_types_without_a_name(monkeypatch):
    """jax 0.7's K8sCluster has no `name` attribute; detection must pass over it, not raise."""
    from jax._src import clusters

    class Nameless:  # is_env_present would raise if it were asked: it must not be
        @classmethod
        def is_env_present(cls):
            raise AssertionError("asked a cluster type boostjax does not auto-detect")

    monkeypatch.setattr(clusters.ClusterEnv, "_cluster_types", [Nameless, *clusters.ClusterEnv._cluster_types])
    assert resolve(_cfg().train, {}) is None


def test_a_signal_to_one_process_stops_the_whole_job_at_one_step(tmp_path):
    """SIGTERM reaches one process of a job: JAX's preemption service tells the other, both stop after
    the same step, the checkpoint of that step is saved by both, and both exit 143."""
    import signal
    import subprocess
    import time

    from boostjax.runs.checkpoint import Checkpointer
    from boostjax.runtime.launch import free_port

    out, port = tmp_path / "job", free_port()
    flags = [*FLAGS, "--steps", "1000", "--ckpt-every", "500", "--out", str(out)]  # the last --steps wins
    procs = [subprocess.Popen(cli_command(*flags, "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                                          "--process-id", i), env=cli_env(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        deadline = time.monotonic() + 240
        while (not out.is_dir() or len(_records(out)) < 3) and time.monotonic() < deadline and all(p.poll() is None for p in procs):
            time.sleep(0.05)
        procs[1].send_signal(signal.SIGTERM)
        errs = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [143, 143], errs
    assert "Traceback" not in errs[0] + errs[1]
    stop = int(errs[0].strip().splitlines()[-1].split("after step ")[1].split(";")[0])
    assert 3 <= stop < 1000
    ck = Checkpointer(out / "checkpoints", writer=False)
    assert ck.steps() == [stop] and ck.verify(stop) == (None, True)
    ck.close()
