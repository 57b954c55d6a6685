"""Pipeline delay emulation against an explicit list-of-versions reference, stage assignment,
and the delay baselines (PipeDream-LR scaling, Nesterov, stage-aware refresh); names, clipping
and the registry are in test_optimizers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from boostjax.optim.pipedream import delay_lr_factor, scale_by_stage_delay, stage_refresh_periods
from boostjax.optim.registry import make_optimizer
from boostjax.optim.rotation import rotated_state
from boostjax.optim.delay import (DelayState, assign_stages, delay_init, delay_push, delayed_params,
                                  stage_delays)
from helpers import assert_close_ulps, assert_trees_allclose
from boostjax.training.step import TrainState, train_step

N_LAYERS, D = 12, 3
# one step's arithmetic in two programs (stacked vs per-layer leaves, with or without a delay state):
# measured equal on SSE4_2, AVX, AVX2 and AVX-512; 4 ulps of a leaf's scale allow another fusion's FMAs
ULPS_LAYOUT = 4


def _params(seed: int = 0, n_layers: int = N_LAYERS) -> dict:
    ks = iter(jax.random.split(jax.random.PRNGKey(seed), 2 * n_layers + 3))
    return {
        "embed": jax.random.normal(next(ks), (5, D)),
        "layers": [{"w": jax.random.normal(next(ks), (D, D)) / np.sqrt(D), "b": 0.1 * jax.random.normal(next(ks), (D,))}
                   for _ in range(n_layers)],
        "final_norm": jnp.ones((D,)),
        "head": jax.random.normal(next(ks), (D, 2)),
    }


def _loss(p: dict, batch: tuple) -> jax.Array:
    tokens_b, target_b2 = batch
    h_bd = p["embed"][tokens_b]
    for layer in p["layers"]:
        h_bd = jnp.tanh(h_bd @ layer["w"] + layer["b"])
    return jnp.mean((h_bd * p["final_norm"] @ p["head"] - target_b2) ** 2)


def _batches(n: int) -> list:
    ks = jax.random.split(jax.random.PRNGKey(42), 2 * n)
    return [(jax.random.randint(ks[2 * i], (4,), 0, 5), jax.random.normal(ks[2 * i + 1], (4, 2))) for i in range(n)]


def _close(t1, t2, atol: float = 1e-6, rtol: float = 1e-6) -> None:
    assert_trees_allclose(t1, t2, atol=atol, rtol=rtol)


# ----------------------------------------------------------------------------- stages
def test_assign_stages_contiguous_groups_and_outer_params():
    st = assign_stages(_params(), N_LAYERS, 4)
    assert st["embed"] == 0 and st["final_norm"] == 3 and st["head"] == 3
    assert [g["w"] for g in st["layers"]] == [i // 3 for i in range(N_LAYERS)]
    assert [g["b"] for g in st["layers"]] == [i // 3 for i in range(N_LAYERS)]
    assert stage_delays(st, 4)["embed"] == 3 and stage_delays(st, 4)["head"] == 0
    one = assign_stages(_params(), N_LAYERS, N_LAYERS)  # S may equal L
    assert [g["w"] for g in one["layers"]] == list(range(N_LAYERS))
    # int dict keys and digit strings, as nnx.State / flattened checkpoints spell them
    alt = {"tok_embeddings": {"w": 0.0}, "layers": {0: {"w": 0.0}, 1: {"w": 0.0}}, "lm_head": 0.0}
    assert assign_stages(alt, 2, 2) == {"tok_embeddings": {"w": 0}, "layers": {0: {"w": 0}, 1: {"w": 1}},
                                        "lm_head": 1}
    assert assign_stages({"layers": {"0": 0.0, "1": 0.0}}, 2, 2) == {"layers": {"0": 0, "1": 1}}


def test_assign_stages_on_an_nnx_state():
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.proj = nnx.Linear(2, 2, rngs=rngs)

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(4, 2, rngs=rngs)
            self.layers = nnx.List([Block(rngs) for _ in range(4)])
            self.norm = nnx.RMSNorm(2, rngs=rngs)

    state = nnx.state(Net(nnx.Rngs(0)), nnx.Param)
    stages = assign_stages(state, 4, 2)
    flat = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(stages)[0]}
    assert [v for k, v in flat.items() if "embed" in k] == [0]
    assert [v for k, v in flat.items() if "norm" in k] == [1]
    assert sorted(v for k, v in flat.items() if "kernel" in k) == [0, 0, 1, 1]
    hist = delay_init(state, stages, 2)  # the history tree follows the nnx.State structure
    _close(delayed_params(hist), state)


def test_stacked_layers_delayed_training_equals_per_layer():
    """A pipeline's stacked layers (`layers` one tree of `[L, ...]` leaves): per-layer stages as a
    tuple, a ring of max delay + 1, layer l reading its own version. N delayed steps on the stacked
    tree (PipeDream-LR: AdamW, then a per-layer scale) equal N steps on the per-layer tree, then stacked, to a
    few ulps (one jitted gradient for both layouts; the two update programs may fuse differently)."""
    n_layers, n_stages = 4, 2
    per_layer = _params(n_layers=n_layers)
    per_layer = {**per_layer, "layers": dict(enumerate(per_layer["layers"]))}
    stack = lambda p: {**p, "layers": jax.tree.map(lambda *xs: jnp.stack(xs), *p["layers"].values())}  # noqa: E731
    stacked = stack(per_layer)
    stages_s = assign_stages(stacked, n_layers, n_stages)
    assert stages_s["layers"]["w"] == (0, 0, 1, 1) and stages_s["embed"] == 0 and stages_s["head"] == 1
    assert stage_refresh_periods(stages_s, n_stages, base=10)["layers"]["w"] == (8, 8, 15, 15)

    def loss_stacked(p, batch):
        return _loss({**p, "layers": [jax.tree.map(lambda x: x[i], p["layers"]) for i in range(n_layers)]}, batch)

    unstack = lambda p: {**p, "layers": {i: jax.tree.map(lambda x: x[i], p["layers"]) for i in range(n_layers)}}  # noqa: E731
    grad = jax.jit(jax.grad(loss_stacked))  # one gradient program for both layouts
    pick, push = jax.jit(delayed_params), jax.jit(delay_push)
    for name in ("pipedream-lr",):  # AdamW, then the per-layer delay scale
        runs = []
        for params, to_s, from_s in ((stacked, lambda p: p, lambda p: p), (per_layer, stack, unstack)):
            stages = assign_stages(params, n_layers, n_stages)
            opt = make_optimizer(name, lr=3e-2, stages_tree=stages, n_stages=n_stages, t_c=3)
            update = jax.jit(opt.update)
            p, s, ds = params, opt.init(params), delay_init(params, stages, n_stages)
            for batch in _batches(5):
                at = pick(ds)
                u, s = update(from_s(grad(to_s(at), batch)), s, p)
                p = optax.apply_updates(p, u)
                ds = push(ds, p)
            runs.append((p, ds, at))
        (p_s, ds_s, at_s), (p_l, ds_l, at_l) = runs
        assert ds_s.history["layers"]["w"].shape == (2, n_layers, D, D) and ds_s.lags["layers"]["w"].tolist() == [1, 1, 0, 0]
        # two update programs (stacked vs per-layer leaves): the same element-wise arithmetic, another fusion
        assert_close_ulps((p_s, at_s, pick(ds_s)), (stack(p_l), stack(at_l), stack(pick(ds_l))), ulps=ULPS_LAYOUT)
        now = pick(ds_s)["layers"]["w"]  # what the next step reads: layer 0 (stage 0) one version old, layer 3 current
        assert not np.array_equal(np.asarray(now[0]), np.asarray(p_s["layers"]["w"][0]))
        np.testing.assert_array_equal(np.asarray(now[3]), np.asarray(p_s["layers"]["w"][3]))
    with pytest.raises(ValueError, match="axis 0 of size n_layers"):
        assign_stages(stacked, 8, 2)


def test_assign_stages_errors():
    with pytest.raises(ValueError, match="not divisible"):
        assign_stages(_params(), N_LAYERS, 5)
    with pytest.raises(ValueError, match="outside"):
        assign_stages(_params(), 6, 2)


# ----------------------------------------------------------------------------- emulation vs reference
def _delayed_step(opt: optax.GradientTransformation):
    """The training step (`boostjax.training.step.train_step`) on a `TrainState` holding a `DelayState`."""
    return jax.jit(train_step(_loss, opt))


def _delayed_state(params, opt: optax.GradientTransformation, stages, n_stages: int) -> TrainState:
    return TrainState(jnp.zeros((), jnp.int32), params, opt.init(params), delay_init(params, stages, n_stages))


def _reference(params, stages, n_stages, opt, batches):
    """Every past full version kept in a list; the mixed vector is assembled leaf by leaf."""
    grad = jax.jit(jax.value_and_grad(_loss))
    update = jax.jit(opt.update)
    versions, opt_state, out = [params], opt.init(params), []
    stage_leaves, treedef = jax.tree.flatten(stages)
    for t, batch in enumerate(batches):
        mixed = jax.tree.unflatten(treedef, [jax.tree.leaves(versions[max(t - (n_stages - 1 - s), 0)])[i]
                                             for i, s in enumerate(stage_leaves)])
        loss, g = grad(mixed, batch)
        u, opt_state = update(g, opt_state, versions[-1])
        versions.append(optax.apply_updates(versions[-1], u))
        out.append((versions[-1], loss))
    return out


@pytest.mark.parametrize("n_stages", [1, 2, 3, 4])
def test_emulation_equals_explicit_reference(n_stages):
    params, batches = _params(), _batches(8)
    stages = assign_stages(params, N_LAYERS, n_stages)
    opt = optax.adamw(3e-2, weight_decay=0.01)
    ref = _reference(params, stages, n_stages, opt, batches)
    step = _delayed_step(opt)
    state = _delayed_state(params, opt, stages, n_stages)
    depths = {x.shape[0] for x in jax.tree.leaves(state.delay.history)}
    assert depths == set(range(1, n_stages + 1))
    # One fused step against separately jitted grad / update: other fusion, so 1-2 ulp differences
    # (FMA contraction; none without FMA). With 1- and 4-ulp noise on the reference gradients (40 draws)
    # params differ by <= 2.4e-7 (0.16 of atol = rtol = 1e-6), losses by 2.1e-7 relative: 2e-6 and 3e-6
    # leave >= 10x. Stage 0 reading a version one step too old moves params by 0.16, the loss by 4e-2.
    for t, batch in enumerate(batches):
        state, metrics = step(state, batch)
        p, ds, loss = state.params, state.delay, metrics["loss"]
        _close(p, ref[t][0], atol=2e-6, rtol=2e-6)
        np.testing.assert_allclose(float(loss), float(ref[t][1]), rtol=3e-6)
        assert int(ds.step) == t + 1
    if n_stages == 1:  # S = 1 is plain training: the stale vector is the current one
        _close(delayed_params(ds), p, atol=0)
    else:  # the delay is real: the trajectory differs from plain training
        plain = _reference(params, jax.tree.map(lambda _: 0, stages), 1, opt, batches)[-1][0]
        assert not np.allclose(np.asarray(plain["embed"]), np.asarray(p["embed"]), atol=1e-4)


@pytest.mark.parametrize("n_stages", [1, 4])
def test_2bw_every_stage_one_step_behind(n_stages):
    """PipeDream-2BW (`schedule="2bw"`) on a 4-layer model: with S = 4 every leaf keeps a ring of 2
    versions and step t takes its gradient at θ_{t-1} for every stage (θ_0 at t = 0), against a
    hand-rolled loop that keeps every version; S = 1 is the synchronous run (no history at all)."""
    n_layers, params, batches = 4, _params(n_layers=4), _batches(6)
    stages = assign_stages(params, n_layers, n_stages)
    lag = min(1, n_stages - 1)
    assert set(jax.tree.leaves(stage_delays(stages, n_stages, "2bw"))) == {lag}
    opt = optax.adamw(3e-2, weight_decay=0.01)
    step = _delayed_step(opt)
    state = TrainState(jnp.zeros((), jnp.int32), params, opt.init(params), delay_init(params, stages, n_stages, "2bw"))
    assert {x.shape[0] for x in jax.tree.leaves(state.delay.history)} == {lag + 1}
    plain = TrainState(jnp.zeros((), jnp.int32), params, opt.init(params), None)
    grad, update = jax.jit(jax.value_and_grad(_loss)), jax.jit(opt.update)
    versions, opt_state, own = [params], opt.init(params), [params]
    for t, batch in enumerate(batches):
        at = versions[max(t - lag, 0)]
        # every stage reads its own version lag steps old (a copy: exact)
        _close(delayed_params(state.delay), own[max(t - lag, 0)], atol=0, rtol=0)
        loss, g = grad(at, batch)
        u, opt_state = update(g, opt_state, versions[-1])
        versions.append(optax.apply_updates(versions[-1], u))
        state, metrics = step(state, batch)
        own.append(state.params)
        _close(state.params, versions[-1], atol=2e-6, rtol=2e-6)  # as test_emulation_equals_explicit_reference
        np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=3e-6)
        plain, _ = step(plain, batch)
    if n_stages == 1:  # the same step without a delay state: another program, the same arithmetic
        assert_close_ulps(state.params, plain.params, ulps=ULPS_LAYOUT)
    else:  # the one-step delay is real
        assert not np.allclose(np.asarray(plain.params["embed"]), np.asarray(state.params["embed"]), atol=1e-4)
    stacked = {"layers": {"w": jnp.zeros((n_layers, 2, 2))}, "head": jnp.zeros((2, 2))}  # a pipeline's layout
    ds = delay_init(stacked, assign_stages(stacked, n_layers, n_stages), n_stages, "2bw")
    assert ds.history["layers"]["w"].shape[0] == ds.history["head"].shape[0] == lag + 1
    assert ds.lags["layers"]["w"].tolist() == [lag] * n_layers
    with pytest.raises(ValueError, match="schedule '1bw'"):
        stage_delays(stages, n_stages, "1bw")


def test_delayed_params_versions_and_fill_phase():
    """Leaf-level check of the ring buffer: versions are integers pushed as constant arrays."""
    tree = {"embed": jnp.zeros(()), "layers": [jnp.zeros(()), jnp.zeros(())], "head": jnp.zeros(())}
    stages = assign_stages(tree, 2, 2)  # embed 0, layers 0 / 1, head 1
    ds = delay_init(tree, stages, 2)
    assert isinstance(ds, DelayState)
    for version in range(1, 6):
        got = delayed_params(ds)
        t = version - 1
        assert float(got["embed"]) == max(t - 1, 0) and float(got["layers"][0]) == max(t - 1, 0)
        assert float(got["layers"][1]) == t and float(got["head"]) == t
        ds = delay_push(ds, jax.tree.map(lambda x: jnp.full_like(x, version), tree))


# ----------------------------------------------------------------------------- baselines
def test_pipedream_lr_factor_values_and_transform():
    assert float(delay_lr_factor(3, 0, 4)) == pytest.approx(1 / 3)
    assert float(delay_lr_factor(3, 2, 4)) == pytest.approx(3 ** -0.5)
    assert float(delay_lr_factor(3, 4, 4)) == pytest.approx(1.0)
    assert float(delay_lr_factor(3, 9, 4)) == pytest.approx(1.0)
    assert float(delay_lr_factor(0, 0, 4)) == 1.0 and float(delay_lr_factor(1, 0, 4)) == 1.0
    assert float(delay_lr_factor(8, 1, 4)) == pytest.approx(8 ** -0.75)

    params = _params()
    stages = assign_stages(params, N_LAYERS, 4)
    lr_opt = make_optimizer("pipedream-lr", lr=1e-2, stages_tree=stages, n_stages=4, t_c=4)
    base = make_optimizer("adamw", lr=1e-2)
    s1, s2 = lr_opt.init(params), base.init(params)
    taus = stage_delays(stages, 4)
    upd1, upd2, grad = jax.jit(lr_opt.update), jax.jit(base.update), jax.jit(jax.grad(_loss))
    for t, batch in enumerate(_batches(6)):
        g = grad(params, batch)
        u1, s1 = upd1(g, s1, params)
        u2, s2 = upd2(g, s2, params)
        want = jax.tree.map(lambda u, tau: u * (max(tau, 1) ** -(1 - min(t / 4, 1))), u2, taus)
        _close(u1, want, atol=1e-9)
    with pytest.raises(ValueError, match="t_c"):
        scale_by_stage_delay(taus, 0)


def test_stage_refresh_periods_rule():
    stages = {"s0": 0, "s1": 1, "s2": 2, "s3": 3}
    assert stage_refresh_periods(stages, 4, base=10) == {"s0": 6, "s1": 8, "s2": 13, "s3": 25}
    assert stage_refresh_periods({"a": 0}, 1, base=10) == {"a": 10}
    periods = stage_refresh_periods(assign_stages(_params(), N_LAYERS, 4), 4, base=1)
    assert min(jax.tree.leaves(periods)) >= 1
    with pytest.raises(ValueError, match="base"):
        stage_refresh_periods(stages, 4, base=0)


def test_rotation_with_stage_aware_refresh_in_delayed_training():
    params, batches = _params(n_layers=2), _batches(5)
    stages = assign_stages(params, 2, 2)
    opt = make_optimizer("rotation", lr=1e-2, clip=1.0, stages_tree=stages, n_stages=2,
                         refresh_every=2, stage_aware_refresh=True)
    step = _delayed_step(opt)
    state = _delayed_state(params, opt, stages, 2)
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert np.all(np.isfinite(losses)) and int(state.delay.step) == 5
    assert rotated_state(state.opt_state).basis_l["layers"][0]["w"].shape == (D, D)


def test_clip_by_stage_norm_by_hand_and_one_stage_is_global():
    """Stage 0 holds `embed` (norm 5: scaled to 1/5) and layer 0 of the stack; stage 1 holds layer 1 and
    the head (norm 0.5: under the threshold, untouched)."""
    from boostjax.optim.pipedream import clip_by_stage_norm

    g = {"embed": jnp.asarray([3.0, 0.0]), "layers": jnp.asarray([[0.0, 4.0], [0.3, 0.0]]),
         "head": jnp.asarray([0.0, 0.4])}
    stages = {"embed": 0, "layers": (0, 1), "head": 1}
    out, _ = clip_by_stage_norm(stages, 2, 1.0).update(g, clip_by_stage_norm(stages, 2, 1.0).init(g))
    np.testing.assert_allclose(out["embed"], [0.6, 0.0], rtol=1e-6)
    np.testing.assert_allclose(out["layers"], [[0.0, 0.8], [0.3, 0.0]], rtol=1e-6)
    np.testing.assert_allclose(out["head"], [0.0, 0.4], rtol=1e-6)
    one = jax.tree.map(lambda s: 0 if isinstance(s, int) else (0, 0), stages, is_leaf=lambda s: isinstance(s, tuple))
    got, _ = clip_by_stage_norm(one, 1, 1.0).update(g, None)
    want, _ = optax.clip_by_global_norm(1.0).update(g, optax.clip_by_global_norm(1.0).init(g))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got, want)
    with pytest.raises(ValueError, match="max_norm"):
        clip_by_stage_norm(stages, 2, 0.0)


def test_stage_clip_scope_in_the_registry_clips_each_stage():
    """`clip_scope="stage"` is per-stage clipping, then the optimizer: with one stage's gradient 1e4 times
    the others, that stage alone is brought to the threshold (global clipping would shrink all four)."""
    from boostjax.optim.pipedream import clip_by_stage_norm

    params = _params()
    stages = assign_stages(params, N_LAYERS, 4)
    g = jax.tree.map(jnp.ones_like, params)
    g["embed"] = g["embed"] * 1e4
    clipped, _ = clip_by_stage_norm(stages, 4, 1.0).update(g, None)
    sq = {}
    for leaf, sid in zip(jax.tree.leaves(clipped), jax.tree.structure(params).flatten_up_to(stages)):
        for s, x in ([(s, leaf[i]) for i, s in enumerate(sid)] if isinstance(sid, tuple) else [(sid, leaf)]):
            sq[s] = sq.get(s, 0.0) + float(jnp.sum(x * x))
    unclipped = {s: v for s, v in sq.items() if s != 0}
    assert abs(sq[0] ** 0.5 - 1.0) < 1e-5 and all(v ** 0.5 > 1.0 for v in unclipped.values()), sq
    opt = make_optimizer("adamw", lr=1e-2, clip=1.0, clip_scope="stage", stages_tree=stages, n_stages=4)
    want = optax.chain(clip_by_stage_norm(stages, 4, 1.0), optax.adamw(1e-2, weight_decay=0.01))
    _close(opt.update(g, opt.init(params), params)[0], want.update(g, want.init(params), params)[0], atol=0)
    with pytest.raises(ValueError, match="clip_scope"):
        make_optimizer("adam8bit", clip=1.0, clip_scope="stage", stages_tree=stages, n_stages=4)
