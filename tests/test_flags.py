"""One source for every fact of the configuration and the commands: each config field carries its help,
flag and resume policy (`boostjax.config.option`); every option of every command has real help; the
commands that share a flag share its default and choices; every flag a message names exists; and the
`boostjax` parser builds without importing JAX."""

from __future__ import annotations

import ast
import dataclasses
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from boostjax import config
from boostjax.cli import build_parser
from boostjax.cli.flags import field_help
from boostjax.config import (ConfigError, ModelConfig, TrainConfig, flag_of, help_of, resume_of, validate,
                             validate_model)
from boostjax.runs import folder

ROOT = Path(__file__).resolve().parents[1]
FLAG = re.compile(r"(?<![\w-])--[a-z](?:[a-z0-9-]*[a-z0-9])?(?![\w-])")  # not XLA's `--xla_...`, not `--no-` + ...
RUN_COMMANDS = ("train", "plan", "comm", "eval", "generate")
# Flags two of the RUN_COMMANDS share by name but not by meaning, and why; every other shared flag has one
# default and one set of choices everywhere.
NOT_SHARED = {
    ("comm", "--strategy"): "selects the TP strategies to compare: the three, or all (no 'none')",
    ("plan", "--attention"): "the cost model's attention memory (materialized/flash), not a kernel; train "
                             "checks a plan's against its kernel (boostjax.models.attention.memory_kind)",
    ("plan", "--hardware"): "the GPU the plan prices (default H800-80GB), not the device that measures MFU",
    ("plan", "--out"): "the plan file, not a run folder",
    ("eval", "--batch"): "default: the evaluated run's own --batch",
    ("eval", "--seq"): "default: the evaluated run's own --seq",
    ("eval", "--data"): "the held-out text to evaluate (required), not the training corpus",
}


def _subparsers() -> dict:
    return build_parser()._subparsers._group_actions[0].choices


def _options(command: str) -> dict:
    """{option string: action} of one subcommand (help excluded)."""
    return {s: a for a in _subparsers()[command]._actions if a.dest != "help" for s in a.option_strings}


def _default(action) -> object:
    """What a flag means when it is not given: the config field's default for a flag made from a field
    (their argparse default is None, so a command can tell a given flag), else argparse's."""
    return getattr(action, "config_default", action.default)


# ----------------------------------------------------------------------------- the fields


def test_every_field_says_what_it_is():
    for cls in config.CONFIG_CLASSES:
        for f in dataclasses.fields(cls):
            assert len(help_of(f.name)) > 20 and resume_of(f.name) in config.RESUME_POLICIES, f.name
            shown = field_help(f.name).replace("%%", "%")  # argparse's escape
            assert shown.startswith(help_of(f.name)) and "(default: " in shown, f.name
    assert flag_of("kind") == "--model" and flag_of("d_model") == "--d-model"
    assert config.negated_flag_of("only_lr_act") == "--no-only-lr-act"


def test_the_resume_sets_follow_the_fields():
    """runs/folder derives its sets from the metadata: the same fields as before the metadata existed."""
    assert folder.MUTABLE == {
        "steps", "lr", "min_lr_ratio", "warmup", "weight_decay", "b1", "b2", "clip", "dtype", "out",
        "ckpt_every", "keep_ckpts", "log_every", "eval_every", "eval_batches", "strategy", "mesh",
        "microbatches", "pipeline_schedule", "zero", "remat", "rot_refresh", "rot_beta", "stage_aware_refresh",
        "clip_scope", "offload_plan", "progress", "coordinator", "num_processes", "process_id", "init_timeout",
        "tensorboard", "profile", "hardware", "eval_at_start", "distill_temperature", "distill_weight"}
    assert folder.MUTABLE_MODEL == {"attention", "attention_block", "bos_token_id", "eos_token_ids", "pad_token_id"}
    assert folder.IGNORED == {"out", "progress", "coordinator", "num_processes", "process_id"}
    assert folder.FOLLOW_STORED == {"only_lr_act", "norm_eps", "auto_dense"}
    assert folder.LEGACY_MODEL == {"only_lr_act": False, "auto_dense": False}
    assert folder.FOLLOW_STORED_TRAIN == {"delay_lr_tc", "nesterov_psi", "rot_damping"}
    assert folder.LEGACY_TRAIN == {"nesterov_psi": 0.004, "rot_damping": 0.0}


def test_a_field_without_help_or_with_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="help"):
        config.option(1, " ")
    with pytest.raises(ValueError, match="resume"):
        config.option(1, "a number", resume="sometimes")


# ----------------------------------------------------------------------------- the commands


def test_every_option_of_every_command_has_help():
    for command, sub in _subparsers().items():
        for action in sub._actions:
            text = " ".join((action.help or "").split())
            bare = re.sub(r"\(default: [^)]*\)", "", text).strip(" .;")
            assert len(bare) >= 8, f"{command} {'/'.join(action.option_strings) or action.dest}: help {text!r}"


def test_commands_that_share_a_flag_share_its_default_and_choices():
    options = {c: _options(c) for c in RUN_COMMANDS}
    shared = 0
    for i, a in enumerate(RUN_COMMANDS):
        for b in RUN_COMMANDS[i + 1:]:
            for flag in options[a].keys() & options[b].keys():
                if (a, flag) in NOT_SHARED or (b, flag) in NOT_SHARED:
                    continue
                x, y = options[a][flag], options[b][flag]
                assert (_default(x), x.choices, x.type) == (_default(y), y.choices, y.type), (a, b, flag)
                if hasattr(x, "config_default") and hasattr(y, "config_default"):
                    assert x.help == y.help, (a, b, flag)  # built from the same field
                shared += 1
    assert shared >= 25
    for (command, flag) in NOT_SHARED:
        assert flag in options[command] and flag in options["train"], (command, flag)
    train, plan, comm = options["train"], options["plan"], options["comm"]
    for flag, value in (("--preset", "tiny"), ("--batch", 16), ("--seq", 128), ("--dtype", "float32"),
                        ("--optimizer", "adamw"), ("--mesh", ""), ("--strategy", "none")):
        assert _default(train[flag]) == _default(plan[flag]) == value, flag
    assert set(plan["--optimizer"].choices) == set(config.OPTIMIZERS)  # every optimizer train takes
    for flag, value in (("--preset", "tiny"), ("--batch", 16), ("--seq", 128), ("--dtype", "float32"),
                        ("--mesh", ""), ("--model", "cola"), ("--remat", "none")):
        assert _default(comm[flag]) == value, flag


def test_the_parser_builds_without_jax():
    code = "import boostjax.cli, sys; boostjax.cli.build_parser(); print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "False", out.stderr


# ----------------------------------------------------------------------------- flags in messages


def _strings(path: Path) -> list[tuple[int, str]]:
    return [(n.lineno, n.value) for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def test_config_messages_name_real_train_flags():
    train = set(_options("train"))
    named = {m for path in sorted((ROOT / "boostjax" / "config").glob("*.py"))
             for _, s in _strings(path) for m in FLAG.findall(s)}
    assert named and named <= train, sorted(named - train)
    for cls in config.CONFIG_CLASSES:
        for f in dataclasses.fields(cls):
            assert flag_of(f.name) in train, f.name


def _bad_values(value):
    if isinstance(value, bool):
        return [3]
    if isinstance(value, int):
        return [-(1 << 62), -2, -1, 0, 3, 1 << 40, "1"]
    if isinstance(value, float):
        return [-1.0, 0.0, 2.0, math.nan, math.inf]
    return [3, "", "x", "1:1", "128001,x"]


def test_every_refusal_names_real_train_flags():
    """Trigger the checks field by field (wrong types, signs, sizes, names): every flag a message names
    is an option of `boostjax train`; `--model` for the kind (never `--kind`)."""
    train = set(_options("train"))
    seen = 0
    for f in dataclasses.fields(ModelConfig):
        for bad in _bad_values(f.default):
            try:
                validate_model(dataclasses.replace(ModelConfig(), **{f.name: bad}))
            except ConfigError as e:
                named = set(FLAG.findall(str(e)))
                assert named <= train, (f.name, bad, str(e))
                seen += bool(named)
    for f in dataclasses.fields(TrainConfig):
        for bad in _bad_values(config.field_default(f.name)):
            try:
                validate(config.Config(ModelConfig(), dataclasses.replace(TrainConfig(), **{f.name: bad})))
            except (ConfigError, TypeError) as e:
                named = set(FLAG.findall(str(e)))
                assert named <= train, (f.name, bad, str(e))
                seen += bool(named)
    assert seen > 100
    with pytest.raises(ConfigError, match="fix: pass --model TEXT"):
        validate_model(ModelConfig(kind=3))
    with pytest.raises(ConfigError, match="fix: pass --model with one of llama"):
        validate_model(ModelConfig(kind="mamba"))


def test_every_flag_the_library_names_is_an_option_of_a_command():
    known = {s for c in _subparsers() for s in _options(c)} | {s for a in build_parser()._actions
                                                                for s in a.option_strings}  # --help, --version
    bad = [f"{p.relative_to(ROOT)}:{line}: {m}" for p in sorted((ROOT / "boostjax").rglob("*.py"))
           for line, s in _strings(p) for m in FLAG.findall(s) if m not in known and not m.startswith("--no-")]
    assert not bad, "flags no command has:\n" + "\n".join(bad)
