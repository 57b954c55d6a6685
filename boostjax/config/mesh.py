"""The device mesh's shape: `MeshShape`, parsed once from its text ('data=2,model=4') when a
`TrainConfig` is made, and written back as that text (`mesh_text`)."""

from __future__ import annotations

from dataclasses import dataclass

from boostjax.config.fields import flag_of
from boostjax.config.names import DATA, MESH_AXES, MODEL, ConfigError


@dataclass(frozen=True)
class MeshShape:
    """The sizes of the device mesh's axes: `data` (batch rows), `stage` (pipeline stages), `model` (TP)."""

    data: int = 1
    stage: int = 1
    model: int = 1

    @classmethod
    def parse(cls, text: str, field: str = "train.mesh") -> "MeshShape | None":
        """'data=2,model=4' -> MeshShape(2, 1, 4); '' -> None (one device, no mesh). Errors name `field`."""
        if not isinstance(text, str):
            raise ConfigError(f"{field}: must be a string like 'data=2,model=4', got {text!r}; "
                              f"fix: pass e.g. {flag_of('mesh')} data=2,model=4")
        sizes: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            axis, sep, size = (x.strip() for x in part.partition("="))
            if not sep or not (size.isascii() and size.isdigit()) or int(size) < 1:
                raise ConfigError(f"{field}: cannot read {part!r}; fix: write it like data=2,model=4 (sizes >= 1)")
            if axis not in MESH_AXES:
                raise ConfigError(f"{field}: unknown axis {axis!r}; fix: use the axes data, stage and model")
            if axis in sizes:
                raise ConfigError(f"{field}: axis {axis!r} appears twice in {text!r}; fix: give each axis once, "
                                  "e.g. data=4,model=2")
            sizes[axis] = int(size)
        return cls(**sizes) if sizes else None

    def __str__(self) -> str:
        """The canonical text: `data=2,model=4`, or `data=2,stage=2,model=2` (stage shown when > 1)."""
        return ",".join(f"{axis}={getattr(self, axis)}" for axis in self.axes)

    @property
    def devices(self) -> int:
        return self.data * self.stage * self.model

    @property
    def axes(self) -> tuple[str, ...]:
        """The mesh's axis names: `("data", "model")`, or `("data", "stage", "model")` when stage > 1."""
        return MESH_AXES if self.stage > 1 else (DATA, MODEL)


def as_mesh(value: "MeshShape | str | None", field: str = "train.mesh") -> MeshShape | None:
    """A mesh given as a MeshShape, None or its text (parsed here: the one place a mesh string is read)."""
    if value is None or isinstance(value, MeshShape):
        return value
    return MeshShape.parse(value, field)


def mesh_text(mesh: MeshShape | None) -> str:
    """The text of a mesh as config.json and `--mesh` write it ('' = one device, no mesh)."""
    return "" if mesh is None else str(mesh)
