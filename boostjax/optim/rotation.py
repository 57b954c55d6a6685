"""Basis-rotation Adam: Adam run in a Kronecker-factored eigenbasis (optax-shaped).

Per rotated 2-D leaf `W_mn` with gradient `G_mn` and bases `U_mm`, `V_nn`:
`m` is Adam's first moment in the original space, `v` its second moment in the rotated space
`Uᵀ G V`, and the step is `U [ m̂ / (sqrt(v̂) + eps) ] Vᵀ`. A step uses bases built from the
gradients up to the previous step (SOAP's order; step 1 is exactly AdamW), refreshed every T steps
by a damped power step plus QR. `scale_by_rotated_adam` is the direction; `rotated_adam` chains
weight decay and the learning rate, as `optax.adamw` does. Paper: https://arxiv.org/abs/2602.03515.
The update, refreshes, damping, placeholders and grouped leaves in full: docs/rotation.md
("The update, exactly").
"""

from __future__ import annotations

import functools
import itertools
import numbers
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, Int

SOURCES: tuple[str, ...] = ("second", "first")
ORDERS: tuple[str, ...] = ("previous", "current")
GEOMETRIES: tuple[str, ...] = ("bilateral", "unilateral")
_HI = jax.lax.Precision.HIGHEST

MaskOrFn = Union[Any, Callable[[Any], Any], None]


class RotatedAdamState(NamedTuple):
    """State of `scale_by_rotated_adam`; every field but `count` is a pytree shaped like the params.

    `basis_l`/`basis_r`: U (m, m) / V (n, n) or a `f32[1]` placeholder for an unrotated side.
    `stat_l`/`stat_r`: EMA of G Gᵀ / Gᵀ G (source "second" only), else placeholders.
    `nu` is in the rotated space for rotated leaves; `mu` is always in the original space.
    """

    count: Int[Array, ""]
    mu: optax.Updates
    nu: optax.Updates
    basis_l: optax.Updates
    basis_r: optax.Updates
    stat_l: optax.Updates
    stat_r: optax.Updates


# state fields whose leaves are [m, m] / [n, n] (or stacked [G, m, m]) matrices of the rotation, never
# laid out like the parameter even when the shapes agree (square weights): replicate them on a mesh
REPLICATED_FIELDS: frozenset[str] = frozenset({"basis_l", "basis_r", "stat_l", "stat_r"})


def default_rotation_mask(params: Any) -> Any:
    """Rotate every leaf with ndim == 2."""
    return jax.tree.map(lambda p: jnp.ndim(p) == 2, params)


def _placeholder() -> Float[Array, "1"]:
    """An unused slot: 1-D (so `_is_live` is False), one element (Orbax cannot save empty arrays)."""
    return jnp.zeros((1,), jnp.float32)


def _matmul_highest(a: Array, b: Array) -> Array:
    """a @ b at `Precision.HIGHEST`: TF32 / bf16 defaults on accelerators would erode orthogonality."""
    return jnp.matmul(a, b, precision=_HI)


def _is_live(x: Array) -> bool:
    """A basis / statistic slot is live when it is a matrix (placeholders are 1-D)."""
    return x.ndim == 2


def _sides(shape: tuple[int, ...], rotate_leaf: bool, geometry: str, max_dim: int) -> tuple[bool, bool]:
    if not rotate_leaf:
        return False, False
    m, n = shape
    left, right = (True, True) if geometry == "bilateral" else (m <= n, m > n)
    return left and m <= max_dim, right and n <= max_dim


def _project(x_mn: Array, u_mm: Array, v_nn: Array) -> Array:
    """Uᵀ X V (identity on placeholder sides)."""
    if _is_live(u_mm):
        x_mn = _matmul_highest(u_mm.T, x_mn)
    if _is_live(v_nn):
        x_mn = _matmul_highest(x_mn, v_nn)
    return x_mn


def _unproject(x_mn: Array, u_mm: Array, v_nn: Array) -> Array:
    """U X Vᵀ (identity on placeholder sides)."""
    if _is_live(u_mm):
        x_mn = _matmul_highest(u_mm, x_mn)
    if _is_live(v_nn):
        x_mn = _matmul_highest(x_mn, v_nn.T)
    return x_mn


def _qr(a: Array) -> Array:
    return jnp.linalg.qr(a)[0]


def _desc(est: Array) -> Array:
    return jnp.argsort(est, descending=True, stable=True)


# ----------------------------------------------------------------------------- refreshes
# the refreshes' shift, in units of the statistic's mean eigenvalue: 4 keeps a mesh within
# 1e-4 / 1e-3 (losses / parameters) of one device over 60 steps on every CPU instruction set (docs/rotation.md)
DAMPING = 4.0
EXACT_ITERS = 30  # shifted orthogonal-iteration steps of the first refresh (damping > 0)


def _damped(s_dd: Array, damping: float) -> Array:
    """S + damping · (tr S / d) · I: the Gram statistic shifted by `damping` times its mean eigenvalue."""
    d = s_dd.shape[-1]
    return s_dd + (damping * jnp.trace(s_dd) / d) * jnp.eye(d, dtype=s_dd.dtype)


def _power_sym(s_dd: Array, q_dd: Array, damping: float, iters: int = 1) -> tuple[Array, Array]:
    """`iters` steps Q <- qr(S' Q) on the damped S', then columns sorted by diag(Qᵀ S' Q)."""
    s_dd = _damped(s_dd, damping) if damping else s_dd
    q_dd = jax.lax.fori_loop(0, iters, lambda _, q: _qr(_matmul_highest(s_dd, q)), q_dd)
    perm = _desc(jnp.sum(q_dd * _matmul_highest(s_dd, q_dd), axis=0))
    return q_dd[:, perm], perm


def _exact_sym(s_dd: Array, q_dd: Array, damping: float) -> Array:
    """The first basis: `eigh` (damping 0), else EXACT_ITERS damped steps from the current basis (I)."""
    if not damping:
        return jnp.linalg.eigh(s_dd)[1][:, ::-1]
    return _power_sym(s_dd, q_dd, damping, EXACT_ITERS)[0]


def _exact_second(u_mm, v_nn, nu_mn, l_mm, r_nn, mt_mn, damping=0.0):
    del mt_mn
    if _is_live(u_mm):
        u_mm = _exact_sym(l_mm, u_mm, damping)
    if _is_live(v_nn):
        v_nn = _exact_sym(r_nn, v_nn, damping)
    return u_mm, v_nn, nu_mn  # the caller re-expresses v in the new bases


def _power_second(u_mm, v_nn, nu_mn, l_mm, r_nn, mt_mn, damping=0.0):
    del mt_mn
    if _is_live(u_mm):
        u_mm, perm = _power_sym(l_mm, u_mm, damping)
        nu_mn = nu_mn[perm, :]
    if _is_live(v_nn):
        v_nn, perm = _power_sym(r_nn, v_nn, damping)
        nu_mn = nu_mn[:, perm]
    return u_mm, v_nn, nu_mn


def _exact_first(u_mm, v_nn, nu_mn, l_mm, r_nn, mt_mn):
    del l_mm, r_nn
    uf_mm, _, vh_nn = jnp.linalg.svd(mt_mn, full_matrices=True)
    return (uf_mm if _is_live(u_mm) else u_mm), (vh_nn.T if _is_live(v_nn) else v_nn), nu_mn  # re-expressed by the caller


def _power_first(u_mm, v_nn, nu_mn, l_mm, r_nn, mt_mn):
    del l_mm, r_nn
    m, n = mt_mn.shape
    k = min(m, n)
    if _is_live(u_mm) and _is_live(v_nn):
        u_mm = _qr(jnp.concatenate([_matmul_highest(mt_mn, v_nn[:, :k]), u_mm[:, k:]], axis=1))
        v_nn = _qr(jnp.concatenate([_matmul_highest(mt_mn.T, u_mm[:, :k]), v_nn[:, k:]], axis=1))
        sigma = jnp.abs(jnp.sum(u_mm[:, :k] * _matmul_highest(mt_mn, v_nn[:, :k]), axis=0))
        perm = _desc(sigma)
        perm_m = jnp.concatenate([perm, jnp.arange(k, m)])
        perm_n = jnp.concatenate([perm, jnp.arange(k, n)])
        return u_mm[:, perm_m], v_nn[:, perm_n], nu_mn[perm_m][:, perm_n]
    if _is_live(u_mm):
        u_mm = _qr(_matmul_highest(mt_mn, _matmul_highest(mt_mn.T, u_mm)))
        perm = _desc(jnp.sum(_matmul_highest(mt_mn.T, u_mm) ** 2, axis=0))
        return u_mm[:, perm], v_nn, nu_mn[perm, :]
    v_nn = _qr(_matmul_highest(mt_mn.T, _matmul_highest(mt_mn, v_nn)))
    perm = _desc(jnp.sum(_matmul_highest(mt_mn, v_nn) ** 2, axis=0))
    return u_mm, v_nn[:, perm], nu_mn[:, perm]


def _no_refresh(u_mm, v_nn, nu_mn, l_mm, r_nn, mt_mn):
    """The `lax.switch` branch of a step without refresh. Every refresh branch takes the bases, the
    rotated second moment, the Gram statistics and the look-ahead momentum, and returns `(U, V, v)`."""
    del l_mm, r_nn, mt_mn
    return u_mm, v_nn, nu_mn


# ----------------------------------------------------------------------------- validation
def _group_axes(flag: Any, shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """The stacking axes of a grouped leaf (mask entry an int or a non-empty tuple of ints), else None.

    A bool (True / False) or `()` (a plain matrix) is not grouped; `g` is `(g,)`; `(0, 2)` on
    `[L, d, 3, r]` stacks the L*3 matrices `[d, r]` (a pipeline's layer axis 0 plus a_qkv's group axis)."""
    if isinstance(flag, bool) or flag is None or flag == ():
        return None
    axes = (flag,) if isinstance(flag, numbers.Integral) else flag
    ok = isinstance(axes, tuple) and all(isinstance(a, numbers.Integral) and not isinstance(a, bool) for a in axes)
    if ok:
        axes = tuple(int(a) for a in axes)
        ok = len(shape) - len(axes) == 2 and len(set(axes)) == len(axes) and all(0 <= a < len(shape) for a in axes)
    if not ok:
        raise ValueError(f"rotated_adam: mask entry {flag!r} (group axis / axes) for a leaf of shape {shape}; "
                         "fix: int or tuple group axes, distinct, in range, leaving exactly 2 matrix axes")
    return tuple(sorted(axes))


def _rotates(flag: Any) -> bool:
    """Mask entry -> rotated at all: True, an int group axis (0 included) or a tuple (`()` included)."""
    return isinstance(flag, tuple) or (flag is not None and not isinstance(flag, bool) and
                                       isinstance(flag, numbers.Integral)) or flag is True


def _leaves_like(tree: Any, treedef: Any, what: str, fix: str) -> list[Any]:
    try:
        return treedef.flatten_up_to(tree)
    except (ValueError, TypeError) as err:
        raise ValueError(f"rotated_adam: {what} does not match the params tree ({err}); fix: {fix}") from None


def _check_period(t: Any) -> int:
    if not isinstance(t, numbers.Integral) or isinstance(t, bool) or t < 1:
        raise ValueError(f"rotated_adam: refresh_every entries must be ints >= 1, got {t!r}; "
                         "fix: pass e.g. refresh_every=10")
    return int(t)


def _period_leaves(refresh_every: Any, treedef: Any) -> list[int | tuple[int, ...]]:
    """Per leaf an int, or (a stacked leaf) a tuple with one int per index of its axis 0."""
    if isinstance(refresh_every, numbers.Integral):
        periods = [refresh_every] * treedef.num_leaves
    else:
        periods = _leaves_like(refresh_every, treedef, "refresh_every",
                               "pass an int or a pytree of ints shaped like the params")
    return [tuple(_check_period(x) for x in t) if isinstance(t, (tuple, list)) else _check_period(t)
            for t in periods]


def _check_args(b1, b2, eps, source, geometry, refresh_every, basis_beta, max_dim, order="previous"):
    if source not in SOURCES:
        raise ValueError(f"rotated_adam: source={source!r}; fix: use one of {SOURCES}")
    if order not in ORDERS or (order == "current" and source != "second"):
        raise ValueError(f"rotated_adam: order={order!r} with source={source!r}; "
                         f"fix: order one of {ORDERS}, 'current' with source='second'")
    if geometry not in GEOMETRIES:
        raise ValueError(f"rotated_adam: geometry={geometry!r}; fix: use one of {GEOMETRIES}")
    if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
        raise ValueError(f"rotated_adam: betas ({b1}, {b2}) must lie in [0, 1); fix: e.g. b1=0.9, b2=0.999")
    if not 0.0 <= basis_beta < 1.0:
        raise ValueError(f"rotated_adam: basis_beta={basis_beta} must lie in [0, 1); fix: e.g. 0.95")
    if eps < 0:
        raise ValueError("rotated_adam: eps must be a non-negative float; fix: e.g. 1e-8")
    if not isinstance(max_dim, int) or max_dim < 0:
        raise ValueError(f"rotated_adam: max_dim={max_dim!r} must be an int >= 0; fix: e.g. 4096")
    if isinstance(refresh_every, numbers.Integral) and (isinstance(refresh_every, bool) or refresh_every < 1):
        raise ValueError(f"rotated_adam: refresh_every={refresh_every!r} must be >= 1; fix: e.g. 10")


# ----------------------------------------------------------------------------- transforms
@dataclass(frozen=True, eq=False)
class _Hyper:
    """The hyperparameters of `scale_by_rotated_adam`, as given (checked by `_check_args`)."""

    b1: float
    b2: float
    eps: float
    source: str
    geometry: str
    refresh_every: Any
    basis_beta: float
    max_dim: int
    rotate: bool
    mask: MaskOrFn
    order: str
    damping: float


def scale_by_rotated_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    *,
    source: str = "second",
    geometry: str = "bilateral",
    refresh_every: Any = 10,
    basis_beta: float = 0.95,
    max_dim: int = 4096,
    rotate: bool = True,
    mask: MaskOrFn = None,
    order: str = "previous",
    damping: float = DAMPING,
) -> optax.GradientTransformation:
    """The direction of Adam in a Kronecker-factored rotated basis (no learning rate, no weight
    decay: `rotated_adam` chains those, as `optax.adamw` does around `optax.scale_by_adam`).

    `refresh_every`: int or a pytree of ints shaped like the params (stage-aware periods); a
    stacked leaf (mask with group axis 0) may take a tuple with one period per index of axis 0.
    `mask`: pytree (or a `params -> pytree` callable) of False / True / int / tuple of ints;
    default: leaves with ndim == 2. True or `()` rotates a 2-D leaf; an int `g` or a tuple of axes
    rotates each matrix of a leaf stacked along those axes (independent bases per matrix).
    `rotate=False` gives exactly `optax.scale_by_adam(b1, b2, eps)`.
    `order`: "previous" (SOAP's order, docs/rotation.md) or "current", the basis-rotation reference
    code's (`BasisRotation.step`): Gram EMA with G_t, refresh if due (exact `eigh` at step 1, one
    power-iteration step when `t % T == 0`), THEN the Adam step with the fresh bases; `v` is never
    restarted (it is still zero at the exact refresh) and its bias correction counts t. Source
    "second" only. At step 1 `Uᵀ G₁ V` is diagonal up to rounding, which Adam normalises to O(1)
    off-diagonal updates unless eps is large: that is what the reference does.
    `damping`: order "previous", source "second": the refreshes iterate on `L + damping (tr L / m) I`
    (docs/rotation.md); 0 gives the paper's exact `eigh` and undamped power steps.
    """
    _check_args(b1, b2, eps, source, geometry, refresh_every, basis_beta, max_dim, order)
    if not isinstance(damping, (int, float)) or isinstance(damping, bool) or damping < 0:
        raise ValueError(f"rotated_adam: damping={damping!r} must be a float >= 0; fix: e.g. {DAMPING} (0 = exact eigh)")
    hp = _Hyper(b1, b2, eps, source, geometry, refresh_every, basis_beta, max_dim, rotate, mask, order, damping)
    return optax.GradientTransformation(functools.partial(_init, hp), functools.partial(_update, hp))


def _mask_leaves(hp: _Hyper, tree: Any, treedef: Any) -> list[Any]:
    mask = hp.mask
    mask_tree = (mask(tree) if callable(mask) else mask) if mask is not None else default_rotation_mask(tree)
    return _leaves_like(mask_tree, treedef, "mask", "pass a pytree of bools (or int / tuple group axes) like the params")


def _init(hp: _Hyper, params: Any) -> RotatedAdamState:
    """The state: zero moments, identity bases and zero statistics (placeholders where unrotated)."""
    flat, treedef = jax.tree.flatten(params)
    periods = _period_leaves(hp.refresh_every, treedef)
    flags = _mask_leaves(hp, params, treedef)
    slots = [_init_slots(hp, p, flag, period) for p, flag, period in zip(flat, flags, periods)]
    basis_l, basis_r, stat_l, stat_r = (jax.tree.unflatten(treedef, list(xs)) for xs in zip(*slots))
    return RotatedAdamState(
        count=jnp.zeros([], jnp.int32),
        mu=jax.tree.map(jnp.zeros_like, params),
        nu=jax.tree.map(jnp.zeros_like, params),
        basis_l=basis_l, basis_r=basis_r, stat_l=stat_l, stat_r=stat_r,
    )


def _init_slots(hp: _Hyper, p: Any, flag: Any, period: Any) -> tuple[Array, Array, Array, Array]:
    """One leaf's (U, V, L, R): identity bases / zero statistics on its rotated sides, else placeholders;
    a grouped leaf's stacked on its group axes."""
    shape = jnp.shape(p)
    groups = _group_axes(flag, shape) if hp.rotate else None
    on = _rotates(flag) and hp.rotate  # group axis 0 is an int and () a plain matrix, not "off"
    if on:  # an unrotated leaf ignores its period (a stacked norm may carry per-layer ones)
        _check_stacked_period(period, groups, shape)
    if groups is not None:
        shape = tuple(d for i, d in enumerate(shape) if i not in groups)
    elif on and len(shape) != 2:
        raise ValueError(f"rotated_adam: mask selects a leaf of shape {jnp.shape(p)}; only 2-D leaves "
                         "can be rotated (or stacks of them with int group axes); fix: mask it out")
    left, right = _sides(shape, on, hp.geometry, hp.max_dim)
    m, n = shape if on else (0, 0)
    slots = (jnp.eye(m, dtype=jnp.float32) if left else _placeholder(),
             jnp.eye(n, dtype=jnp.float32) if right else _placeholder(),
             jnp.zeros((m, m), jnp.float32) if left and hp.source == "second" else _placeholder(),
             jnp.zeros((n, n), jnp.float32) if right and hp.source == "second" else _placeholder())
    if groups is not None:  # one set of bases per matrix, stacked on leading axes
        lead = tuple(jnp.shape(p)[a] for a in groups)
        slots = tuple(jnp.broadcast_to(x, (*lead, *x.shape)) for x in slots)
    return slots


def _update(hp: _Hyper, updates: Any, state: RotatedAdamState, params: Any = None):
    """`update_fn`: every leaf's direction and state, the count incremented once."""
    del params
    g_flat, treedef = jax.tree.flatten(updates)
    periods = _period_leaves(hp.refresh_every, treedef)
    fields = [treedef.flatten_up_to(x) for x in state[1:]]
    count_inc = optax.safe_increment(state.count)
    groups = [_group_axes(f, jnp.shape(g)) if hp.rotate else None
              for f, g in zip(_mask_leaves(hp, updates, treedef), g_flat)]
    out = [_grouped_update(hp, g, leaf, count_inc, period, group)
           for g, period, group, *leaf in zip(g_flat, periods, groups, *fields)]
    new_updates = jax.tree.unflatten(treedef, [o[0] for o in out])
    new_fields = [jax.tree.unflatten(treedef, [o[1][i] for o in out]) for i in range(6)]
    return new_updates, RotatedAdamState(count_inc, *new_fields)


# ----------------------------------------------------------------------------- one leaf
def _take_matrix(x: Array, groups: tuple[int, ...], idx: tuple[int, ...]) -> Array:
    """The matrix at index `idx` of the group axes `groups` of a stacked leaf."""
    key = [slice(None)] * x.ndim
    for a, i in zip(groups, idx):
        key[a] = i
    return x[tuple(key)]


def _restack(xs: list[Array], lead: tuple[int, ...], order: np.ndarray | None) -> Array:
    """Per-matrix results stacked on leading group axes, then (`order` given) moved to the leaf's axes."""
    x = jnp.stack(xs).reshape(*lead, *xs[0].shape)
    return jnp.transpose(x, order) if order is not None else x


def _grouped_update(hp: _Hyper, g, leaf, count_inc, period, groups):
    """`_leaf_update` per matrix of a grouped leaf (bases stacked on leading axes), restacked.

    A Python loop over the matrices rather than `vmap`: each matrix then has its own refresh
    conditional (and period), exactly like a 2-D leaf (a vmapped conditional over a TP-sharded
    stack made XLA's CPU collectives hang). A stack of L layers unrolls like L separate leaves."""
    if groups is None:
        return _leaf_update(hp, g, leaf, count_inc, period)
    mu, nu, *bases = leaf
    lead = tuple(g.shape[a] for a in groups)
    rest = [a for a in range(g.ndim) if a not in groups]
    order = np.argsort([*groups, *rest])  # (group axes, matrix axes) -> the leaf's own order
    outs = []
    for idx in itertools.product(*map(range, lead)):
        t = period[idx[0]] if isinstance(period, tuple) else period
        g_mn = _take_matrix(g, groups, idx)
        matrix = (_take_matrix(mu, groups, idx), _take_matrix(nu, groups, idx), *(b[idx] for b in bases))
        outs.append(_leaf_update(hp, g_mn, matrix, count_inc, t))
    upd = _restack([o[0] for o in outs], lead, order)
    mu, nu = (_restack([o[1][k] for o in outs], lead, order) for k in (0, 1))
    return upd, (mu, nu, *(_restack([o[1][k] for o in outs], lead, None) for k in range(2, 6)))


def _leaf_update(hp: _Hyper, g, leaf, count_inc, period):
    """One matrix's (or unrotated leaf's) direction and new `(mu, nu, U, V, L, R)`."""
    mu, nu, u_mm, v_nn, l_mm, r_nn = leaf
    if not (_is_live(u_mm) or _is_live(v_nn)):  # plain Adam, the formula of optax.scale_by_adam
        b1, b2 = hp.b1, hp.b2
        mu = (1 - b1) * g + b1 * mu
        nu = (1 - b2) * (g * g) + b2 * nu
        bc1, bc2 = 1 - b1**count_inc, 1 - b2**count_inc
        upd = (mu / bc1.astype(mu.dtype)) / (jnp.sqrt(nu / bc2.astype(nu.dtype)) + hp.eps)
        return upd, (mu, nu, u_mm, v_nn, l_mm, r_nn)
    if hp.order == "current":
        return _leaf_update_current(hp, g, mu, nu, u_mm, v_nn, l_mm, r_nn, count_inc, period)
    return _leaf_update_previous(hp, g, mu, nu, u_mm, v_nn, l_mm, r_nn, count_inc, period)


def _adam_in_bases(hp: _Hyper, g, g32, mu, nu, u_mm, v_nn, count_inc):
    """The Adam step in the bases U, V (`g32`: `g` in float32): `(update, mu, nu)`. `Uᵀ m_t V` is formed
    by linearity, so the fresh gradient enters m̂ and v through the same rounded `Uᵀ G V`."""
    b1, b2, f32 = hp.b1, hp.b2, jnp.float32
    bc1 = (1 - b1**count_inc).astype(f32)
    bc2 = (1 - b2**count_inc).astype(f32)
    gr = _project(g32, u_mm, v_nn)
    nu = (1 - b2) * (gr * gr).astype(nu.dtype) + b2 * nu
    mr = (1 - b1) * gr + b1 * _project(mu.astype(f32), u_mm, v_nn)
    mu = (1 - b1) * g + b1 * mu
    upd_r = (mr / bc1) / (jnp.sqrt(nu.astype(f32) / bc2) + hp.eps)
    return _unproject(upd_r, u_mm, v_nn).astype(g.dtype), mu, nu


def _gram_stats(hp: _Hyper, g32, l_mm, r_nn):
    """The EMAs `L <- β L + (1-β) G Gᵀ`, `R <- β R + (1-β) Gᵀ G` on their live sides."""
    beta = hp.basis_beta
    if _is_live(l_mm):
        l_mm = beta * l_mm + (1 - beta) * _matmul_highest(g32, g32.T)
    if _is_live(r_nn):
        r_nn = beta * r_nn + (1 - beta) * _matmul_highest(g32.T, g32)
    return l_mm, r_nn


def _leaf_update_previous(hp: _Hyper, g, mu, nu, u_mm, v_nn, l_mm, r_nn, count_inc, period):
    """order "previous": the Adam step in the bases of steps up to t-1 (identity at t = 1), then the
    statistics take G_t and the bases are refreshed (if due) for the steps that follow."""
    f32 = jnp.float32
    first = count_inc == 1
    g32 = g.astype(f32)
    upd, mu, nu = _adam_in_bases(hp, g, g32, mu, nu, u_mm, v_nn, count_inc)
    mt_mn = jnp.zeros((0,), f32)
    if hp.source == "second":
        l_mm, r_nn = _gram_stats(hp, g32, l_mm, r_nn)
        branches = (_no_refresh, functools.partial(_power_second, damping=hp.damping),
                    functools.partial(_exact_second, damping=hp.damping))
    else:
        mt_mn = hp.b1 * mu.astype(f32) + (1 - hp.b1) * g32  # look-ahead momentum
        branches = (_no_refresh, _power_first, _exact_first)
    branch = jnp.where(first, 2, jnp.where((count_inc - 1) % period == 0, 1, 0))
    u_mm, v_nn, nu = jax.lax.switch(branch, branches, u_mm, v_nn, nu, l_mm, r_nn, mt_mn)
    # step 1's v, (1 - b2) G₁², re-expressed in the new bases: exactly (1 - b2) (Uᵀ G₁ V)²
    nu = jax.lax.cond(first, lambda: ((1 - hp.b2) * jnp.square(_project(g32, u_mm, v_nn))).astype(nu.dtype),
                      lambda: nu)
    return upd, (mu, nu, u_mm, v_nn, l_mm, r_nn)


def _leaf_update_current(hp: _Hyper, g, mu, nu, u_mm, v_nn, l_mm, r_nn, count_inc, period):
    """order "current": statistics with G_t, refresh if due, then the Adam step in those bases."""
    f32 = jnp.float32
    g32 = g.astype(f32)
    l_mm, r_nn = _gram_stats(hp, g32, l_mm, r_nn)
    branch = jnp.where(count_inc == 1, 2, jnp.where(count_inc % period == 0, 1, 0))
    u_mm, v_nn, nu = jax.lax.switch(branch, (_no_refresh, _power_second, _exact_second), u_mm, v_nn, nu, l_mm, r_nn,
                                    jnp.zeros((0,), f32))
    upd, mu, nu = _adam_in_bases(hp, g, g32, mu, nu, u_mm, v_nn, count_inc)
    return upd, (mu, nu, u_mm, v_nn, l_mm, r_nn)


def _check_stacked_period(period: Any, groups: tuple[int, ...] | None, shape: tuple[int, ...]) -> None:
    if isinstance(period, tuple) and (groups is None or groups[0] != 0 or len(period) != shape[0]):
        raise ValueError(f"rotated_adam: a tuple of refresh periods {period} for a leaf of shape {shape} "
                         f"(group axes {groups}); fix: per-index periods need group axis 0 and one per index")


def rotated_adam(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    *,
    source: str = "second",
    geometry: str = "bilateral",
    refresh_every: Any = 10,
    basis_beta: float = 0.95,
    max_dim: int = 4096,
    rotate: bool = True,
    mask: MaskOrFn = None,
    weight_decay_mask: MaskOrFn = None,
    order: str = "previous",
    damping: float = DAMPING,
) -> optax.GradientTransformation:
    """AdamW in a Kronecker-factored rotated basis: `scale_by_rotated_adam`, then
    `add_decayed_weights(weight_decay, weight_decay_mask)` (left out when 0), then
    `scale_by_learning_rate(learning_rate)`, composed like `optax.adamw`.

    `rotate=False` gives exactly `optax.adamw(learning_rate, b1, b2, eps, weight_decay=...)`.
    """
    if not isinstance(weight_decay, (int, float)) or weight_decay < 0:
        raise ValueError("rotated_adam: weight_decay must be a non-negative float; fix: e.g. 0.01")
    if not callable(learning_rate) and not isinstance(learning_rate, (int, float, jax.Array, np.ndarray)):
        raise ValueError("rotated_adam: learning_rate must be a float or an optax schedule")
    direction = scale_by_rotated_adam(b1, b2, eps, source=source, geometry=geometry, refresh_every=refresh_every,
                                      basis_beta=basis_beta, max_dim=max_dim, rotate=rotate, mask=mask, order=order,
                                      damping=damping)
    decay = [optax.add_decayed_weights(weight_decay, weight_decay_mask)] if weight_decay != 0 else []
    return optax.chain(direction, *decay, optax.scale_by_learning_rate(learning_rate))


def rotated_state(opt_state: Any) -> RotatedAdamState:
    """The (first) `RotatedAdamState` inside an optimizer state (a chain, `inject_hyperparams`, ...)."""
    found = [x for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, RotatedAdamState))
             if isinstance(x, RotatedAdamState)]
    if not found:
        raise ValueError("rotated_state: no RotatedAdamState in this optimizer state; fix: pass a rotation state")
    return found[0]


def orthonormality_error(state: Any) -> Float[Array, ""]:
    """max over live bases of ‖QᵀQ − I‖_F (0 when nothing is rotated); a diagnostic. `state`: a
    `RotatedAdamState` or any optimizer state holding one; stacked bases count matrix by matrix."""
    state = state if isinstance(state, RotatedAdamState) else rotated_state(state)
    qs = [q.reshape(-1, *q.shape[-2:]) for q in jax.tree.leaves((state.basis_l, state.basis_r)) if q.ndim >= 2]
    errs = [jnp.linalg.norm(_matmul_highest(jnp.swapaxes(q, -1, -2), q) - jnp.eye(q.shape[-1], dtype=q.dtype), axis=(-2, -1))
            for q in qs]
    return jnp.max(jnp.concatenate(errs)) if errs else jnp.zeros([], jnp.float32)
