"""Autoregressive generation with a KV cache: greedy, top-k and nucleus (top-p) sampling.

`generate(model, prompt_tokens, max_new_tokens)` runs the model's own blocks (`LLaMA.features_cached`)
over a fixed-size cache of prompt + new positions, so the shapes are static: one jitted program per
(model, batch, prompt length, new tokens, greedy or not) does the prefill of the whole prompt and then
a `lax.while_loop` of one-token decode steps; temperature, top-k, top-p, seed and eos are traced
values (changing them does not recompile). Every kind (llama, cola, svd, lax; grouped-query heads)
decodes through the same code that trains.

Sampling follows the usual order (Hugging Face's `generate`): logits / temperature, then keep the
`top_k` largest, then the smallest set of the most likely tokens whose probability reaches `top_p`
(nucleus sampling, https://arxiv.org/abs/1904.09751), renormalise and draw with `jax.random`. The
key of step i is `fold_in(key(seed), i)`: a seed gives the same tokens on every run.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jaxtyping import Array, Float, Int

from boostjax.config import ConfigError
from boostjax.models import kvcache


def check_sampling(max_new_tokens: Any, temperature: Any, top_k: Any, top_p: Any, seed: Any) -> None:
    """ConfigError (one line, `generate: ...`) for a sampling setting that cannot work."""
    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ConfigError(f"generate: {msg}")

    def is_int(v: Any) -> bool:
        return isinstance(v, (int, np.integer)) and not isinstance(v, bool)

    def is_num(v: Any) -> bool:
        return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) and math.isfinite(v)

    need(is_int(max_new_tokens) and max_new_tokens >= 1,
         f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}; fix: pass --max-new-tokens N with N >= 1")
    need(is_num(temperature) and temperature >= 0,
         f"temperature must be a finite number >= 0, got {temperature!r}; fix: pass --temperature 0 (greedy) "
         "or e.g. 0.8")
    need(is_int(top_k) and top_k >= 0,
         f"top_k must be an integer >= 0, got {top_k!r}; fix: pass --top-k 0 (no limit) or e.g. 50")
    need(is_num(top_p) and 0 < top_p <= 1,
         f"top_p must lie in (0, 1], got {top_p!r}; fix: pass --top-p 1 (no limit) or e.g. 0.9")
    need(is_int(seed) and 0 <= seed < 1 << 63,
         f"seed must be an integer in [0, 2^63), got {seed!r}; fix: pass --seed N with N >= 0")


def check_prompt(prompt_tokens: Any, max_new_tokens: int, vocab_size: int, max_seq_len: int) -> np.ndarray:
    """The prompt as an int32 `[b, p]` array, or ConfigError: empty, not integers, ids outside the
    vocabulary, or longer than `max_seq_len` once the new tokens are added."""
    try:
        p = np.asarray(prompt_tokens)
    except ValueError:  # a ragged batch
        raise ConfigError("generate: the prompts of a batch must have equal lengths; fix: generate each prompt "
                          "on its own, or pass a [b, t] array") from None
    if p.ndim == 1:
        p = p[None]
    if p.ndim != 2 or p.shape[0] < 1:
        raise ConfigError(f"generate: prompt_tokens must be a 1-D array of ids or a 2-D batch of equal-length "
                          f"prompts, got shape {np.shape(prompt_tokens)}; fix: pass ids shaped [t] or [b, t]")
    if p.shape[1] < 1:
        raise ConfigError("generate: the prompt is empty; fix: pass at least one token (a non-empty --prompt)")
    if not np.issubdtype(p.dtype, np.integer):
        raise ConfigError(f"generate: prompt_tokens must be integer ids, got dtype {p.dtype}; fix: pass the ids "
                          "from the tokenizer's encode")
    if p.min() < 0 or p.max() >= vocab_size:
        raise ConfigError(f"generate: prompt ids must lie in [0, {vocab_size}), got [{p.min()}, {p.max()}]; "
                          "fix: encode the prompt with the run's tokenizer")
    if p.shape[1] + max_new_tokens > max_seq_len:
        raise ConfigError(f"generate: prompt ({p.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                          f"model's max_seq_len={max_seq_len}; fix: pass --max-new-tokens <= "
                          f"{max(max_seq_len - p.shape[1], 0)} or a shorter prompt")
    return p.astype(np.int32)


def sample(logits_bv: Float[Array, "b v"], key, temperature, top_k, top_p) -> Int[Array, " b"]:
    """One token per row: logits / temperature, top-k, then top-p (nucleus), drawn with `key`.
    `top_k = 0` and `top_p = 1` disable those limits; `temperature` must be > 0."""
    v = logits_bv.shape[-1]
    scaled_bv = logits_bv.astype(jnp.float32) / temperature
    order_bv = jnp.argsort(-scaled_bv, axis=-1)  # ranks: most likely first (stable: ties by id)
    sorted_bv = jnp.take_along_axis(scaled_bv, order_bv, axis=-1)
    rank_v = jnp.arange(v)
    keep_bv = (top_k <= 0) | (rank_v < top_k)[None, :]
    sorted_bv = jnp.where(keep_bv, sorted_bv, -jnp.inf)
    # nucleus: keep a token when the probability before it (in rank order) is still below top_p; the
    # most likely token always stays
    p_bv = jax.nn.softmax(sorted_bv, axis=-1)
    before_bv = jnp.cumsum(p_bv, axis=-1) - p_bv
    keep_bv = (before_bv < top_p) | (top_p >= 1.0) | (rank_v == 0)[None, :]
    sorted_bv = jnp.where(keep_bv, sorted_bv, -jnp.inf)
    pick_b = jax.random.categorical(key, sorted_bv, axis=-1)
    return jnp.take_along_axis(order_bv, pick_b[:, None], axis=-1)[:, 0]


def _choose(logits_bv, key, temperature, top_k, top_p, greedy: bool):
    if greedy:
        return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
    return sample(logits_bv, key, temperature, top_k, top_p).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new", "greedy"))
def _generate(graphdef, state, prompt_bp, key, temperature, top_k, top_p, eos_n, *, max_new: int, greedy: bool):
    """Prefill the prompt, then decode `max_new - 1` more tokens in a while loop (stops early when every
    row has produced one of the ids `eos_n`; `[-1]` = no eos). Returns `[b, p + max_new]` ids, a row
    padded with `eos_n[0]` after its eos."""
    model = nnx.merge(graphdef, state)
    b, p = prompt_bp.shape
    cache = kvcache.init_cache(model.cfg, b, p + max_new, model.embed[...].dtype)
    xn_btd, cache = model.features_cached(prompt_bp, cache)
    logits_bv = model.logits(xn_btd[:, -1:])[:, 0]
    tok_b = _choose(logits_bv, jax.random.fold_in(key, 0), temperature, top_k, top_p, greedy)
    pad = jnp.maximum(eos_n[0], 0).astype(jnp.int32)

    def is_eos(tok_b):
        return jnp.any(tok_b[:, None] == eos_n[None, :], axis=-1)

    out_bs = jnp.concatenate([prompt_bp, jnp.full((b, max_new), pad, jnp.int32)], axis=1)
    out_bs = out_bs.at[:, p].set(tok_b)
    done_b = is_eos(tok_b)

    def cond(carry):
        i, _, done_b, _, _ = carry
        return (i < max_new) & ~jnp.all(done_b)

    def body(carry):
        i, tok_b, done_b, cache, out_bs = carry
        xn_btd, cache = model.features_cached(tok_b[:, None], cache)
        new_b = _choose(model.logits(xn_btd)[:, 0], jax.random.fold_in(key, i), temperature, top_k, top_p, greedy)
        new_b = jnp.where(done_b, pad, new_b)
        out_bs = lax.dynamic_update_slice(out_bs, new_b[:, None], (0, p + i))
        return i + 1, new_b, done_b | is_eos(new_b), cache, out_bs

    carry = (jnp.ones((), jnp.int32), tok_b, done_b, cache, out_bs)
    return lax.while_loop(cond, body, carry)[-1]


def generate(model, prompt_tokens, max_new_tokens: int, *, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int = 0, eos_id: int | Sequence[int] | None = None) -> np.ndarray:
    """The prompt followed by `max_new_tokens` generated ids (numpy int32, `[t + n]` for a 1-D prompt,
    `[b, t + n]` for a batch of equal-length prompts).

    `temperature=0` is greedy (argmax); otherwise tokens are sampled from softmax(logits / temperature)
    restricted to the `top_k` most likely (0 = all) and to the nucleus of mass `top_p` (1 = all), with
    `jax.random.key(seed)`. With `eos_id` (an id, or several: Llama 3 ends on any of its eos ids), a row
    stops at its first eos and is padded after it with the (first) eos id.
    Runs on the model's parameters as they are (fp32 unless cast); one compile per shape."""
    cfg = model.cfg
    check_sampling(max_new_tokens, temperature, top_k, top_p, seed)
    eos = [] if eos_id is None else [eos_id] if np.ndim(eos_id) == 0 else list(eos_id)
    if not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) and 0 <= i < cfg.vocab_size for i in eos):
        raise ConfigError(f"generate: eos_id must be None, an id or a list of ids in [0, {cfg.vocab_size}), got "
                          f"{eos_id!r}; fix: pass the tokenizer's eos_id or None")
    prompt_bp = check_prompt(prompt_tokens, max_new_tokens, cfg.vocab_size, cfg.max_seq_len)
    one_d = np.ndim(prompt_tokens) == 1  # (a ragged batch was refused above)
    graphdef, state = nnx.split(model)
    out = _generate(graphdef, state, jnp.asarray(prompt_bp), jax.random.key(seed),
                    jnp.float32(max(temperature, 1e-30)), jnp.int32(min(top_k, cfg.vocab_size)), jnp.float32(top_p),
                    jnp.asarray(eos or [-1], jnp.int32), max_new=int(max_new_tokens),
                    greedy=temperature == 0)
    out = np.asarray(out)
    return out[0] if one_d else out
