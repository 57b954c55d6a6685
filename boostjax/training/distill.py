"""Distillation (Hinton et al., https://arxiv.org/abs/1503.02531): a frozen teacher's logits as soft targets.

    loss = W · T² · KL(softmax(t / T) ‖ softmax(s / T)) + (1 − W) · CE(s, targets)

`t` the teacher's logits, `s` the student's, T `--distill-temperature`, W `--distill-weight`. The
teacher (a Hugging Face LLaMA folder, a Llama .gguf file or a boostjax run folder) runs forward inside
the jitted step on the same batch, in the compute dtype, under `jax.lax.stop_gradient`; its parameters
are an argument of the step, never part of the optimizer state or a checkpoint (a resume reads them
again and checks their fingerprint against the run's `teacher.json`). On a mesh they are split like a
dense model's (`teacher_specs`) and the forward is partitioned by XLA; the student's loss runs under
its strategy's collectives (`objective`: the vocabulary-parallel KL beside the cross-entropy).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from boostjax.config import DATA, MODEL, Config, ConfigError, ModelConfig, flag_of
from boostjax.data import fingerprint
from boostjax.data.source import Source
from boostjax.interop import gguf_in, hf, pretrained
from boostjax.models.collectives import Collectives, vocab_parallel_cross_entropy
from boostjax.models.llama import LLaMA
from boostjax.models.ops import cast_params
from boostjax.runs.folder import CONFIG as RUN_CONFIG
from boostjax.runs.load import load_run, read_config
from boostjax.runtime.interrupt import phase
from boostjax.sharding import rules

FIELD = "train.distill_from"
RECORD = "teacher.json"  # in the run folder: the teacher's path, format and fingerprint
MODEL_SPLIT = ("vocab", "heads", "kv", "ff")  # a dense model's axes split over `model` (fullrank-tp's)


def _is_axes(x: Any) -> bool:
    return isinstance(x, tuple) and all(isinstance(a, str) for a in x)


def _err(msg: str) -> ConfigError:
    return ConfigError(f"{FIELD}: {msg}")


# ----------------------------------------------------------------------------- the loss


def kl_and_ce(logits_btv: jax.Array, targets_bt: jax.Array, teacher_btv: jax.Array, temperature: float,
              coll: Collectives) -> tuple[jax.Array, jax.Array]:
    """(mean token KL(softmax(t/T) ‖ softmax(s/T)), mean token cross-entropy) of one device's rows.

    `logits_btv`: the student's, this device's slice of the vocabulary under a vocabulary-parallel
    head (`coll`); `teacher_btv`: the teacher's over the whole vocabulary (its slice is taken here)."""
    s_btv = logits_btv.astype(jnp.float32) / temperature
    v_local = s_btv.shape[-1]
    logp_t = jax.nn.log_softmax(teacher_btv.astype(jnp.float32) / temperature, axis=-1)
    if v_local != logp_t.shape[-1]:
        logp_t = jax.lax.dynamic_slice_in_dim(logp_t, coll.vocab_offset(v_local), v_local, axis=-1)
    m_bt = coll.vocab_max(jax.lax.stop_gradient(jnp.max(s_btv, axis=-1)))
    lse_bt = jnp.log(coll.vocab_sum(jnp.sum(jnp.exp(s_btv - m_bt[..., None]), axis=-1))) + m_bt
    logp_s = s_btv - lse_bt[..., None]
    kl_bt = coll.vocab_sum(jnp.sum(jnp.exp(logp_t) * (logp_t - logp_s), axis=-1))
    return jnp.mean(kl_bt), vocab_parallel_cross_entropy(logits_btv, targets_bt, coll)


def objective(temperature: float, weight: float) -> Callable:
    """The placements' `objective(logits_btv, rows, coll)`: with the teacher's logits in `rows`
    ("teacher"), `(W·T²·KL + (1 − W)·CE, {"kl": KL, "ce": CE})`; without them (validation) the
    cross-entropy alone."""
    def fn(logits_btv, rows, coll):
        if "teacher" not in rows:
            return vocab_parallel_cross_entropy(logits_btv, rows["targets"], coll)
        kl, ce = kl_and_ce(logits_btv, rows["targets"], rows["teacher"], temperature, coll)
        return weight * temperature ** 2 * kl + (1.0 - weight) * ce, {"kl": kl, "ce": ce}

    return fn


# ----------------------------------------------------------------------------- the teacher


def teacher_format(path: str) -> str:
    """'run' (a boostjax run folder: config.json and checkpoints/), 'gguf' or 'huggingface'."""
    p = pathlib.Path(path)
    if p.is_dir() and (p / RUN_CONFIG).is_file() and (p / "checkpoints").is_dir():
        return "run"
    return "gguf" if gguf_in.is_gguf(p) else "huggingface"


def teacher_config(path: str) -> ModelConfig:
    """The teacher's `ModelConfig`, from its config alone (no weights read); ConfigError naming
    `train.distill_from` when `path` cannot be a teacher."""
    if teacher_format(path) == "run":
        try:
            return read_config(path).model
        except (OSError, ValueError) as e:
            raise _err(f"cannot read the run's {RUN_CONFIG} in {path} ({' '.join(str(e).split())[:200]}); "
                       "fix: pass a finished boostjax run folder, a Hugging Face folder or a .gguf file") from None
    try:
        return pretrained.source_config(path)
    except ConfigError as e:
        raise _err(str(e).split(": ", 1)[1]) from None


def check(cfg: Config, data: Source) -> None:
    """The one-line refusals of a run with a teacher, before anything is read in full or compiled:
    W outside [0, 1], T <= 0, pipeline stages, an offload plan, a missing or unreadable teacher, another
    vocabulary, a shorter context, a tokenizer other than the data's."""
    t, m = cfg.train, cfg.model
    if not (isinstance(t.distill_temperature, (int, float)) and np.isfinite(t.distill_temperature)
            and t.distill_temperature > 0):
        raise ConfigError(f"train.distill_temperature: {t.distill_temperature} must be finite and > 0; fix: pass "
                          f"{flag_of('distill_temperature')} 1.0")
    if not (isinstance(t.distill_weight, (int, float)) and 0.0 <= t.distill_weight <= 1.0):
        raise ConfigError(f"train.distill_weight: {t.distill_weight} outside [0, 1] (the KL term's share); fix: "
                          f"pass {flag_of('distill_weight')} 0.5")
    if not t.distill_from:
        return
    if t.sizes.stage > 1:
        raise _err("a teacher is not implemented across pipeline stages (the schedule does not carry its logits "
                   "to the last stage's loss); fix: drop stage= from --mesh (data and model axes work)")
    if t.offload_plan:
        raise _err("an offload plan was made without the teacher's parameters and logits in its memory budget; "
                   f"fix: drop {flag_of('offload_plan')}")
    tm = teacher_config(t.distill_from)
    if tm.vocab_size != m.vocab_size:
        raise _err(f"the teacher {t.distill_from} has a vocabulary of {tm.vocab_size} tokens, the student "
                   f"{m.vocab_size} (its logits would score other tokens); fix: a teacher of the student's tokenizer, "
                   f"or {flag_of('vocab_size')} {tm.vocab_size} with data tokenised by the teacher's tokenizer")
    if tm.max_seq_len < t.seq:
        raise _err(f"the teacher {t.distill_from} takes at most {tm.max_seq_len} tokens, and --seq is {t.seq}; "
                   f"fix: pass {flag_of('seq')} {tm.max_seq_len} or less")
    as_init = dataclasses.replace(cfg, train=dataclasses.replace(t, init_from_hf=t.distill_from))
    for one in (p.source for p in data.parts) if data.kind == "mixture" else (data,):
        try:
            pretrained.check_source_tokenizer(as_init, one)
        except ConfigError as e:
            raise _err(str(e).split(": ", 1)[1].replace("the checkpoint's", "the teacher's")) from None


@dataclass(frozen=True)
class Teacher:
    """A teacher read from disk: its config, its pure params (host, fp32) and its identity."""

    path: str
    format: str  # 'huggingface', 'gguf' or 'run'
    model: ModelConfig
    params: Any
    fingerprint: str
    step: int | None = None  # a run folder's checkpoint

    @property
    def n_params(self) -> int:
        return int(sum(np.size(x) for x in jax.tree.leaves(self.params)))

    def record(self) -> dict:
        return {"path": str(pathlib.Path(self.path).resolve()), "format": self.format, "fingerprint": self.fingerprint,
                **({"step": self.step} if self.step is not None else {}), "params": self.n_params}


def _hf_files(folder: pathlib.Path) -> list[pathlib.Path]:
    return [folder / RUN_CONFIG] + sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.safetensors.index.json"))


def load(path: str) -> Teacher:
    """The teacher's weights (a run folder: its newest checkpoint that verifies) and fingerprint."""
    fmt = teacher_format(path)
    p = pathlib.Path(path)
    try:
        if fmt == "run":
            cfg, model, step = phase(f"reading the teacher's newest checkpoint in {p}", lambda _: load_run(p))
            params = jax.device_get(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
            ck = p / "checkpoints" / str(step)
            files = [p / RUN_CONFIG] + sorted(f for f in ck.rglob("*") if f.is_file())
            return Teacher(path, fmt, cfg.model, params, fingerprint.of_files(p, files), step)
        m, params = phase(f"reading the teacher's weights from {p}", lambda _: hf.read_hf(p))
        digest = fingerprint.of_file(p) if fmt == "gguf" else fingerprint.of_files(p, _hf_files(p))
        return Teacher(path, fmt, m, params, digest)
    except (OSError, ValueError) as e:  # ConfigError and CheckpointError included
        msg = " ".join(str(e).split())
        raise _err(f"cannot read the teacher {p} ({msg[:300]}); fix: pass a readable Hugging Face folder, .gguf "
                   "file or boostjax run folder") from None


def check_resume(run_dir: pathlib.Path, teacher: Teacher, resuming: bool) -> None:
    """A resumed run keeps its teacher: the fingerprint in the run's `teacher.json` (when there is one)."""
    file = run_dir / RECORD
    if not resuming or not file.is_file():
        return
    try:
        old = json.loads(file.read_text(encoding="utf-8"))["fingerprint"]
    except (OSError, ValueError, KeyError, TypeError):
        raise _err(f"{file} cannot be read; fix: restore it, or start a new run with another --out") from None
    if old != teacher.fingerprint:
        raise _err(f"{teacher.path} is another teacher than the run's (content {teacher.fingerprint[:24]}..., the "
                   f"run's {old[:24]}...); fix: pass the run's teacher, or another --out for a new run")


def write_record(run_dir: pathlib.Path, teacher: Teacher, memory: dict) -> None:
    """`teacher.json`: the teacher's path, format, fingerprint and memory (atomically)."""
    tmp = run_dir / (RECORD + ".tmp")
    tmp.write_text(json.dumps({**teacher.record(), **memory}, indent=1) + "\n")
    tmp.replace(run_dir / RECORD)


# ----------------------------------------------------------------------------- placement and forward


def teacher_specs(teacher: ModelConfig, mesh: Mesh | None, zero: int) -> Any:
    """A `PartitionSpec` per teacher parameter: split like a dense model under fullrank-tp (vocabulary,
    heads, kv heads, MLP width over `model`, where the size divides) and, with ZeRO-3, over `data` too."""
    axes = rules.logical_axes(teacher)
    tp = mesh.shape[MODEL] if mesh is not None else 1
    data = mesh.shape.get(DATA, 1) if mesh is not None and zero >= 3 else 1
    sizes = {a: size(teacher) for a, (_, size) in rules.AXIS_SIZES.items()}

    def spec(ax):
        split = next((i for i, a in enumerate(ax) if a in MODEL_SPLIT and tp > 1 and sizes[a] % tp == 0), None)
        return tuple(MODEL if i == split else None for i in range(len(ax)))

    specs = jax.tree.map(lambda ax: P(*spec(ax)), axes, is_leaf=_is_axes)
    if data <= 1:
        return specs
    like = jax.eval_shape(lambda: nnx.to_pure_dict(nnx.state(LLaMA(teacher, rngs=nnx.Rngs(0)), nnx.Param)))
    return jax.tree.map(lambda s, a: rules.data_sharded(s, a.shape, data), specs, like,
                        is_leaf=lambda x: isinstance(x, P))


def place(teacher: Teacher, mesh: Mesh | None, zero: int, dtype: str) -> Any:
    """The teacher's params on the devices, in the compute dtype, laid out by `teacher_specs`."""
    params = cast_params(jax.tree.map(jnp.asarray, teacher.params), dtype)
    if mesh is None:
        return jax.device_put(params, SingleDeviceSharding(jax.devices()[0]))
    specs = teacher_specs(teacher.model, mesh, zero)
    return jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                                               is_leaf=lambda x: isinstance(x, P)))


def forward(teacher: ModelConfig, mesh: Mesh | None) -> Callable[[Any, dict], jax.Array]:
    """`(params, batch) -> logits_btv`, fp32, without gradient; on a mesh rows split over `data`."""
    graphdef = nnx.split(nnx.eval_shape(lambda: LLaMA(teacher, rngs=nnx.Rngs(0))))[0]

    def fn(params, batch):
        logits_btv = nnx.merge(graphdef, params)(batch["inputs"], segments=batch.get("segments"))
        if mesh is not None:
            logits_btv = jax.lax.with_sharding_constraint(logits_btv, NamedSharding(mesh, P(DATA)))
        return jax.lax.stop_gradient(logits_btv.astype(jnp.float32))

    return fn


def memory(params: Any, logits_bytes: int) -> dict:
    """The placed teacher's parameter bytes (all, and the most on one device) and a step's logits bytes."""
    leaves = jax.tree.leaves(params)
    per_device: dict[Any, int] = {}
    for x in leaves:
        for sh in x.addressable_shards:
            per_device[sh.device] = per_device.get(sh.device, 0) + sh.data.nbytes
    return {"param_bytes": int(sum(x.nbytes for x in leaves)), "param_bytes_per_device": max(per_device.values()),
            "logits_bytes": int(logits_bytes)}
