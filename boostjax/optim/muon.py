"""Muon on the hidden matrices, AdamW on everything else (embeddings, LM head, norms and biases).

Which leaf is a matrix comes from the rotation mask (`boostjax.sharding.rules.rotation_mask`, the
same per-leaf flags the rotation optimizer reads): False = AdamW; True or `()` = one matrix; an int or
a tuple of ints = the axes along which independent matrices are stacked (a pipeline's layer axis,
a_qkv's group axis), the two remaining axes being the matrix. Without a mask every 2-D leaf is a
matrix (optax's default).

Matrix leaves: `optax.contrib.scale_by_muon` (Nesterov momentum, β 0.95, bias-corrected as optax
does; 5 quintic Newton–Schulz steps on the Frobenius-normalised momentum, per stacked matrix), then
`rms · sqrt(max(fan_in, fan_out))` (Moonlight's "match AdamW's update RMS",
https://arxiv.org/abs/2502.16982; rms 0.2), then decoupled weight decay and the learning rate, so
the AdamW learning rate and weight decay carry over. Other leaves: `optax.adamw` with the same
learning rate, betas and weight decay as the "adamw" optimizer. Muon: https://kellerjordan.github.io/posts/muon/.
"""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array
from optax.contrib import MuonDimensionNumbers, scale_by_muon
from optax.transforms import MaskedNode

_MUON, _ADAMW = "muon", "adamw"


def _is_masked(x: Any) -> bool:
    return isinstance(x, MaskedNode)


def matrix_dims(flag: Any, shape: tuple[int, ...]) -> MuonDimensionNumbers | None:
    """A rotation-mask flag -> the leaf's matrix axes (None: not a matrix, AdamW)."""
    if flag is None or flag is False:
        return None
    if flag is True:
        groups: tuple = ()
    elif isinstance(flag, numbers.Integral):
        groups = (int(flag),)
    elif isinstance(flag, tuple) and all(isinstance(a, numbers.Integral) and not isinstance(a, bool) for a in flag):
        groups = tuple(int(a) for a in flag)
    else:
        raise ValueError(f"muon: mask entry {flag!r} for a leaf of shape {shape}; fix: False, True, an int or a "
                         "tuple of ints (stacking axes)")
    matrix = [a for a in range(len(shape)) if a not in groups]
    if len(matrix) != 2 or len(set(groups)) + 2 != len(shape) or not all(0 <= g < len(shape) for g in groups):
        raise ValueError(f"muon: mask entry {flag!r} leaves axes {matrix} of a leaf of shape {shape}; fix: the "
                         "stacking axes must leave exactly 2 matrix axes")
    return MuonDimensionNumbers(reduction_axis=matrix[0], output_axis=matrix[1])


def _flags(tree: Any, mask: Any) -> tuple[list[Any], Any]:
    """(per-leaf mask flags, treedef) of `tree` (MaskedNode counts as a leaf)."""
    leaves, treedef = jax.tree.flatten(tree, is_leaf=_is_masked)
    if mask is None:
        return [jnp.ndim(x) == 2 if not _is_masked(x) else False for x in leaves], treedef
    try:
        return treedef.flatten_up_to(mask), treedef
    except (ValueError, TypeError) as err:
        raise ValueError(f"muon: the mask does not match the params ({err}); fix: build it with "
                         "rules.rotation_mask of the same layout") from None


def muon_labels(mask: Any):
    """`params -> "muon" / "adamw" per leaf` (the partition `muon_adamw` trains with)."""
    def labels(params: Any) -> Any:
        flags, treedef = _flags(params, mask)
        leaves = jax.tree.leaves(params, is_leaf=_is_masked)
        return treedef.unflatten([_MUON if matrix_dims(f, jnp.shape(x)) is not None else _ADAMW
                                  for f, x in zip(flags, leaves)])
    return labels


def _dims(mask: Any):
    """updates (AdamW leaves already MaskedNode) -> MuonDimensionNumbers at the matrices, MaskedNode elsewhere."""
    def dims(updates: Any) -> Any:
        flags, treedef = _flags(updates, mask)
        leaves = jax.tree.leaves(updates, is_leaf=_is_masked)
        return treedef.unflatten([MaskedNode() if _is_masked(x) else matrix_dims(f, jnp.shape(x))
                                  for f, x in zip(flags, leaves)])
    return dims


def _rms_scale(u: Array, dims: MuonDimensionNumbers, rms: float) -> Array:
    fan_in, fan_out = u.shape[dims.reduction_axis], u.shape[dims.output_axis]
    return u * (rms * max(fan_in, fan_out) ** 0.5)


def scale_to_rms(dims_fn, rms: float) -> optax.GradientTransformation:
    """Orthogonalised update `O` of each matrix -> `rms · sqrt(max(fan_in, fan_out)) · O`: an exactly
    orthogonal `O` then has RMS `rms` whatever its shape."""
    def update_fn(updates, state, params=None):
        del params
        out = jax.tree.map(lambda u, d: _rms_scale(u, d, rms), updates, dims_fn(updates),
                           is_leaf=lambda x: isinstance(x, MuonDimensionNumbers))
        return out, state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)


def muon_adamw(learning_rate: optax.ScalarOrSchedule, *, beta: float = 0.95, ns_steps: int = 5,
               nesterov: bool = True, rms: float = 0.2, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
               weight_decay: float = 0.0, mask: Any = None) -> optax.GradientTransformation:
    """Muon on the leaves `mask` marks as (stacked) matrices, `optax.adamw` on the rest (module docstring)."""
    if ns_steps < 1 or not 0.0 <= beta < 1.0 or rms <= 0:
        raise ValueError(f"muon: ns_steps={ns_steps} (>= 1), beta={beta} (in [0, 1)), rms={rms} (> 0); "
                         "fix: e.g. ns_steps=5, beta=0.95, rms=0.2")
    dims = _dims(mask)
    matrices = optax.chain(
        scale_by_muon(ns_steps=ns_steps, beta=beta, eps=eps, nesterov=nesterov, weight_dimension_numbers=dims),
        scale_to_rms(dims, rms),
        optax.add_decayed_weights(weight_decay),
        optax.scale_by_learning_rate(learning_rate),
    )
    rest = optax.adamw(learning_rate, b1, b2, eps, weight_decay=weight_decay)
    return optax.partition({_MUON: matrices, _ADAMW: rest}, muon_labels(mask))
