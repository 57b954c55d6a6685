"""`Config`: the model and training config of one job and its config.json form; the two classes'
fields registered by name (`CONFIG_CLASSES`), and a field's default as the command line writes it."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from boostjax.config.fields import config_field, register
from boostjax.config.mesh import mesh_text
from boostjax.config.model import ModelConfig
from boostjax.config.train import TrainConfig

CONFIG_CLASSES: tuple[type, ...] = register(ModelConfig, TrainConfig)


def field_default(name: str) -> Any:
    """The default of a field as the command line writes it (the mesh as its text)."""
    f = config_field(name)
    return mesh_text(f.default) if name == "mesh" else f.default


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values: the mesh as its text (config.json), '' for one device."""
        d = dataclasses.asdict(self)
        d["train"]["mesh"] = mesh_text(self.train.mesh)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Config":
        return cls(model=ModelConfig(**d.get("model", {})), train=TrainConfig(**d.get("train", {})))
