"""Multi-host: a two-process CPU job (two simulated devices each, loopback coordinator, gloo) trains
step for step like the single-process four-device run, resumes from its own Orbax checkpoint, and
only process 0 writes, and resumes again started as a SLURM job (its variables emulated on loopback)
to the same steps; plus the process-group flags, environment
variables, every scheduler's variables (good and bad) and the JobSet file in docs/k8s/."""

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest

from boostjax.config import Config, ConfigError, MeshShape, TrainConfig
from boostjax.training.checks import validate
from boostjax.runtime.launch import launch_local
from boostjax.runtime.multihost import ProcessGroup, resolve
from boostjax.runtime.schedulers import BY_NAME, SCHEDULERS, detect, emulated_env, job_port
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


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The single-process run (4 of this process's 8 devices): its per-step records, computed in a
    thread while the first multi-process job runs."""
    out = tmp_path_factory.mktemp("ref")

    def run():
        return {m["step"]: m for m in train(Config(MICRO, replace(JOB, out=str(out)))).metrics if "loss" in m}

    with ThreadPoolExecutor(1) as pool:
        yield pool.submit(run)


def _job(out, **how):
    # the processes inherit the session's persistent compilation cache (conftest): every job after the
    # first loads the same compiled programs (less CI time)
    results = launch_local([*FLAGS, "--out", str(out)], 2, timeout=240, echo=False, **how)
    for r in results:
        assert r.returncode == 0, f"process {r.process_id}:\n{r.output[-3000:]}"
    return results


def _assert_same_steps(got, ref_recs):
    assert sorted(ref_recs) == list(range(1, 9))
    for step in range(1, 9):
        for key in ("loss", "grad_norm"):
            assert got[step][key] == pytest.approx(ref_recs[step][key], rel=RTOL, abs=0), (step, key)


def test_two_processes_match_one_process_and_resume(tmp_path, reference):
    out = tmp_path / "job"
    first = _job(out)
    ref_recs = reference.result()
    assert "steps 0->8" in first[0].output and "done:" not in first[1].output  # only process 0 reports
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "loss" in r] == list(range(1, 9))  # one writer, no duplicates
    assert not list(out.glob("*.tmp"))
    got = _records(out)
    _assert_same_steps(got, ref_recs)
    assert Config.from_dict(json.loads((out / "config.json").read_text())).train.num_processes == 2

    # a job killed during steps 5-8 leaves checkpoint 4 as its latest: rerun, continue, same losses
    assert sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == [4, 8]
    shutil.rmtree(out / "checkpoints" / "8")
    # rerun as a SLURM job (srun, one task per node: each drives all its node's devices; no multi-host
    # flags, each process reads its place from the emulated variables); PBS mpiexec and a k8s JobSet take
    # the same path after `detect`, whose reading of their variables the tests below check
    second = _job(out, scheduler="slurm", nodes=2)
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
    assert resolve(_cfg().train, slurm) == ProcessGroup(2, 1, f"gpu01:{61440 + 7}", "slurm", (0, 1))
    assert resolve(flags, slurm).source == "flags"  # the flags win over the job's variables
    assert resolve(_cfg().train, {**slurm, **env}).source == "env"  # and so do BOOSTJAX_*
    assert resolve(_cfg(num_processes=1).train, slurm) is None  # --num-processes 1 overrides the job
    with pytest.raises(ConfigError, match="do not split evenly over 2 processes"):
        resolve(_cfg(mesh="data=3").train, slurm)


# ------------------------------------------------------------------------------ scheduler variables

MESH8 = MeshShape(data=2, model=4)  # two nodes of four GPUs
POLARIS_NODES = "x3006c0s13b0n0.hsn.cm.polaris.alcf.anl.gov\nx3006c0s13b1n0.hsn.cm.polaris.alcf.anl.gov\n"


def _slurm(ntasks, procid, localid, **more):
    return {"SLURM_JOB_ID": "123456", "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_NTASKS": str(ntasks),
            "SLURM_PROCID": str(procid), "SLURM_LOCALID": str(localid), **more}


def _polaris(nodefile, rank, local, size=8, **more):
    return {"PBS_JOBID": "4242.polaris-pbs-01.hsn.cm.polaris.alcf.anl.gov", "PBS_NODEFILE": str(nodefile),
            "PALS_RANKID": str(rank), "PALS_LOCAL_RANKID": str(local), "PMI_RANK": str(rank),
            "PMI_SIZE": str(size), "PMI_LOCAL_RANK": str(local), **more}


def _k8s(index, **more):
    return {"BOOSTJAX_K8S_PROCESSES": "2", "JOB_COMPLETION_INDEX": str(index), "JOBSET_NAME": "llama",
            "REPLICATED_JOB_NAME": "workers", **more}


@pytest.fixture
def nodefile(tmp_path):
    path = tmp_path / "nodefile"
    path.write_text(POLARIS_NODES)
    return path


def test_scheduler_variables_give_the_process_group(nodefile):
    slurm_port, pbs_port = 61440 + 123456 % 4096, 61440 + 4242 % 4096
    assert job_port("123456") == slurm_port and job_port("4242.polaris-pbs-01") == pbs_port
    cases = [
        (_slurm(8, 5, 1), (8, 5, f"gpu07:{slurm_port}", "slurm", (1,)), MeshShape(data=2, model=4)),  # task per GPU
        (_slurm(2, 1, 0), (2, 1, f"gpu07:{slurm_port}", "slurm", (0, 1, 2, 3)), MESH8),  # task per node
        (_slurm(8, 5, 1, CUDA_VISIBLE_DEVICES="1"), (8, 5, f"gpu07:{slurm_port}", "slurm", (0,)), MESH8),  # bound
        (_slurm(2, 1, 0, JAX_COORDINATOR_PORT="1234"), (2, 1, "gpu07:1234", "slurm", (0, 1, 2, 3)), MESH8),
        (_polaris(nodefile, 6, 2), (8, 6, f"x3006c0s13b0n0.hsn.cm.polaris.alcf.anl.gov:{pbs_port}", "mpiexec", (2,)),
         MESH8),
        (_polaris(nodefile, 1, 0, size=2), (2, 1, f"x3006c0s13b0n0.hsn.cm.polaris.alcf.anl.gov:{pbs_port}",
                                             "mpiexec", (0, 1, 2, 3)), MESH8),
        ({"OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911", "OMPI_COMM_WORLD_SIZE": "8",
          "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "3"},
         (8, 3, f"10.96.0.1:{job_port('1531576320')}", "mpiexec", (3,)), MESH8),  # Open MPI 4's mpirun
        (_k8s(1), (2, 1, "llama-workers-0-0.llama:61440", "k8s", (0, 1, 2, 3)), MESH8),
        (_k8s(1, JAX_COORDINATOR_ADDRESS="10.1.2.3:99"), (2, 1, "10.1.2.3:99", "k8s", (0, 1, 2, 3)), MESH8),
    ]
    for environ, want, mesh in cases:
        assert detect(environ, mesh) == ProcessGroup(*want), environ
    assert detect(_slurm(1, 0, 0), MESH8) is None  # one task: a single-process run
    assert detect({"SLURM_JOB_ID": "1", "SLURM_PROCID": "0"}, MESH8) is None  # the batch script, not an srun task
    assert detect({"JOB_COMPLETION_INDEX": "0"}, MESH8) is None  # an indexed Job that declares no job size
    assert detect({}, MESH8) is None


@pytest.mark.parametrize("environ, match", [
    ({k: v for k, v in _slurm(8, 5, 1).items() if k != "SLURM_NTASKS"}, "SLURM_NTASKS: not set"),
    (_slurm(8, "x", 1), "SLURM_PROCID: 'x' is not a non-negative integer"),
    (_slurm(8, 5, 1, SLURM_STEP_NODELIST=""), "SLURM_STEP_NODELIST: .. names no node"),
    (_slurm(8, 8, 0), r"slurm: this process.s id 8 is not in \[0, 8\)"),
    (_slurm(8, 5, 1, JAX_COORDINATOR_PORT="http"), "JAX_COORDINATOR_PORT: 'http' is not a TCP port"),
    (_slurm(8, 5, 3, CUDA_VISIBLE_DEVICES="0,1"), "CUDA_VISIBLE_DEVICES: local rank 3 drives GPU 3 "),
    (_slurm(3, 1, 1), "train.mesh: its 8 devices do not split evenly over 3 processes"),
    ({"PMI_RANK": "1", "PMI_LOCAL_RANK": "1"}, "PMI_SIZE: not set"),
    ({"PALS_RANKID": "1", "PMI_SIZE": "2"}, "PALS_LOCAL_RANKID: not set"),
    ({"PMI_RANK": "1", "PMI_SIZE": "2", "PMI_LOCAL_RANK": "1"}, "PBS_NODEFILE: not set"),
    ({"PMI_RANK": "1", "PMI_SIZE": "2", "PMI_LOCAL_RANK": "1", "PBS_NODEFILE": "/nonexistent/nodes"},
     "PBS_NODEFILE: cannot read /nonexistent/nodes"),
    (_k8s(1, JOBSET_NAME=""), "JOBSET_NAME: not set"),
    ({"BOOSTJAX_K8S_PROCESSES": "2"}, "JOB_COMPLETION_INDEX: not set"),
    (_k8s(0, JAX_COORDINATOR_ADDRESS="pod0"), "JAX_COORDINATOR_ADDRESS: 'pod0' is not HOST:PORT"),
])
def test_bad_scheduler_variables_name_the_variable_and_the_fix(environ, match):
    with pytest.raises(ConfigError, match=match) as e:
        detect(environ, MESH8)
    assert "fix:" in str(e.value) and "\n" not in str(e.value)


def test_empty_pbs_nodefile(tmp_path):
    (tmp_path / "nodes").write_text("\n")
    with pytest.raises(ConfigError, match="PBS_NODEFILE: .* lists no node; fix:"):
        detect(_polaris(tmp_path / "nodes", 1, 1), MESH8)


@pytest.mark.parametrize("name", [s.name for s in SCHEDULERS])
def test_emulated_variables_read_back_as_the_job(tmp_path, name):
    """What `boostjax launch --scheduler` gives each process is read back as that process's place."""
    mesh = MeshShape(data=2, model=2)
    for nodes in ((1, 2) if name != "k8s" else (2,)):
        for i in range(2):
            environ = emulated_env(name, 2, i, nodes, 4321, tmp_path)
            assert set(environ) <= set(BY_NAME[name].variables) | {"JAX_COORDINATOR_ADDRESS", "JAX_COORDINATOR_PORT",
                                                                   "SLURM_NODEID", "SLURM_STEP_NUM_NODES",
                                                                   "PALS_NODEID", "PMI_LOCAL_SIZE"}
            local = i if nodes == 1 else 0
            assert detect(environ, mesh) == ProcessGroup(2, i, "127.0.0.1:4321", name, (2 * local, 2 * local + 1))


def test_the_jobset_file_sets_what_the_k8s_entry_reads():
    """docs/k8s/jobset.yaml: the variables it sets (with what JobSet and Kubernetes set) place its pods."""
    yaml = pytest.importorskip("yaml")
    from boostjax.cli.train import add_train_command, train_config
    import argparse

    doc = yaml.safe_load((Path(__file__).resolve().parents[1] / "docs" / "k8s" / "jobset.yaml").read_text())
    assert doc["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and doc["kind"] == "JobSet"
    assert doc["spec"]["network"]["enableDNSHostnames"] is True and "subdomain" not in doc["spec"]["network"]
    [rjob] = doc["spec"]["replicatedJobs"]
    job = rjob["template"]["spec"]
    [container] = job["template"]["spec"]["containers"]
    literal = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    annotation = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"] if "valueFrom" in e}
    k8s = BY_NAME["k8s"]
    assert set(literal) | set(annotation) <= set(k8s.variables) | {"JAX_COORDINATOR_PORT"}
    assert annotation == {"JOBSET_NAME": "metadata.annotations['jobset.sigs.k8s.io/jobset-name']",
                          "REPLICATED_JOB_NAME": "metadata.annotations['jobset.sigs.k8s.io/replicatedjob-name']"}
    n = int(literal["BOOSTJAX_K8S_PROCESSES"])
    assert rjob["replicas"] == 1 and job["completionMode"] == "Indexed" and job["parallelism"] == job["completions"] == n
    gpus = container["resources"]["limits"]["nvidia.com/gpu"]

    parser = argparse.ArgumentParser(prog="boostjax")
    add_train_command(parser.add_subparsers(dest="command"))
    assert container["command"][:2] == ["boostjax", "train"]
    mesh = train_config(parser.parse_args(container["command"][1:])).train.mesh
    assert mesh.devices == n * gpus  # the mesh covers every pod's GPUs
    port = int(literal["JAX_COORDINATOR_PORT"])
    assert container["ports"] == [{"containerPort": port}]
    name = doc["metadata"]["name"]
    for index in range(n):  # the pod's environment: the file's values, JobSet's annotations, Kubernetes' index
        pod = {**literal, "JOBSET_NAME": name, "REPLICATED_JOB_NAME": rjob["name"], "JOB_COMPLETION_INDEX": str(index)}
        assert detect(pod, mesh) == ProcessGroup(n, index, f"{name}-{rjob['name']}-0-0.{name}:{port}", "k8s",
                                                 tuple(range(gpus)))


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
