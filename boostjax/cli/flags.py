"""Flags made from the configuration dataclasses: one per field, with its type, choices, default and help."""

from __future__ import annotations

import argparse
import typing
from typing import Any
import dataclasses

from boostjax.config import mesh_text


_RENAMED = {"kind": "model"}  # config field -> flag name where they differ


_HELP = {
    "kind": "model kind: dense LLaMA or a low-rank variant (default with --init-from-hf: llama)",
    "n_kv_heads": "key/value heads for grouped-query attention (0 = n_heads)",
    "rank": "rank r of every low-rank projection",
    "only_lr_act": "cola/lax MLP hidden = gate * up, SiLU only inside the factor pairs (CoLA's published form); "
                   "--no-only-lr-act: silu(gate) * up (runs of boostjax before issue 15)",
    "attention": "attention kernel: auto (cudnn on a CUDA GPU in bf16, else chunked), xla (materialised scores), "
                 "cudnn (cuDNN flash attention), chunked (blockwise, no t x t buffer)",
    "attention_block": "query/key positions per tile of the chunked attention",
    "dtype": "compute dtype (parameters stay fp32)",
    "data": "corpus: '' = this Python's standard library sources; a folder written by boostjax tokenize (its "
            "meta.json gives the dtype and, without --vocab-size, the vocabulary), a .bin token file, a text file "
            "or a folder of text files",
    "strategy": "tensor-parallel strategy",
    "mesh": "device mesh, e.g. data=2,stage=2,model=4 ('' = one device; CPU devices are simulated as needed)",
    "microbatches": "pipeline micro-batches per data shard when the mesh has stage > 1 (0 = auto: the largest "
                    "divisor of the shard's batch that is <= 4 x stages)",
    "pipeline_schedule": "pipeline schedule when the mesh has stage > 1: gpipe (all forwards, then all backwards; "
                         "activations of every micro-batch) or 1f1b (one forward, one backward; activations of "
                         "2 x stages - 1 micro-batches); the same bubble (P-1)/(M+P-1)",
    "grad_accum": "micro-batches of --batch rows per optimizer step (a lax.scan sums their gradients); the "
                  "effective batch is batch x grad_accum",
    "zero": "data-parallel state sharding (ZeRO): 0 replicated, 1 optimizer state split over data, 3 parameters too",
    "remat": "rematerialisation: none, full (per block), lowrank (keep r-dim latents, no collective recomputed)",
    "out": "run folder (config.json, metrics.jsonl, checkpoints/); an existing run there is resumed",
    "offload_plan": "plan.json from boostjax plan: per-layer remat/offload policies, host-resident params/optimizer",
    "coordinator": "multi-host: HOST:PORT of process 0 ('' = from BOOSTJAX_COORDINATOR or SLURM/Open MPI)",
    "num_processes": "multi-host: processes in the job (0 = from the environment; 1 = one process)",
    "process_id": "multi-host: this process's index, 0..num_processes-1 (-1 = from the environment)",
    "init_timeout": "multi-host: seconds to wait for every process of the job to join before giving up",
    # item 3 (Hugging Face interop)
    "rope_type": "RoPE scaling: default (none), linear (positions / factor), dynamic (NTK: larger base beyond "
                 "max_seq_len), llama3 (Llama 3.1 frequency bands)",
    "rope_factor": "RoPE scaling factor of linear / dynamic / llama3 (1 = none)",
    "rope_low_freq_factor": "llama3 RoPE: wavelengths above original_max_len / this are divided by the factor",
    "rope_high_freq_factor": "llama3 RoPE: wavelengths below original_max_len / this are kept",
    "rope_original_max_len": "llama3 RoPE: the pretraining context (original_max_position_embeddings; 0 = max_seq_len)",
    "attn_head_dim": "width of one attention head (0 = d_model / n_heads)",
    "tie_embeddings": "the LM head is the embedding transposed (no separate head parameter; no TP or pipeline)",
    "bos_token_id": "beginning-of-sequence token id written to exports (-1 = none)",
    "eos_token_ids": "end-of-sequence token id(s), comma-separated, written to exports and used by generation",
    "pad_token_id": "padding token id written to exports (-1 = none)",
    "tensorboard": "write TensorBoard event files (the metrics.jsonl scalars) into OUT/tensorboard/",
    "profile": "START:STOP: a jax.profiler trace of steps START..STOP-1 (0-based) into OUT/profile/ ('' = none)",
    "hardware": "hardware profile for the MFU metric (peak BF16 FLOP/s per device), e.g. H800-80GB, A100-80GB, "
                "RTX3090-24GB; '' = detect from the device (none on a CPU)",
    "doc_mask": "mask attention at document boundaries: batches of packed documents carry a document id per "
                "token, and a token attends only to its own document (needs data with documents: the "
                "built-in corpus, a folder or a tokenised folder)",
    "rot_order": "rotation: 'previous' projects G_t on bases built from earlier gradients (SOAP); 'current' updates "
                 "the Gram EMA with G_t, refreshes if due (step 1, every rot_refresh steps), then projects (the "
                 "basis-rotation reference code)",
    "init_from_hf": "start a new run from a Hugging Face LLaMA folder (its shapes; --model svd/cola/lax --rank r "
                    "factors each projection by truncated SVD; init_report.json holds the errors)",
}


def add_fields(parser: argparse.ArgumentParser, cls: type, title: str) -> None:
    """One flag per field of the config dataclass `cls` (`--d-model`, `--lr`, ...), in a group `title`: a bool
    is --x/--no-x, a `Literal` offers its values as choices, the mesh is text (TrainConfig parses it, once)."""
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + _RENAMED.get(f.name, f.name).replace("_", "-")
        kind = hints[f.name]
        kw: dict[str, Any] = {"dest": f.name, "default": None, "help": _HELP.get(f.name, "")}
        if kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kind) is typing.Literal:
            kw["choices"] = typing.get_args(kind)
            kw["type"] = type(kw["choices"][0])
        else:
            kw["type"] = kind if kind in (int, float) else str
        default = mesh_text(f.default) if f.name == "mesh" else f.default
        kw["help"] = (kw["help"] + f" (default: {default!r})").strip()
        group.add_argument(flag, **kw)
