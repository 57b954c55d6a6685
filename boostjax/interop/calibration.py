"""What each projection of a dense LLaMA reads, on real tokens: the Gram matrices that activation-aware
factoring needs (`boostjax.interop.pretrained`, `--init-factor whitened`) and the output error of a
factored projection on held-out inputs.

The inputs are the model's own tagged activations (`checkpoint_name` in `boostjax.models.llama`), not a
second forward written here: `tagged` traces a function with `jax.make_jaxpr` and evaluates the jaxpr
equation by equation, keeping what each `name` equation (checkpoint_name's primitive) holds. Under
`jax.jit` that evaluation is traced again, so the whole pass (forward, Gram matrices or errors) is one
compiled program and no activation leaves the device. Per layer (the tags come once per block, in order):

    input     read by          the tag and what is applied to it
    qkv       q, k, v          rms_norm(boundary, attn.norm)      (boundary: the block input)
    o         o                attn_out                           (attention="xla": the plain path tags it)
    gate_up   gate, up         rms_norm(mid, mlp.norm)            (mid: after the attention residual)
    down      down             mlp_hidden

Token rows: a flat stream is cut into rows of `seq` tokens (the last one shorter when `seq` does not
divide it), run `ROW_TOKENS` tokens at a time; the Gram matrices are summed over all rows in float64.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Literal
from jaxtyping import Array, Float

from boostjax.config import ModelConfig
from boostjax.interop.hf import build_model
from boostjax.models import ops

# projection (report name) -> the input it reads
INPUT_OF: dict[str, str] = {"q": "qkv", "k": "qkv", "v": "qkv", "o": "o", "gate": "gate_up", "up": "gate_up",
                            "down": "down"}
# input -> (its tag, the block whose pre-norm is applied to it, or None)
INPUTS: dict[str, tuple[str, str | None]] = {"qkv": ("boundary", "attn"), "o": ("attn_out", None),
                                             "gate_up": ("mid", "mlp"), "down": ("mlp_hidden", None)}
ROW_TOKENS = 4096  # tokens per compiled call (whole rows; at least one)
_CALLS = ("jit", "pjit", "closed_call", "core_call")  # call primitives whose body may hold tags


# ------------------------------------------------------------------------------------ tagged values


def _eval(jaxpr: Any, consts: list, args: list, names: frozenset[str], seen: dict[str, list]) -> list:
    env: dict[Any, Any] = {}
    read = lambda v: v.val if isinstance(v, Literal) else env[v]  # noqa: E731
    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        body = eqn.params.get("jaxpr")
        if eqn.primitive.name in _CALLS and isinstance(body, ClosedJaxpr):
            outs = _eval(body.jaxpr, body.consts, ins, names, seen)
        else:
            bind = eqn.primitive.get_bind_params(eqn.params)  # (subfuns, params) before JAX 0.7
            subfuns, params = bind if isinstance(bind, tuple) else ((), bind)
            outs = eqn.primitive.bind(*subfuns, *ins, **params)
            outs = outs if eqn.primitive.multiple_results else [outs]
        if eqn.primitive.name == "name" and eqn.params["name"] in names:
            seen.setdefault(eqn.params["name"], []).append(outs[0])
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def tagged(fn: Callable[..., Any], names: tuple[str, ...]) -> Callable[..., dict[str, list[Array]]]:
    """`fn`'s activations tagged with `checkpoint_name`: `tagged(fn, names)(*args)` -> {name: the values
    of that tag in the order the forward computed them} (one per layer for a block's tag). Works eagerly
    and under `jax.jit` (then only what the caller keeps is computed); tags inside `scan`/`while` bodies
    are not reached."""

    def run(*args: Any) -> dict[str, list[Array]]:
        closed = jax.make_jaxpr(fn)(*args)
        seen: dict[str, list] = {}
        _eval(closed.jaxpr, closed.consts, jax.tree.leaves(args), frozenset(names), seen)
        return seen

    return run


def _layer(params: Mapping[str, Any], i: int) -> Mapping[str, Any]:
    layers = params["layers"]
    return layers[i] if i in layers else layers[str(i)]


def projection_inputs(cfg: ModelConfig, params: Mapping[str, Any], tokens_bt: Array
                      ) -> dict[tuple[int, str], Float[Array, "n i"]]:
    """{(layer, input): X [b*t, in]}: what every projection of the dense model (`cfg`'s shapes, pure
    params dict `params`) reads on `tokens_bt` (see the module docstring for the inputs)."""
    m = dataclasses.replace(cfg, kind="llama", attention="xla")
    tags = tagged(lambda p, t: build_model(m, p).features(t), tuple(tag for tag, _ in INPUTS.values()))
    seen = tags(params, tokens_bt)
    out = {}
    for name, (tag, norm) in INPUTS.items():
        for i, x in enumerate(seen[tag]):
            x = x if norm is None else ops.rms_norm(x, _layer(params, i)[norm]["norm"], m.norm_eps)
            out[i, name] = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    return out


HIGHEST = jax.lax.Precision.HIGHEST


@functools.partial(jax.jit, static_argnums=0)
def _grams(cfg: ModelConfig, params: Any, tokens_bt: Array) -> dict[str, Array]:
    xs = projection_inputs(cfg, params, tokens_bt)
    return {f"{i}.{name}": jnp.einsum("ni,nj->ij", x, x, precision=HIGHEST) for (i, name), x in xs.items()}


def _sigma(kind: str) -> Callable[[Array], Array]:
    return (lambda h: h) if kind == "svd" else jax.nn.silu


@functools.partial(jax.jit, static_argnums=(0, 1))
def _error_sums(cfg: ModelConfig, kind: str, params: Any, tokens_bt: Array,
                factors: Mapping[str, tuple[Array, Array, Array]]) -> dict[str, Array]:
    xs = projection_inputs(cfg, params, tokens_bt)
    out = {}
    for name, (w_io, a_ir, b_ro) in factors.items():
        _, i, _, short = name.split(".")
        x = xs[int(i), INPUT_OF[short]]
        y = jnp.dot(x, w_io, precision=HIGHEST)
        f = jnp.dot(_sigma(kind)(jnp.dot(x, a_ir, precision=HIGHEST)), b_ro, precision=HIGHEST)
        out[name] = jnp.stack([jnp.sum(jnp.square(y - f)), jnp.sum(jnp.square(y))])
    return out


def token_rows(tokens: np.ndarray, seq: int) -> Iterator[np.ndarray]:
    """The stream `tokens` as int32 batches of rows of `seq` tokens (`ROW_TOKENS` tokens a batch; the
    last row shorter when `seq` does not divide the stream: every token is read once)."""
    tokens = np.asarray(tokens)
    whole = len(tokens) // seq * seq
    rows = max(1, ROW_TOKENS // seq)
    for start in range(0, whole, rows * seq):
        yield tokens[start:min(start + rows * seq, whole)].astype(np.int32).reshape(-1, seq)
    if whole < len(tokens):
        yield tokens[whole:].astype(np.int32)[None]


def row_batches(n_tokens: int, seq: int) -> int:
    """How many batches `token_rows` cuts a stream of `n_tokens` into (the count of a progress bar)."""
    whole = n_tokens // seq * seq
    rows = max(1, ROW_TOKENS // seq)
    return -(-whole // (rows * seq)) + (whole < n_tokens)


def input_grams(cfg: ModelConfig, params: Mapping[str, Any], tokens: np.ndarray, seq: int,
                done: Callable[[], None] = lambda: None) -> dict[tuple[int, str], np.ndarray]:
    """{(layer, input): Xᵀ X / n} in float64 over the 1-D token stream `tokens` (rows of `seq`): the
    mean Gram matrix of every projection input of the dense model (fp32 per batch, summed in float64).
    `done()` is called after each batch of `token_rows` (a progress bar of `row_batches`)."""
    total: dict[str, np.ndarray] = {}
    for rows in token_rows(tokens, seq):
        for k, g in jax.device_get(_grams(cfg, params, jnp.asarray(rows))).items():
            total[k] = total.get(k, 0.0) + np.asarray(g, np.float64)
        done()
    n = len(tokens)
    return {(int(k.split(".")[0]), k.split(".")[1]): g / n for k, g in total.items()}


def output_errors(cfg: ModelConfig, kind: str, params: Mapping[str, Any], tokens: np.ndarray, seq: int,
                  factors: Mapping[str, tuple[np.ndarray, np.ndarray]], done: Callable[[], None] = lambda: None
                  ) -> dict[str, float]:
    """{"layers.i.attn.q": ‖X W − f(X)‖_F / ‖X W‖_F, ...} on the 1-D token stream `tokens` (rows of
    `seq`), X the dense model's input of that projection, W its dense weight and `f` what the factored
    projection computes: `X A B` for svd, `silu(X A) B` for cola/lax (the real map, not its linear
    part). `factors`: {name: (A, B)} of the factored matrices (a name absent: not reported). `done()`:
    after each batch, as in `input_grams`."""
    blocks = {"q": "attn", "k": "attn", "v": "attn", "o": "attn", "gate": "mlp", "up": "mlp", "down": "mlp"}
    with_w = {}
    for name, (a, b) in factors.items():
        _, i, _, short = name.split(".")
        w = _layer(params, int(i))[blocks[short]][f"w_{short}"]
        with_w[name] = tuple(jnp.asarray(x, jnp.float32) for x in (w, a, b))
    sums: dict[str, np.ndarray] = {}
    for rows in token_rows(tokens, seq):
        for k, s in jax.device_get(_error_sums(cfg, kind, params, jnp.asarray(rows), with_w)).items():
            sums[k] = sums.get(k, 0.0) + np.asarray(s, np.float64)
        done()
    return {k: float(np.sqrt(e / ref)) if ref > 0 else 0.0 for k, (e, ref) in ((k, sums[k]) for k in factors)}


# ------------------------------------------------------------------------------------ whitening


RIDGE = 1e-6  # the whitening's Gram gets RIDGE * mean(diag G) * I (x10 until the Cholesky succeeds)


def whitening(gram_ii: Any) -> np.ndarray:
    """Lower-triangular S with S Sᵀ = G + λ I (float64), λ = RIDGE · mean(diag G), raised tenfold until
    the Cholesky factorisation succeeds: channels the calibration never excited cannot blow up S⁻ᵀ."""
    g = np.asarray(gram_ii, np.float64)
    g = (g + g.T) / 2
    scale = float(np.mean(np.diag(g))) or 1.0
    for k in range(12):
        try:
            return np.linalg.cholesky(g + RIDGE * 10**k * scale * np.eye(len(g)))
        except np.linalg.LinAlgError:
            continue
    raise ValueError("whitening: the calibration Gram matrix is not finite; fix: check the checkpoint's weights")
