"""Sharding from logical axes: the rule sets give the expected specs, undeclared axes fail loudly,
the rotation mask comes from the declaration, and the strategy names live in one registry."""

from dataclasses import replace
from typing import get_args

import jax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from boostjax import config
from boostjax.config import ModelConfig
from boostjax.models.collectives import Collectives
from boostjax.models import llama
from boostjax.models.llama import LLaMA
from boostjax.sharding import rules

M = "model"
TINY = ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, rank=8, vocab_size=64)

# literal specs of one layer and the top-level parameters (the spec table before the logical axes)
TOP = {"embed": P(), "norm": P(), "head": P(None, M)}
EXPECTED = {
    ("fullrank-tp", "llama"): {
        **TOP, "attn/norm": P(), "attn/w_q": P(None, M), "attn/w_k": P(None, M), "attn/w_v": P(None, M),
        "attn/w_o": P(M, None), "mlp/norm": P(), "mlp/w_gate": P(None, M), "mlp/w_up": P(None, M),
        "mlp/w_down": P(M, None)},
    ("vanilla-tp", "lax"): {
        **TOP, "attn/norm": P(), "attn/a_qkv": P(None, None, M), "attn/b_q": P(M, None), "attn/b_kv": P(None, M, None),
        "attn/a_o": P(None, M), "attn/b_o": P(M, None), "attn/cross": P(), "mlp/norm": P(),
        "mlp/a_gate_up": P(None, None, M), "mlp/b_gate_up": P(None, M, None), "mlp/a_down": P(None, M),
        "mlp/b_down": P(M, None), "mlp/cross": P()},
    ("btp", "lax"): {
        **TOP, "embed": P(None, M), "attn/norm": P(M), "attn/a_qkv": P(M, None, None), "attn/b_q": P(None, M),
        "attn/b_kv": P(None, None, M), "attn/a_o": P(M, None), "attn/b_o": P(None, M), "attn/cross": P(),
        "mlp/norm": P(M), "mlp/a_gate_up": P(M, None, None), "mlp/b_gate_up": P(None, None, M),
        "mlp/a_down": P(M, None), "mlp/b_down": P(None, M), "mlp/cross": P()},
}


def _is_p(x):
    return isinstance(x, P)


def _one_layer(specs):
    """{"embed": .., "attn/a_qkv": ..} from the top level and layer 0 (every layer has layer 0's specs)."""
    layers = specs["layers"]
    assert all(layers[i] == layers[0] for i in layers)
    tree = {**{k: v for k, v in specs.items() if k != "layers"}, **layers[0]}
    return {"/".join(str(k.key) for k in path): v
            for path, v in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_p)[0]}


@pytest.mark.parametrize("strategy,kind", list(EXPECTED))
def test_specs_equal_the_expected_table(strategy, kind):
    cfg = replace(TINY, kind=kind)
    axes = rules.logical_axes(cfg)
    params = nnx.state(nnx.eval_shape(lambda: LLaMA(cfg, rngs=nnx.Rngs(0))), nnx.Param).to_pure_dict()
    assert jax.tree.structure(axes, is_leaf=rules._is_axes) == jax.tree.structure(params)
    got = _one_layer(rules.param_specs(strategy, axes))
    assert got == EXPECTED[strategy, kind]
    assert {k: repr(v) for k, v in got.items()} == {k: repr(v) for k, v in EXPECTED[strategy, kind].items()}
    # cola/svd are lax without the gates; the "none" strategy replicates everything
    if kind == "lax":
        cola = _one_layer(rules.param_specs(strategy, rules.logical_axes(replace(cfg, kind="cola"))))
        assert cola == {k: v for k, v in got.items() if not k.endswith("cross")}
    none = jax.tree.leaves(rules.param_specs("none", axes), is_leaf=_is_p)
    assert set(none) == {P()}


def test_tied_embeddings_and_head_dim_and_stacked_layers():
    tied = rules.logical_axes(replace(TINY, kind="cola", tie_embeddings=True, attn_head_dim=16))
    assert "head" not in tied and tied["embed"] == ("embed_vocab", "embed")
    assert tied["layers"][0]["attn"]["b_q"] == ("rank", "heads")
    stacked = rules.stack_axes(rules.logical_axes(replace(TINY, kind="lax")))
    assert stacked["layers"]["attn"]["a_qkv"] == ("layers", "embed", "group", "rank")
    specs = rules.param_specs("btp", stacked)
    assert specs["layers"]["attn"]["a_qkv"] == P("stage", M, None, None)
    assert specs["layers"]["attn"]["cross"] == P("stage")  # the stage axis, then the layer's P()
    assert specs["embed"] == P(None, M) and specs["head"] == P(None, M)


def test_undeclared_axis_and_unknown_strategy_raise_naming_the_path():
    axes = rules.logical_axes(replace(TINY, kind="cola"))
    with pytest.raises(ValueError, match=r"layers/0/attn/a_o: logical axis 'rank' has no rule in strategy 'fullrank-tp'"):
        rules.param_specs("fullrank-tp", axes)
    with pytest.raises(ValueError, match="layers/0/mlp/w_x: logical axis 'experts'"):
        rules.param_specs("btp", {"layers": {0: {"mlp": {"w_x": ("embed", "experts")}}}})
    with pytest.raises(ValueError, match="unknown strategy"):
        rules.param_specs("tp", axes)


def test_a_parameter_without_declared_axes_is_an_error(monkeypatch):
    class Bare(nnx.Module):
        def __init__(self, cfg, *, rngs):
            self.w = nnx.Param(jax.numpy.zeros((2, 3)))

    # the axes are read from the model (`param_axes`, cached per config): trace `Bare` in its place
    monkeypatch.setattr(llama, "LLaMA", Bare)
    llama._one_layer.cache_clear()
    llama._param_facts.cache_clear()
    try:
        with pytest.raises(ValueError, match="w: a parameter of shape .2, 3. declares logical axes None"):
            rules.logical_axes(TINY)
    finally:
        llama._one_layer.cache_clear()
        llama._param_facts.cache_clear()


def test_rotation_mask_from_the_declaration():
    axes = rules.logical_axes(replace(TINY, kind="lax"))
    mask = rules.rotation_mask(axes)
    assert mask["embed"] is False and mask["head"] is False and mask["norm"] is False
    layer = mask["layers"][1]
    assert layer["attn"]["a_qkv"] == (1,) and layer["attn"]["b_kv"] == (0,) and layer["mlp"]["b_gate_up"] == (0,)
    assert layer["attn"]["b_q"] == () and layer["mlp"]["a_down"] == ()
    assert layer["attn"]["norm"] is False and layer["attn"]["cross"] is False
    stacked = rules.rotation_mask(rules.stack_axes(axes))
    assert stacked["layers"]["attn"]["a_qkv"] == (0, 2) and stacked["layers"]["mlp"]["b_gate_up"] == (0, 1)
    assert stacked["layers"]["attn"]["b_q"] == (0,) and stacked["layers"]["mlp"]["norm"] is False
    assert stacked["embed"] is False and stacked["head"] is False
    dense = rules.rotation_mask(rules.logical_axes(replace(TINY, kind="llama")))
    assert dense["layers"][0]["attn"]["w_q"] == () and dense["layers"][0]["mlp"]["w_down"] == ()


def test_one_strategy_registry():
    names = get_args(config.STRATEGIES) or config.STRATEGIES  # a Literal or a tuple of names
    assert tuple(names) == tuple(rules.STRATEGIES)
    assert rules.TP_STRATEGIES == tuple(s for s in rules.STRATEGIES if s != "none")
    assert {k: s.collectives.psum_at for k, s in rules.STRATEGIES.items()} == {
        "none": "none", "fullrank-tp": "row", "vanilla-tp": "up", "btp": "latent"}
    assert [k for k, s in rules.STRATEGIES.items() if s.collectives.features_sharded] == ["btp"]
    served = {k for s in rules.STRATEGIES.values() for k in s.kinds}
    assert served == set(config.MODEL_KINDS)
    assert rules.split_sizes("btp", TINY) == {"d_model": 32, "n_heads": 4, "n_kv_heads": 2, "d_ff": 64,
                                              "vocab_size": 64}
    assert rules.split_sizes("vanilla-tp", TINY) == {"rank": 8, "vocab_size": 64}
    with pytest.raises(ValueError, match="psum_at"):
        Collectives("model", "everywhere")
    from boostjax.analysis import comm  # the TP strategies the comm/memory tools compare

    assert comm.STRATEGIES == rules.TP_STRATEGIES
