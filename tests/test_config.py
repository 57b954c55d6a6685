"""Configs: presets, validation (one clear line naming the field and the fix) and the CLI's exit status 2."""

from dataclasses import replace

import pytest

from boostjax.cli import build_parser, main
from boostjax.config import PRESETS, Config, ConfigError, ModelConfig, TrainConfig, preset
from boostjax.training.checks import validate


def test_presets_follow_the_design_table():
    expect = {"60m": (512, 8, 8, 1376, 128), "1b": (2048, 24, 32, 5472, 512), "7b": (4096, 32, 32, 11008, 1024),
              "13b": (5120, 40, 40, 13824, 1280), "30b": (8192, 36, 64, 22016, 2048)}
    for name, (d, layers, heads, f, r) in expect.items():
        m = PRESETS[name]
        assert (m.d_model, m.n_layers, m.n_heads, m.d_ff, m.rank) == (d, layers, heads, f, r)
        assert m.rank == m.d_model // 4
    for name in PRESETS:
        validate(Config(preset(name)))
    assert preset("7b", kind="llama").kind == "llama"


@pytest.mark.parametrize("model,field", [
    (dict(d_model=100, n_heads=8), "model.d_model"),
    (dict(rank=200, d_model=128, auto_dense=False), "model.rank"),
    (dict(rank=0), "model.rank"),
    (dict(rank_kv=-1), "model.rank_kv"),
    (dict(rank_attn=-8), "model.rank_attn"),
    (dict(rank_mlp=400, auto_dense=False), "model.rank_mlp"),
    (dict(kind="lax", rank_kv=64), "model.rank_kv"),
    (dict(kind="lax", rank_kv=16), "model.rank_kv"),
    (dict(n_layers=0), "model.n_layers"),
    (dict(d_ff=-1), "model.d_ff"),
    (dict(n_kv_heads=3), "model.n_kv_heads"),
    (dict(kind="mamba"), "model.kind"),
    (dict(d_model=12, n_heads=4), "model.d_model"),  # odd head_dim: RoPE needs pairs
    (dict(rope_theta=0.0), "model.rope_theta"),
    (dict(rope_theta=float("nan")), "model.rope_theta"),
    (dict(rope_theta=float("inf")), "model.rope_theta"),
    (dict(norm_eps=float("nan")), "model.norm_eps"),
    (dict(init_std=float("inf")), "model.init_std"),
    (dict(d_model="128"), "model.d_model"),
    (dict(max_seq_len=1 << 30), "model.max_seq_len"),
])
def test_invalid_model_configs(model, field):
    with pytest.raises(ConfigError, match=f"^{field}: .*fix: "):
        validate(Config(replace(ModelConfig(), **model)))


@pytest.mark.parametrize("train,field", [
    (dict(steps=0), "train.steps"),
    (dict(batch=-2), "train.batch"),
    (dict(lr=0.0), "train.lr"),
    (dict(dtype="float8"), "train.dtype"),
    (dict(strategy="zero3"), "train.strategy"),
    (dict(seq=8192), "train.seq"),
    (dict(optimizer="sgd"), "train.optimizer"),
    (dict(pipeline_delay=3), "train.pipeline_delay"),
    (dict(delay_schedule="1bw"), "train.delay_schedule"),
    (dict(delay_schedule="2bw", pipeline_delay=2, optimizer="pipedream-lr"), "train.delay_schedule"),
    (dict(delay_schedule="2bw", pipeline_delay=2, optimizer="rotation", stage_aware_refresh=True),
     "train.delay_schedule"),
    (dict(pipeline_schedule="1F1B", mesh="stage=2"), "train.pipeline_schedule"),
    (dict(warmup=50, steps=50), "train.warmup"),
    (dict(rot_beta=1.0), "train.rot_beta"),
    (dict(rot_damping=float("nan")), "train.rot_damping"),
    (dict(rot_order="next"), "train.rot_order"),
    (dict(rot_order="current", rot_source="first"), "train.rot_order"),
    (dict(lr=float("inf")), "train.lr"),
    (dict(lr=float("nan")), "train.lr"),
    (dict(min_lr_ratio=float("nan")), "train.min_lr_ratio"),
    (dict(weight_decay=float("inf")), "train.weight_decay"),
    (dict(b1=float("nan")), "train.b1"),
    (dict(b2=float("nan")), "train.b2"),
    (dict(clip=float("inf")), "train.clip"),
    (dict(rot_beta=float("nan")), "train.rot_beta"),
    (dict(lr="1e-3"), "train.lr"),
    (dict(batch=1 << 20, seq=4096), "train.batch"),
    (dict(init_timeout=0), "train.init_timeout"),
    (dict(seed=-1), "train.seed"),
    (dict(out=""), "train.out"),
])
def test_invalid_train_configs(train, field):
    with pytest.raises(ConfigError, match=f"^{field}: .*fix: "):
        validate(Config(ModelConfig(), replace(TrainConfig(), **train)))


def test_unknown_preset():
    with pytest.raises(ConfigError, match="^preset: unknown preset 'huge'; fix: use one of tiny"):
        preset("huge")


@pytest.mark.parametrize("argv,needle", [
    (["train", "--preset", "huge"], "preset: unknown preset"),
    (["train", "--d-model", "100", "--n-heads", "8"], "model.d_model: 100 is not divisible by n_heads=8"),
    (["train", "--rank", "512"], "model.rank: at these ranks no projection's factors are smaller"),
    (["train", "--rank", "512", "--no-auto-dense"], "model.rank: r=512 exceeds"),
    (["train", "--rank", "0"], "model.rank: must be positive"),
    (["train", "--rank-kv", "-4"], "model.rank_kv: must be >= 0"),
    (["train", "--steps", "0"], "train.steps: must be positive"),
    (["train", "--strategy", "btp", "--mesh", "data=1,model=3", "--steps", "2"], "model.d_model: 128 is not divisible by the TP size 3"),
    (["train", "--data", "/nonexistent/corpus.bin", "--steps", "2"], "no such"),
])
def test_cli_rejects_bad_configs_with_status_2(argv, needle, capsys, tmp_path):
    assert main([*argv, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("boostjax: error: ") and needle in err[0], err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_every_config_field_has_a_flag():
    actions = {a.dest: a for a in build_parser()._subparsers._group_actions[0].choices["train"]._actions}
    for cls in (ModelConfig, TrainConfig):
        for name in cls.__dataclass_fields__:
            assert name in actions, name
    flags = {s for a in actions.values() for s in a.option_strings}
    for required in ("--preset", "--model", "--steps", "--batch", "--seq", "--seed", "--out", "--data",
                     "--ckpt-every", "--log-every", "--strategy", "--mesh", "--optimizer", "--pipeline-delay"):
        assert required in flags


def test_help_lists_commands_and_flags(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "train" in out and "export-hf" in out
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert "--preset" in out and "--ckpt-every" in out and "--d-model" in out


def test_config_json_round_trip():
    cfg = Config(preset("1b", kind="lax"), TrainConfig(steps=7, mesh="data=2,model=4", strategy="btp"))
    assert Config.from_dict(__import__("json").loads(cfg.to_json())) == cfg


def test_literal_fields_are_the_flags_choices():
    """Each set of names is written once (the field's Literal): the tuples and the CLI's choices follow."""
    import typing

    from boostjax import config

    hints = typing.get_type_hints(TrainConfig)
    for name, names in (("strategy", config.STRATEGIES), ("dtype", config.DTYPES), ("remat", config.REMAT),
                        ("optimizer", config.OPTIMIZERS), ("zero", config.ZERO_STAGES),
                        ("pipeline_schedule", config.PIPELINE_SCHEDULES), ("rot_source", config.ROT_SOURCES),
                        ("rot_geometry", config.ROT_GEOMETRIES), ("rot_order", config.ROT_ORDERS), ("data_dtype", config.DATA_DTYPES),
                        ("delay_schedule", config.DELAY_SCHEDULES)):
        assert typing.get_args(hints[name]) == names, name
    assert config.OPTIMIZERS == ("adamw", "rotation", "pipedream-lr", "nesterov", "adam8bit", "muon")
    actions = {a.dest: a for a in build_parser()._subparsers._group_actions[0].choices["train"]._actions}
    assert tuple(actions["strategy"].choices) == config.STRATEGIES and actions["strategy"].type is str
    assert tuple(actions["zero"].choices) == (0, 1, 3) and actions["zero"].type is int
    assert tuple(actions["kind"].choices) == config.MODEL_KINDS
    assert actions["mesh"].choices is None and actions["mesh"].type is str  # TrainConfig parses it


def test_cli_train_validates_and_joins_once(monkeypatch, tmp_path):
    """`boostjax train` checks its config and joins the job once (the CLI does; `train` sees it done)."""
    from boostjax.training import checks
    from boostjax.runtime import multihost
    from boostjax.training import prepare
    from boostjax.training import trainer as train_mod
    from boostjax.config import is_validated

    calls = {"validate": 0, "setup": 0}

    def counting(name, real):
        def wrapped(*a, **k):
            calls[name] += 1
            return real(*a, **k)
        return wrapped

    validate_once = counting("validate", checks.validate)
    monkeypatch.setattr(checks, "validate", validate_once)  # the CLI and `train` call it through the module
    monkeypatch.setattr(multihost, "setup", counting("setup", multihost.setup))

    class Stop(Exception):
        pass

    def stop(cfg):
        raise Stop

    monkeypatch.setattr(prepare, "check_host", stop)  # right after validate and setup: nothing compiled
    with pytest.raises(Stop):
        main(["train", "--steps", "2", "--batch", "2", "--seq", "16", "--out", str(tmp_path / "run")])
    assert calls == {"validate": 1, "setup": 1}
    cfg = Config(ModelConfig(), TrainConfig(out=str(tmp_path / "api")))
    assert not is_validated(cfg)
    with pytest.raises(Stop):
        train_mod.train(cfg)  # the Python API: train validates and joins itself
    assert calls == {"validate": 2, "setup": 2}
    assert is_validated(validate(cfg)) and not is_validated(replace(cfg, train=TrainConfig(out="x")))

