"""The checks of a `ModelConfig`'s fields: sizes, heads, ranks, RoPE scaling and special token ids."""

from __future__ import annotations

from boostjax.config.checking import check_types, need
from boostjax.config.fields import flag_of, negated_flag_of
from boostjax.config.model import ModelConfig
from boostjax.config.names import ATTENTION, MAX_SEQ_LEN, MAX_VOCAB, MODEL_KINDS, PROJECTION_GROUPS, ROPE_TYPES


def validate_model(m: ModelConfig) -> None:
    """The model fields; raises `ConfigError` on the first invalid one."""
    need(isinstance(m, ModelConfig), f"model: need a ModelConfig, got {type(m).__name__}; fix: pass ModelConfig(...)")
    check_types(m, "model")
    need(m.kind in MODEL_KINDS, f"model.kind: unknown kind {m.kind!r}; fix: pass {flag_of('kind')} with one of "
                                f"{', '.join(MODEL_KINDS)}")
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "rank", "max_seq_len"):
        v = getattr(m, name)
        need(v > 0, f"model.{name}: must be positive, got {v}; fix: pass {flag_of(name)} N with N >= 1")
    need(m.vocab_size <= MAX_VOCAB, f"model.vocab_size: {m.vocab_size} exceeds {MAX_VOCAB} (uint32 token ids); "
                                    f"fix: pass {flag_of('vocab_size')} <= {MAX_VOCAB}")
    need(m.max_seq_len <= MAX_SEQ_LEN, f"model.max_seq_len: {m.max_seq_len} exceeds {MAX_SEQ_LEN}; "
                                       f"fix: pass {flag_of('max_seq_len')} <= {MAX_SEQ_LEN}")
    need(m.n_kv_heads >= 0, f"model.n_kv_heads: must be >= 0, got {m.n_kv_heads}; fix: pass {flag_of('n_kv_heads')} "
                            "0 (= n_heads) or a divisor of n_heads")
    need(m.attn_head_dim >= 0, f"model.attn_head_dim: must be >= 0 (0 = d_model / n_heads), got {m.attn_head_dim}; "
                               f"fix: pass {flag_of('attn_head_dim')} 0 or an even width")
    need(m.attn_head_dim > 0 or m.d_model % m.n_heads == 0,
         f"model.d_model: {m.d_model} is not divisible by n_heads={m.n_heads}; fix: choose d_model a multiple of "
         f"n_heads, or pass {flag_of('attn_head_dim')}")
    need(m.head_dim % 2 == 0, f"model.{'attn_head_dim' if m.attn_head_dim else 'd_model'}: head_dim={m.head_dim} "
                              f"must be even for RoPE; fix: make the head width ({flag_of('attn_head_dim')}, or "
                              "d_model/n_heads) even")
    need(m.n_heads % m.kv_heads == 0,
         f"model.n_kv_heads: n_heads={m.n_heads} is not divisible by n_kv_heads={m.kv_heads}; fix: pass "
         f"{flag_of('n_kv_heads')} with a divisor of n_heads")
    _validate_ranks(m)
    need(m.rope_theta > 1, f"model.rope_theta: must be > 1 (RoPE's frequencies theta^(-2i/d) must fall), "
                           f"got {m.rope_theta}; fix: pass e.g. {flag_of('rope_theta')} 10000")
    need(0 < m.norm_eps < 1, f"model.norm_eps: must lie in (0, 1), got {m.norm_eps}; fix: pass e.g. "
                             f"{flag_of('norm_eps')} 1e-5")
    need(m.init_std > 0, f"model.init_std: must be positive, got {m.init_std}; fix: pass e.g. "
                         f"{flag_of('init_std')} 0.02")
    need(m.attention in ATTENTION, f"model.attention: unknown attention {m.attention!r}; "
                                   f"fix: pass {flag_of('attention')} with one of {', '.join(ATTENTION)}")
    need(1 <= m.attention_block <= MAX_SEQ_LEN, f"model.attention_block: must lie in [1, {MAX_SEQ_LEN}], got "
                                                f"{m.attention_block}; fix: pass e.g. "
                                                f"{flag_of('attention_block')} 512")
    _validate_rope_scaling(m)
    _validate_token_ids(m)


def _validate_ranks(m: ModelConfig) -> None:
    """Group ranks: overrides >= 0; a factorised group's rank at most min(in, out) (with `auto_dense`
    a group that would exceed it stays dense instead); LaX's crossings need its latents at one width."""
    for g in PROJECTION_GROUPS:
        name = f"rank_{g}"
        v = getattr(m, name)
        need(v >= 0, f"model.{name}: must be >= 0 (0 = {flag_of('rank')}), got {v}; fix: pass {flag_of(name)} N "
                     f"with N >= 1, or drop it")
    if not m.low_rank:
        return
    for g in PROJECTION_GROUPS:
        i, o = m.group_shape(g)
        r, name = m.group_rank(g), f"rank_{g}" if getattr(m, f"rank_{g}") else "rank"
        need(not m.group_low_rank(g) or r <= min(i, o),
             f"model.{name}: r={r} exceeds min(in, out)={min(i, o)} of the {g} projections [{i}, {o}]; fix: pass "
             f"{flag_of(name)} <= {min(i, o)}, or drop {negated_flag_of('auto_dense')} to keep them dense")
    if m.auto_dense and len(m.dense_groups) == len(PROJECTION_GROUPS):
        most = max(PROJECTION_GROUPS, key=lambda g: _break_even(m, g))
        need(False, f"model.rank: at these ranks no projection's factors are smaller than its dense matrix, so "
                    f"every projection would stay dense; fix: pass {flag_of('rank')} below "
                    f"{_break_even(m, most)} (the {most} projections' break-even), or {flag_of('kind')} llama")
    attn, kv = m.group_low_rank("attn"), m.group_low_rank("kv")
    need(m.kind != "lax" or attn == kv and (not attn or m.group_rank("attn") == m.group_rank("kv")),
         f"model.rank_kv: LaX crosses the q, k, v and o latents, so they need one width, but q/o are "
         f"{'rank ' + str(m.group_rank('attn')) if attn else 'dense'} and k/v "
         f"{'rank ' + str(m.group_rank('kv')) if kv else 'dense'}; fix: pass {flag_of('rank_kv')} equal to the "
         f"q/o rank (below k/v's break-even), or --model cola")


def _break_even(m: ModelConfig, group: str) -> int:
    """The smallest rank at which a group's factors hold as many parameters as its dense matrix."""
    i, o = m.group_shape(group)
    return -(-i * o // (i + o))


def _validate_rope_scaling(m: ModelConfig) -> None:
    """RoPE scaling fields: a known type, and factors that type reads."""
    need(m.rope_type in ROPE_TYPES, f"model.rope_type: unknown RoPE type {m.rope_type!r}; "
                                    f"fix: pass {flag_of('rope_type')} with one of {', '.join(ROPE_TYPES)}")
    need(m.rope_factor >= 1, f"model.rope_factor: must be >= 1 (it stretches the context), got {m.rope_factor}; "
                             f"fix: pass e.g. {flag_of('rope_factor')} 8 (1 = no scaling)")
    need(m.rope_type != "default" or m.rope_factor == 1,
         f"model.rope_factor: {m.rope_factor} has no effect with rope_type default; "
         f"fix: pass {flag_of('rope_type')} linear, dynamic or llama3, or drop {flag_of('rope_factor')}")
    need(m.rope_type != "dynamic" or m.head_dim > 2, f"model.rope_type: dynamic NTK scaling needs head_dim > 2, got "
                                                     f"{m.head_dim}; fix: pass {flag_of('rope_type')} linear or a "
                                                     "wider head")
    need(m.rope_original_max_len >= 0, f"model.rope_original_max_len: must be >= 0 (0 = max_seq_len), got "
                                       f"{m.rope_original_max_len}; fix: pass e.g. "
                                       f"{flag_of('rope_original_max_len')} 8192")
    if m.rope_type == "llama3":
        lo, hi = m.rope_low_freq_factor, m.rope_high_freq_factor
        need(0 < lo < hi, f"model.rope_high_freq_factor: llama3 needs 0 < low_freq_factor < high_freq_factor, got "
                          f"{lo} and {hi}; fix: pass e.g. {flag_of('rope_low_freq_factor')} 1 "
                          f"{flag_of('rope_high_freq_factor')} 4")


def _validate_token_ids(m: ModelConfig) -> None:
    """Special token ids: -1 (none) or an id of the vocabulary."""
    for name in ("bos_token_id", "pad_token_id"):
        v = getattr(m, name)
        need(-1 <= v < m.vocab_size, f"model.{name}: {v} is not a token id of the {m.vocab_size}-token vocabulary "
                                     f"(-1 = none); fix: pass {flag_of(name)} in [0, {m.vocab_size}) or -1")
    parts = [x.strip() for x in m.eos_token_ids.split(",")] if m.eos_token_ids.strip() else []
    ok = all(x.isascii() and x.isdigit() and int(x) < m.vocab_size for x in parts)
    flag = flag_of("eos_token_ids")
    need(ok, f"model.eos_token_ids: {m.eos_token_ids!r} is not a comma-separated list of token ids below "
             f"vocab_size={m.vocab_size}; fix: pass e.g. {flag} 2 or {flag} 128001,128009 ('' = none)")
