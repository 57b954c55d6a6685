"""boostjax: training for low-rank bottleneck LLMs (CoLA, SVD, LaX) and their full-rank baselines.

The public API is imported lazily, so `boostjax.simulate_devices(n)` (and the CLI) can still set
the number of simulated CPU devices before JAX starts.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    # configuration
    "Config": "boostjax.config", "ModelConfig": "boostjax.config", "TrainConfig": "boostjax.config",
    "ConfigError": "boostjax.config", "preset": "boostjax.config", "PRESETS": "boostjax.config",
    "validate": "boostjax.training.checks",
    # models
    "LLaMA": "boostjax.models.llama", "param_count": "boostjax.models.flops",
    "flops_per_token": "boostjax.models.flops",
    # data
    "ByteTokenizer": "boostjax.data", "load_corpus": "boostjax.data", "BatchIterator": "boostjax.data",
    # tokenised data folders and held-out evaluation
    "tokenize_corpus": "boostjax.data.tokenize", "evaluate": "boostjax.inference.evaluation",
    "DocumentIterator": "boostjax.data", "batch_iterator": "boostjax.data",  # packed documents
    # training (resolve_config: the configuration boostjax train's flags give)
    "resolve_config": "boostjax.training.prepare", "train": "boostjax.training.trainer",
    "TrainResult": "boostjax.training.trainer", "NonFiniteLoss": "boostjax.training.trainer",
    "init_model": "boostjax.models.llama", "load_run": "boostjax.runs.load", "simulate_devices": "boostjax.runtime.devices",
    "keep_scratch_memory": "boostjax.runtime.allocator",  # call first in a notebook, like simulate_devices
    # generation (KV cache; greedy, top-k, top-p)
    "generate": "boostjax.inference.generation",
    # interop
    "from_hf": "boostjax.interop.hf", "to_hf": "boostjax.interop.hf", "read_hf": "boostjax.interop.hf",
    # starting from pretrained weights (train --init-from-hf, train(cfg, init=...))
    "lowrank_from_dense": "boostjax.interop.pretrained",
    # tensor parallelism and its communication, read from compiled HLO
    "comm_report": "boostjax.analysis.comm",
    # the whole configuration of a run on a cluster (boostjax plan --auto)
    "plan_auto": "boostjax.planning.search",
    # pipeline parallelism (mesh axis `stage`)
    "bubble_fraction": "boostjax.sharding.pipeline", "pipeline_info": "boostjax.sharding.pipeline",
    # optimizers
    "rotated_adam": "boostjax.optim.rotation", "adam8bit": "boostjax.optim.adam8bit",
    "make_optimizer": "boostjax.optim.registry", "build_optimizer": "boostjax.optim.registry",
    # offload planning
    "solve_plan": "boostjax.offload.planner", "build_instance": "boostjax.offload.costmodel",
    "get_profile": "boostjax.runtime.hardware",
    # the tokenizer of a run, tokenised data folder or Hugging Face folder (byte level when it has none)
    "load_tokenizer": "boostjax.data.tokenizers",
}

__all__ = sorted(_EXPORTS)


_RENAMED = {"solve_plan": "solve"}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), _RENAMED.get(name, name))
    raise AttributeError(f"module 'boostjax' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

