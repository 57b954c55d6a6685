"""The device mesh as a type: `MeshShape` parsing, its canonical text, `TrainConfig.mesh` / `.sizes`,
and config.json / run folders that keep the text form."""

import json
from dataclasses import replace

import pytest

from boostjax.config import Config, ConfigError, MeshShape, TrainConfig, mesh_text
from boostjax.runs.folder import RunFolder


@pytest.mark.parametrize("text,shape,canonical", [
    ("data=2,model=4", MeshShape(2, 1, 4), "data=2,model=4"),
    ("model=4,data=2", MeshShape(2, 1, 4), "data=2,model=4"),
    (" data = 2 , model=4 ,", MeshShape(2, 1, 4), "data=2,model=4"),
    ("data=8", MeshShape(8, 1, 1), "data=8,model=1"),
    ("stage=2", MeshShape(1, 2, 1), "data=1,stage=2,model=1"),
    ("data=2,stage=2,model=2", MeshShape(2, 2, 2), "data=2,stage=2,model=2"),
    ("data=1,stage=1,model=2", MeshShape(1, 1, 2), "data=1,model=2"),
])
def test_parse_and_canonical_text(text, shape, canonical):
    m = MeshShape.parse(text)
    assert m == shape and str(m) == canonical and MeshShape.parse(str(m)) == m
    assert m.devices == shape.data * shape.stage * shape.model
    assert m.axes == (("data", "stage", "model") if shape.stage > 1 else ("data", "model"))


def test_empty_text_is_one_device_without_a_mesh():
    assert MeshShape.parse("") is None and MeshShape.parse(" , ") is None
    assert mesh_text(None) == "" and MeshShape().devices == 1


@pytest.mark.parametrize("text", ["data=two", "data=2,data=2", "data=2,model=2,model=2", "gpu=2", "data=0",
                                  "data", "data=-1", "data=²", 5, ["data=2"]])
def test_bad_text_is_one_line_naming_the_field(text):
    with pytest.raises(ConfigError, match=r"^train\.mesh: [^\n]*; fix: [^\n]*$"):
        MeshShape.parse(text)
    with pytest.raises(ConfigError, match=r"^comm\.mesh: "):
        MeshShape.parse(text, "comm.mesh")


def test_train_config_parses_its_mesh_once():
    t = TrainConfig(mesh="data=2,model=2")
    assert t.mesh == MeshShape(2, 1, 2) and t.sizes is t.mesh
    assert TrainConfig(mesh=t.mesh).mesh is t.mesh  # a MeshShape is taken as it is
    assert TrainConfig().mesh is None and TrainConfig(mesh="").mesh is None and TrainConfig().sizes == MeshShape()
    assert replace(t, mesh="stage=2").sizes.stage == 2  # replace() goes through the constructor too
    assert TrainConfig(mesh="data=2") == TrainConfig(mesh="data=2,stage=1,model=1")
    with pytest.raises(ConfigError, match=r"^train\.mesh: unknown axis 'gpu'"):
        TrainConfig(mesh="gpu=2")


def test_config_json_keeps_the_text_and_reads_old_run_folders():
    cfg = Config(train=TrainConfig(mesh="model=2,data=2"))
    d = json.loads(cfg.to_json())
    assert d["train"]["mesh"] == "data=2,model=2" and Config.from_dict(d) == cfg
    assert json.loads(Config().to_json())["train"]["mesh"] == ""
    old = {"model": {}, "train": {"mesh": "model=2,data=2,stage=1"}}  # as an older boostjax wrote it
    assert Config.from_dict(old) == cfg


def test_resume_compares_meshes_and_records_text(tmp_path):
    folder = RunFolder(tmp_path / "run")
    old = Config(train=TrainConfig(mesh="model=2"))
    assert folder.check_resume(old, Config(train=TrainConfig(mesh="data=1,model=2")), resuming=True) == {}
    changes = folder.check_resume(old, Config(train=TrainConfig(mesh="data=2,model=2")), resuming=True)
    assert changes == {"train.mesh": ["data=1,model=2", "data=2,model=2"]}
    json.dumps(changes)  # config_history.jsonl holds it
    assert folder.check_resume(Config(), Config(train=TrainConfig(mesh="data=2")), resuming=False) == {
        "train.mesh": ["", "data=2,model=1"]}


def test_a_mesh_shape_made_in_python_is_checked():
    from boostjax.config import ModelConfig
    from boostjax.training.checks import validate

    for bad in (MeshShape(data=0), MeshShape(model=2.0), MeshShape(stage=True)):
        with pytest.raises(ConfigError, match=r"^train\.mesh: .*fix: "):
            validate(Config(ModelConfig(), TrainConfig(mesh=bad)))


def test_one_mesh_check_reads_a_mesh_shape_or_its_text():
    """`rules.check_mesh_for` (the trainer's and the planner's one mesh check) takes a `MeshShape`, its
    `--mesh` text or None / '' (no mesh), and names the field of an unreadable text; the cost model
    records the same mesh text as the config ('' for one device)."""
    from boostjax.config import DATA, MESH_AXES, MODEL, STAGE, ModelConfig
    from boostjax.offload.costmodel import planned_for
    from boostjax.sharding import mesh as mesh_mod, rules

    assert MESH_AXES == (DATA, STAGE, MODEL) == ("data", "stage", "model")
    assert (rules.DATA, rules.STAGE, rules.MODEL, mesh_mod.DATA) == (DATA, STAGE, MODEL, DATA)
    m = ModelConfig()
    for good, bad in ((MeshShape(data=2, model=2), MeshShape(data=2, model=3)), ("data=2,model=2", "data=2,model=3")):
        rules.check_mesh_for(m, "btp", good, 4, 16)
        with pytest.raises(ConfigError, match=r"^model\.d_model: 128 is not divisible by the TP size 3"):
            rules.check_mesh_for(m, "btp", bad, 4, 16)
    for none in (None, ""):
        rules.check_mesh_for(m, "none", none, 4, 16)
        with pytest.raises(ConfigError, match=r"^plan\.mesh: strategy btp needs a mesh"):
            rules.check_mesh_for(m, "btp", none, 4, 16, "plan")
    with pytest.raises(ConfigError, match=r"^plan\.mesh: unknown axis"):
        rules.check_mesh_for(m, "btp", "gpu=2", 4, 16, "plan")
    key = lambda mesh: dict(planned_for(m, 4, 16, 4, False, "materialized", "btp", mesh))["train.mesh"]  # noqa: E731
    assert key(None) == key("") == key(MeshShape()) == key("data=1,model=1") == ""
    assert key("model=2,data=2") == key(MeshShape(2, 1, 2)) == "data=2,model=2"
