"""One transformer block as the compiled step sees it: a small DAG of tensors (per token: compute-dtype
elements, fp32 elements, forward FLOPs) written from `boostjax.models.llama` / `ops`, and what
remat costs with it.

`block_graph` lists what each op's VJP reads and the companions the compiled step keeps beside
them (`sigmoid(z)` next to `silu(z)`, `rotate_half(q)`, the fp32 softmax probabilities). The named
tensors are the model's `checkpoint_name` tags. For a set S of tensors saved in the forward pass, the
backward reads the tensors of `_bwd_needs`; anything needed and not saved is recomputed from its
inputs (recursively, down to the saved tensors and the block input `boundary`): `recompute_cost`
gives each inner option (which names a layer saves) its recompute FLOPs and saved bytes; the option
`all` (no remat) keeps every tensor the backward reads with its companions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from typing import Mapping

from boostjax.config import ATTENTION_MEMORY, PROJECTION_GROUPS, ModelConfig

ALL = "all"  # inner option: no remat for the layer (every tensor the backward needs is kept)
BOUNDARY = "boundary"  # inner option: keep only the block input, recompute the whole block


@dataclass(frozen=True)
class _Node:
    """One tensor of the block. `width`: elements per token of the output in the compute dtype;
    `fp32`: further fp32 elements per token that travel with it (norm statistics, softmax
    probabilities); `extra`: compute-dtype elements per token that the node's VJP keeps beside its
    output when the block runs without remat (e.g. `sigmoid(z)` next to `silu(z)`)."""

    width: int
    flops: float  # forward FLOPs per token
    inputs: tuple[str, ...]
    named: bool  # tagged with checkpoint_name in the model
    extra: int = 0
    fp32: int = 0


ATTENTION = ATTENTION_MEMORY  # ("materialized", "flash"), named once in boostjax.config


def block_graph(cfg: ModelConfig, seq: int, attention: str = "materialized",
                lowrank: Mapping[str, bool] | None = None) -> dict[str, _Node]:
    """The tensors of one block as `boostjax.models.llama` computes them (insertion order = forward
    order), keyed by name; `boundary` = input. Derived from the model code, per token:

    - norms: `rms_norm` output `xn` (dense) or `x ⊙ g` (low-rank Online-RMSNorm), the GEMM's input,
      plus one fp32 statistic; the latents keep their fp32 `*_stats` ([b, t, 1]).
    - SiLU (`jax.nn.silu` = `z · sigmoid(z)`): its VJP keeps `sigmoid(z)` beside `z` and the
      output (`extra`); SVD-style blocks have no nonlinearity.
    - RoPE: XLA keeps the q projection and `rotate_half(q)` (the roped q is re-formed inside the
      backward's fusion) and the roped k: q, k, v plus one more q-sized copy.
    - attention (`ops.causal_attention`): the fp32 softmax probabilities `[b, h, t, t]` (h·t per
      token) with `attention="materialized"` (the model code); `"flash"` keeps only the fp32
      log-sum-exp (h per token), for instances that assume a fused attention kernel.
    - gated MLP (`llama.mlp_hidden`): gate and up (2f) and the product (f); SwiGLU (`silu(gate) * up`:
      dense, svd, or `only_lr_act=False`) also `sigmoid(gate)` and `silu(gate)` (2f); CoLA's
      `gate * up` one more f-wide buffer (measured, not derived: the compiled no-remat step of the
      tiny CoLA model keeps one f-wide tensor per layer beside gate, up and the product).
    - LaX: the five latent crossing sums (`hk + c·hq`, ...) beside the SiLU outputs they mix.
    """
    if attention not in ATTENTION:
        raise ValueError(f"attention: {attention!r}; fix: one of {ATTENTION}")
    d, f, hd = cfg.d_model, cfg.d_ff, cfg.head_dim
    r, rkv, rm = (cfg.group_rank(g) for g in ("attn", "kv", "mlp"))  # q/o, k/v, MLP ranks
    hq, hkv = cfg.n_heads * hd, cfg.kv_heads * hd
    attn_flops = 2.0 * seq * cfg.n_heads * hd  # QKᵀ and PV, halved for the causal mask
    probs = cfg.n_heads * (seq if attention == "materialized" else 1)
    silu = 0 if cfg.kind == "svd" else 1  # SiLU between the factors (CoLA, LaX); none for SVD
    lax = int(cfg.kind == "lax")  # LaX's crossing sums `h + c·h'` are GEMM inputs beside the SiLU outputs
    lr = decisions(cfg) if lowrank is None else dict(lowrank)
    lq, lkv, lm = (lr[k] for k in ("attn", "kv", "mlp"))
    # in a low-rank kind every input side is an Online-RMSNorm product (`ops.online_norm_many`): the
    # latents of the factorised groups and the full outputs of the dense ones, tagged `*_latent`
    wq, wkv = (r if lq else hq), (rkv if lkv else hkv)  # per-token width of q's / k's part of qkv_latent
    acts = (r if lq else 0) + (2 * rkv if lkv else 0)  # latents that go through σ
    g: dict[str, _Node] = {"boundary": _Node(d, 0.0, (), True)}
    if cfg.low_rank:
        g["n1"] = _Node(d, 0.0, ("boundary",), False)
        g["qkv_latent"] = _Node(wq + 2 * wkv, 2.0 * d * (wq + 2 * wkv), ("n1",), True, fp32=1)
        up = 2.0 * ((r * hq if lq else 0) + (rkv * 2 * hkv if lkv else 0))
        if acts:
            g["qkv_act"] = _Node(acts, 0.0, ("qkv_latent",), False, extra=acts * silu + 2 * r * lax)
        g["qkv"] = _Node(hq + 2 * hkv, up, ("qkv_act" if acts else "qkv_latent",), False, extra=hq)
    else:
        g["n1"] = _Node(d, 0.0, ("boundary",), False, fp32=1)
        g["qkv"] = _Node(hq + 2 * hkv, 2.0 * d * (hq + 2 * hkv), ("n1",), True, extra=hq)
    g["attn_probs"] = _Node(0, attn_flops / 2, ("qkv",), False, fp32=probs)
    g["attn_out"] = _Node(hq, attn_flops / 2, ("qkv", "attn_probs"), True)
    if cfg.low_rank and lq:
        g["o_latent"] = _Node(r, 2.0 * hq * r, ("attn_out",), True)
        g["o_act"] = _Node(r * silu, 0.0, ("o_latent",), False, extra=r * silu + r * lax)
        g["mid"] = _Node(d, 2.0 * r * d, ("boundary", "o_act"), True)
    else:
        g["mid"] = _Node(d, 2.0 * hq * d, ("boundary", "attn_out"), True)
    if cfg.low_rank and lm:
        g["n2"] = _Node(d, 0.0, ("mid",), False)
        g["gate_up_latent"] = _Node(2 * rm, 2.0 * d * 2 * rm, ("n2",), True, fp32=1)
        g["gate_up_act"] = _Node(2 * rm, 0.0, ("gate_up_latent",), False, extra=2 * rm * silu + rm * lax)
        g["gate_up"] = _Node(2 * f, 2.0 * rm * 2 * f, ("gate_up_act",), False)
    elif cfg.low_rank:  # a dense MLP in a low-rank kind: gate/up are the Online-RMSNorm product itself
        g["n2"] = _Node(d, 0.0, ("mid",), False)
        g["gate_up_latent"] = _Node(2 * f, 2.0 * d * 2 * f, ("n2",), True, fp32=1)
    else:
        g["n2"] = _Node(d, 0.0, ("mid",), False, fp32=1)
        g["gate_up"] = _Node(2 * f, 2.0 * d * 2 * f, ("n2",), True)
    g["mlp_hidden"] = _Node(f, 0.0, ("gate_up" if "gate_up" in g else "gate_up_latent",), True,
                            extra=2 * f if cfg.gated_silu else f)
    if cfg.low_rank and lm:
        g["down_latent"] = _Node(rm, 2.0 * f * rm, ("mlp_hidden",), True)
        g["down_act"] = _Node(rm * silu, 0.0, ("down_latent",), False, extra=rm * silu + rm * lax)
        g["out"] = _Node(d, 2.0 * rm * d, ("mid", "down_act"), False)
    else:
        g["out"] = _Node(d, 2.0 * f * d, ("mid", "mlp_hidden"), False)
    return g


def decisions(cfg: ModelConfig) -> dict[str, bool]:
    """Which projection groups of `cfg` are factorised (`ModelConfig.group_low_rank`), by group."""
    return {g: cfg.group_low_rank(g) for g in PROJECTION_GROUPS}


def _bwd_needs(g: dict[str, _Node]) -> tuple[str, ...]:
    """Tensors whose values some VJP of the block reads: every GEMM/norm/nonlinearity input."""
    needs: list[str] = []
    for name, node in g.items():
        if name == "boundary":
            continue
        for inp in node.inputs:
            if inp not in needs:
                needs.append(inp)
    # attention's VJP (flash style) also reads its own output
    if "attn_out" not in needs:
        needs.append("attn_out")
    return tuple(n for n in g if n in needs and n != "boundary")


def activation_names(cfg: ModelConfig, lowrank: Mapping[str, bool] | None = None) -> tuple[str, ...]:
    """The `checkpoint_name` tags inside one block of this model kind (and these factorised groups)."""
    return tuple(n for n, node in block_graph(cfg, 1, lowrank=lowrank).items() if node.named)


def default_inner_options(cfg: ModelConfig, lowrank: Mapping[str, bool] | None = None) -> dict[str, tuple[str, ...]]:
    """Inner-option menu: option name -> named tensors saved on device (besides the boundary)."""
    if cfg.low_rank:
        names = activation_names(cfg, lowrank)
        lat = tuple(n for n in ("qkv_latent", "o_latent", "gate_up_latent", "down_latent") if n in names)
        return {ALL: (), "latents_attn": lat + ("attn_out", "mid"), "latents": lat, BOUNDARY: ()}
    return {ALL: (), "attn": ("qkv", "attn_out"), "attn_out": ("attn_out",), BOUNDARY: ()}


def _saved_bytes(node: _Node, dtype_bytes: int) -> float:
    """Bytes per token of a saved tensor (its output and the fp32 statistics saved with it)."""
    return float(node.width * dtype_bytes + 4 * node.fp32)


def _kept_bytes(node: _Node, dtype_bytes: int) -> float:
    """Bytes per token a no-remat block keeps for this tensor's VJP (output, companions, fp32 parts)."""
    return float((node.width + node.extra) * dtype_bytes + 4 * node.fp32)


def recompute_cost(cfg: ModelConfig, seq: int, saved: Iterable[str] | None, dtype_bytes: int = 2,
                   attention: str = "materialized", lowrank: Mapping[str, bool] | None = None) -> tuple[float, float]:
    """(recomputed FLOPs per token, saved bytes per token) when the block saves `saved`
    (None = no remat: everything the backward reads is kept, companions included)."""
    g = block_graph(cfg, seq, attention, lowrank)
    needs = _bwd_needs(g)
    if saved is None:
        return 0.0, sum(_kept_bytes(g[n], dtype_bytes) for n in needs)
    saved_set = set(saved)
    unknown = saved_set - set(g)
    if unknown:
        raise ValueError(f"saved: unknown tensor names {sorted(unknown)}; fix: use names from {list(g)}")
    todo, redo = list(needs), set()
    while todo:
        n = todo.pop()
        if n in saved_set or n == "boundary" or n in redo:
            continue
        redo.add(n)
        todo.extend(g[n].inputs)
    return float(sum(g[n].flops for n in redo)), sum(_saved_bytes(g[n], dtype_bytes) for n in saved_set - {"boundary"})


__all__ = ["ALL", "ATTENTION", "BOUNDARY", "activation_names", "block_graph", "decisions", "default_inner_options",
           "recompute_cost"]
