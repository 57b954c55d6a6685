"""What one micro-batch costs on one model-parallel group, read from compiled programs (no weights).

`measure(key)` compiles abstractly, on a `data=1,model=T` mesh with 1 and with 2 layers, the training
step `boostjax train` compiles for one micro-batch and its optimizer update alone: their HLO cost
(`costs.program_cost`), the step's memory (`memory.memory_parts`), and one layer's traced backward
residuals (`layer_residual_bytes`). Time comes from a compile with materialised attention; on GPUs the
memory from a second, chunked one. Results are cached in the process and, with `cache_dir`, on disk.
Detail: docs/planning.md ("Cost model", and "Pruning" for the cache).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import asdict, dataclass, replace
from typing import Any

import jax
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from boostjax.analysis import memory
from boostjax.config import Config, ModelConfig, validate
from boostjax.models.llama import LLaMA
from boostjax.planning.costs import program_cost
from boostjax.planning.residuals import layer_residual_bytes
from boostjax.training.step import step_layout, train_state_shapes

CACHE_VERSION = 4  # 2: memory from the chunked compile on GPUs; 3: program costs list each executed instruction's bytes; 4: GEMMs say whether the lhs contracts a major dimension


@dataclass(frozen=True)
class Key:
    """One compiled measurement: the model (its n_layers ignored), TP, micro-batch rows, remat, dtype."""

    model: ModelConfig
    strategy: str  # "none" when tp == 1
    tp: int
    micro_batch: int  # rows of one micro-batch on one data shard
    seq: int
    remat: str
    dtype: str
    optimizer: str = "adamw"
    fused_attention: bool = True  # price the scores as a flash kernel would (GPU); False: as compiled (CPU)

    @property
    def memory_attention(self) -> str:
        """The attention the memory parts are compiled with (docs/planning.md)."""
        return "chunked" if self.fused_attention and self.seq > self.model.attention_block else "xla"

    def config(self, layers: int, attention: str = "xla") -> Config:
        mesh = f"data=1,model={self.tp}" if self.tp > 1 else None
        model = replace(self.model, n_layers=layers, attention=attention,
                        max_seq_len=max(self.model.max_seq_len, self.seq))
        t = memory.train_config(self.micro_batch, self.seq, self.strategy, mesh, self.remat, self.dtype,
                                optimizer=self.optimizer)
        return validate(Config(model, t))

    def digest(self) -> str:
        """The cache file's name: the key's fields, `CACHE_VERSION`, and the JAX version and backend that
        compile it (a cache kept across runs, `boostjax plan --auto`'s by default, never serves another's)."""
        blob = json.dumps({"v": CACHE_VERSION, "jax": jax.__version__, "backend": jax.default_backend(),
                           **asdict(self)}, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:24]


def step_program(cfg: Config) -> tuple[str, dict[str, int]]:
    """HLO text and memory parts of the training step `boostjax train` compiles for `cfg`."""
    step = memory.train_step_compiled(cfg)
    return step.compiled.as_text(), memory.memory_parts(step)


def update_program(cfg: Config) -> Any:
    """`cfg`'s optimizer update alone, compiled (`jax.stages.Compiled`), on the step's state layout (as `training.step.train_step`
    after its value_and_grad: update, apply, gradient norm)."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: LLaMA(cfg.model, rngs=nnx.Rngs(0))))
    lay = step_layout(cfg, graphdef, state.to_pure_dict())
    sds, _ = train_state_shapes(cfg, graphdef, state.to_pure_dict())

    def update(params, opt_state, grads):
        updates, opt_state = lay.tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, optax.tree.norm(grads)

    kw = {}
    if lay.placement.mesh is not None:
        kw["out_shardings"] = (lay.homes.params, lay.homes.opt_state, NamedSharding(lay.placement.mesh, P()))
    opts = memory.FAST_CPU if jax.default_backend() == "cpu" else None
    return jax.jit(update, donate_argnums=(0, 1), **kw).lower(sds.params, sds.opt_state, sds.params).compile(opts)


@functools.lru_cache(maxsize=256)
def _update_cost(key: Key, layers: int) -> dict[str, Any]:
    k = replace(key, micro_batch=1, remat="none")  # the update depends on neither
    gemm_dtype = "bf16" if key.fused_attention else None
    return program_cost(update_program(k.config(layers)).as_text(), key.seq, 1, key.fused_attention, gemm_dtype)


def _compile(key: Key) -> dict[str, Any]:
    gemm_dtype = "bf16" if key.fused_attention else None
    out: dict[str, Any] = {}
    for layers in (1, 2):
        text, parts = step_program(key.config(layers))
        if key.memory_attention != "xla":
            _, parts = step_program(key.config(layers, key.memory_attention))
        out[str(layers)] = {"step": program_cost(text, key.seq, key.micro_batch, key.fused_attention, gemm_dtype),
                            "opt": _update_cost(key, layers), "memory": parts,
                            "memory_attention": key.memory_attention}
    return out


def _with_residuals(key: Key, res: dict[str, Any]) -> dict[str, Any]:
    """`res` with `layer_residual_bytes` (`planning.residuals`: traced, not compiled; what a pipeline
    tick keeps per layer), added to measurements cached before it existed."""
    if "layer_residual_bytes" not in res:
        res["layer_residual_bytes"] = layer_residual_bytes(key)
    return res


_MEMO: dict[Key, dict[str, Any]] = {}


def _path(key: Key, cache_dir: str | None) -> str | None:
    return os.path.join(cache_dir, f"{key.digest()}.json") if cache_dir else None


def is_cached(key: Key, cache_dir: str | None = None) -> bool:
    """`measure(key, cache_dir)` would compile nothing."""
    path = _path(key, cache_dir)
    return key in _MEMO or bool(path and os.path.exists(path))


def measure(key: Key, cache_dir: str | None = None) -> tuple[dict[str, Any], bool]:
    """`{"1": {...}, "2": {...}}` (per layer count: `step` and `opt` program costs, the step's `memory`
    parts) and whether it was compiled now (False: from a cache)."""
    if key in _MEMO:
        return _MEMO[key], False
    path = _path(key, cache_dir)
    if path and os.path.exists(path):
        with open(path) as fh:
            _MEMO[key] = _with_residuals(key, json.load(fh))
        return _MEMO[key], False
    res = _with_residuals(key, _compile(key))
    _MEMO[key] = res
    if path:
        os.makedirs(cache_dir, exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as fh:
            json.dump(res, fh)
        os.replace(tmp, path)
    return res, True


__all__ = ["Key", "is_cached", "measure", "step_program", "update_program"]
