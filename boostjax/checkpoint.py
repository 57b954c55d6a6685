"""Orbax checkpoints of a run: parameters, optimizer state and the data iterator's position.

Saves are asynchronous (training continues while the previous step's arrays are written); the last
`keep` are kept; `latest_step()` is what a restarted run resumes from. The state is saved in the
training layout: per-layer, or with the layers stacked `[L, ...]` under a pipeline (`stage` mesh axis).
"""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import orbax.checkpoint as ocp


def _intify(tree: Any) -> Any:
    """Restored without a target, Orbax gives string keys; layer indices are ints in our dicts."""
    if isinstance(tree, dict):
        return {(int(k) if isinstance(k, str) and k.isdigit() else k): _intify(v) for k, v in tree.items()}
    return tree


class Checkpointer:
    def __init__(self, directory: str | pathlib.Path, *, keep: int = 3, async_save: bool = True):
        self.directory = pathlib.Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=async_save
        )
        self._mgr = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self._mgr.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._mgr.all_steps())

    def save(self, step: int, params: Any, opt_state: Any, data_state: dict) -> None:
        state = {"params": params, "opt_state": opt_state}
        self._mgr.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)),
        )

    def restore(self, step: int, params_like: Any, opt_state_like: Any) -> tuple[Any, Any, dict]:
        """Restore into the structure (and shardings) of `params_like` / `opt_state_like`."""
        target = {"params": params_like, "opt_state": opt_state_like}
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        out = self._mgr.restore(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore()),
        )
        state = out["state"]
        opt_state = jax.tree.unflatten(jax.tree.structure(opt_state_like), jax.tree.leaves(state["opt_state"]))
        return state["params"], opt_state, dict(out["data"])

    def restore_params(self, step: int | None = None) -> dict:
        """Parameters alone, without knowing the optimizer's state: for export and evaluation. Always
        in the canonical per-layer layout (a pipeline run's stacked layers are unstacked)."""
        from boostjax.sharding.pipeline import unstack_layers  # noqa: PLC0415

        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}; fix: train first or pass another --run")
        out = self._mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
        return unstack_layers(_intify(out["state"]["params"]))

    def wait(self) -> None:
        self._mgr.wait_until_finished()

    def close(self) -> None:
        self._mgr.close()
