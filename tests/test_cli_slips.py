"""A command line that catches slips: no flag is abbreviated (`--step` is not `--steps`), an unknown flag
names the closest one and the subcommand's help in one line, `boostjax --version`, the commands in a
workflow's order, `train --help` by concern with examples, every flag that needs another says so, and a
flag two commands share has one set of choices. Parse-only (no JAX compile) but for one subprocess."""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from importlib.metadata import version

import pytest

from boostjax.cli import build_parser, main
from boostjax.cli.driver import Parser, suggest
from boostjax.cli.flags import MODEL_FIELDS, TRAIN_FIELDS, TRAIN_GROUPS, check_groups
from boostjax.cli.train import EXAMPLES
from boostjax.config import flag_of
from helpers import ROOT, cli_command, one_error_line

WORKFLOW = ("tokenize", "train", "eval", "generate", "export-hf", "plan", "comm", "launch")


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def _every_parser(parser: argparse.ArgumentParser):
    yield parser
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sub in a.choices.values():
                yield from _every_parser(sub)


def _refused(capsys, argv, *needles) -> str:
    assert main([str(a) for a in argv]) == 2
    return one_error_line(capsys.readouterr().err, *needles)


def _help(command: str, flag: str) -> str:
    action = next(a for a in _subparsers(build_parser())[command]._actions if flag in a.option_strings)
    return " ".join((action.help or "").split())


# ----------------------------------------------------------------------------- abbreviations and typos


def test_no_parser_takes_an_abbreviation(capsys):
    parsers = list(_every_parser(build_parser()))
    assert len(parsers) == 1 + len(WORKFLOW)
    assert all(isinstance(p, Parser) and p.allow_abbrev is False for p in parsers)
    _refused(capsys, ["train", "--step", "3"], "train: unrecognized arguments: --step 3", "did you mean --steps?",
             "fix: see boostjax train --help")
    _refused(capsys, ["eval", "--run", "r", "--data", "d", "--spl", "val"], "--spl", "did you mean --split?")
    _refused(capsys, ["launch", "--num", "2", "--", "train"], "launch: unrecognized arguments: --num",
             "did you mean --num-processes?", "see boostjax launch --help")


def test_launch_refuses_an_abbreviated_train_flag_before_any_process(capsys, monkeypatch):
    import boostjax.runtime.launch

    def never(*a, **k):
        raise AssertionError("a process was started")

    monkeypatch.setattr(boostjax.runtime.launch, "launch_local", never)
    _refused(capsys, ["launch", "-n", "2", "--", "train", "--mesh", "data=2", "--step", "3"],
             "train: unrecognized arguments: --step 3 (did you mean --steps?)", "see boostjax train --help")


def test_a_typo_is_one_line_naming_the_closest_flag_and_the_commands_help(capsys):
    assert main(["train", "--stpes", "10"]) == 2
    assert capsys.readouterr().err == ("boostjax: error: train: unrecognized arguments: --stpes 10 (did you mean "
                                       "--steps?); fix: see boostjax train --help\n")
    for argv, near in ((["tokenize", "--data", "d", "--out", "o", "--tokeniser", "byte"], "--tokenizer"),
                       (["generate", "--run", "r", "--prompt", "p", "--max-tokens", "5"], "--max-new-tokens"),
                       (["export-hf", "--run", "r", "--out", "o", "--max-shard", "1GB"], "--max-shard-size"),
                       (["plan", "--global-bach", "8"], "--global-batch"),
                       (["comm", "--compar", "btp"], "--compare"),
                       (["launch", "--schedular", "slurm"], "--scheduler"),
                       (["train", "--lr=3e-4", "--warmpu=10"], "--warmup")):
        line = _refused(capsys, argv, f"error: {argv[0]}: unrecognized arguments", f"(did you mean {near}?)",
                        f"fix: see boostjax {argv[0]} --help")
        assert line.count("boostjax") == 2, line  # `boostjax: error:` and the help to see, never doubled
    _refused(capsys, ["train", "--bogus-flag-zz"], "unrecognized arguments: --bogus-flag-zz; fix: see boostjax train")


def test_the_suggestion_lists_the_flags_an_abbreviation_starts():
    known = {"--pipeline-delay", "--pipeline-schedule", "--steps", "--seq", "--lr"}
    assert suggest(["--pipe", "2"], known) == " (did you mean --pipeline-delay or --pipeline-schedule?)"
    assert suggest(["--stpes", "3", "--lrr", "1"], known) == " (--stpes: did you mean --steps?, --lrr: did you mean --lr?)"
    assert suggest(["3", "--zzzzzz"], known) == ""


def test_a_bad_choice_names_the_closest_one_and_a_missing_command_names_no_program_twice(capsys):
    _refused(capsys, ["trian"], "error: command: invalid choice", "(did you mean train?)", "see boostjax --help")
    _refused(capsys, ["train", "--optimizer", "adamm"], "train.optimizer: invalid choice", "(did you mean adamw?)")
    line = _refused(capsys, [], "error: command: the following arguments are required: COMMAND")
    assert line.count("boostjax") == 2, line


# ----------------------------------------------------------------------------- --version and --help


def test_version_prints_the_installed_versions():
    out = subprocess.run(cli_command("--version"), capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert out.stdout == f"boostjax {version('boostjax')} (jax {version('jax')}, Python {sys.version.split()[0]})\n"


def test_the_commands_are_listed_in_workflow_order_one_line_each(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    listed = re.findall(r"^    (\S+) +(\S.*)$", capsys.readouterr().out, re.M)
    assert tuple(name for name, _ in listed) == WORKFLOW
    subs = _subparsers(build_parser())
    helps = {a.dest: " ".join(a.help.split()) for a in build_parser()._subparsers._group_actions[0]._choices_actions}
    for name, text in listed:
        assert text == helps[name] and subs[name].prog == f"boostjax {name}", name  # the whole summary, one line


def test_train_help_is_grouped_by_concern_with_examples(capsys):
    check_groups(TRAIN_GROUPS)
    train = _subparsers(build_parser())["train"]
    groups = {g.title: [a.dest for a in g._group_actions] for g in train._action_groups if g._group_actions}
    assert list(groups) == ["options", *TRAIN_GROUPS]
    fields = [d for title, dests in groups.items() if title != "options" for d in dests if d != "preset"]
    assert sorted(fields) == sorted((*MODEL_FIELDS, *TRAIN_FIELDS))  # every field in exactly one group
    commands = [" ".join(c.split("\\\n")) for c in re.findall(r"^  (boostjax train .*?)(?<!\\)$", EXAMPLES, re.M | re.S)]
    assert len(commands) == 3
    for command in commands:
        args = build_parser().parse_args(shlex.split(command)[1:])  # no unknown or abbreviated flag
        assert args.command == "train" and args.out.startswith("runs/")
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert all(f"\n{title}:\n" in out for title in TRAIN_GROUPS) and "examples:\n  # " in out


@pytest.mark.parametrize("groups, needle", [
    ({**TRAIN_GROUPS, "extra": ("steps",)}, "steps is in two groups"),
    ({k: tuple(n for n in v if n != "rank_kv") for k, v in TRAIN_GROUPS.items()}, "rank_kv is in no group"),
    ({**TRAIN_GROUPS, "extra": ("stepz",)}, "stepz is not a field"),
])
def test_a_field_in_no_group_or_two_is_refused(groups, needle):
    with pytest.raises(ValueError, match=needle):
        check_groups(groups)


# ----------------------------------------------------------------------------- flags that need another

# (command, flag): the flags its help must name, because without them it is refused or does nothing
NEEDS = {
    ("train", "--calib-tokens"): ("--init-factor",),
    ("train", "--init-factor"): ("--init-from-hf", "--data"),
    ("train", "--microbatches"): ("--mesh",),
    ("train", "--pipeline-schedule"): ("--mesh",),
    ("train", "--strategy"): ("--mesh",),
    ("train", "--mesh"): ("--strategy",),
    ("train", "--zero"): ("--mesh", "--offload-plan"),
    ("train", "--grad-accum"): ("--offload-plan",),
    ("train", "--offload-plan"): ("--grad-accum", "--zero"),
    ("train", "--coordinator"): ("--num-processes", "--process-id"),
    ("train", "--num-processes"): ("--coordinator", "--process-id", "--mesh"),
    ("train", "--process-id"): ("--coordinator", "--num-processes"),
    ("train", "--rope-factor"): ("--rope-type",),
    ("train", "--rope-low-freq-factor"): ("--rope-type llama3",),
    ("train", "--rope-high-freq-factor"): ("--rope-type llama3",),
    ("train", "--rope-original-max-len"): ("--rope-type llama3",),
    ("train", "--attention-block"): ("--attention chunked",),
    ("train", "--clip-scope"): ("--pipeline-delay", "--optimizer adam8bit"),
    ("train", "--delay-schedule"): ("--pipeline-delay",),
    ("train", "--delay-lr-tc"): ("--optimizer pipedream-lr",),
    ("train", "--nesterov-psi"): ("--optimizer nesterov",),
    ("train", "--stage-aware-refresh"): ("--optimizer rotation", "--pipeline-delay"),
    ("train", "--doc-mask"): ("--data", "--attention cudnn", "--mesh"),
    ("train", "--data-dtype"): ("--data",),
    ("train", "--tie-embeddings"): ("--strategy", "--mesh"),
    **{("train", flag_of(f)): ("--optimizer rotation",) for f in TRAIN_FIELDS if f.startswith("rot_")},
    ("generate", "--top-k"): ("--temperature",),
    ("generate", "--top-p"): ("--temperature",),
    ("generate", "--seed"): ("--temperature",),
    ("launch", "--nodes"): ("--scheduler",),
    ("comm", "--compare"): ("--strategy",),  # its older name
}
# command lines refused for a missing or conflicting partner, and the partner the refusal names
REFUSED = [
    (["train", "--calib-tokens", "100"], "train.calib_tokens", "--init-factor"),
    (["train", "--microbatches", "2"], "train.microbatches", "--mesh"),
    (["train", "--pipeline-schedule", "1f1b"], "train.pipeline_schedule", "--mesh"),
    (["train", "--strategy", "btp"], "train.mesh", "--mesh"),
    (["train", "--mesh", "data=1,model=2"], "train.mesh", "--strategy"),
    (["train", "--coordinator", "127.0.0.1:5000"], "train.num_processes", "--process-id"),
    (["train", "--rope-factor", "2"], "model.rope_factor", "--rope-type"),
    (["train", "--clip-scope", "stage", "--optimizer", "adam8bit"], "train.clip_scope", "--optimizer"),
    (["train", "--init-factor", "whitened"], "train.init_factor", "--data"),
    (["train", "--doc-mask", "--attention", "cudnn", "--dtype", "bfloat16"], "train.doc_mask", "--attention"),
    (["launch", "--nodes", "2", "--", "train"], "launch.nodes", "--scheduler"),
]


def test_a_flag_that_needs_another_says_so_in_its_help():
    for (command, flag), partners in NEEDS.items():
        text = _help(command, flag)
        for partner in partners:
            assert partner in text, (command, flag, partner, text)


@pytest.mark.parametrize("argv, field, partner", REFUSED, ids=[" ".join(a[1:3]) for a, _, _ in REFUSED])
def test_a_flag_without_its_partner_is_refused_naming_it(capsys, tmp_path, argv, field, partner):
    flags = argv if argv[0] == "launch" else [*argv, "--out", tmp_path / "run"]
    _refused(capsys, flags, f"error: {field}:", partner)
    given = [f for f in argv[1:] if f.startswith("--") and f != "--"]
    assert any(partner in _help(argv[0], f) for f in given), (argv, partner)  # the help said so beforehand
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- one flag, one set of choices

# flags two commands share by name with other choices, and why (plan's --attention is the planner's)
OTHER_CHOICES = {("plan", "--attention"): "the cost model's attention memory (materialized/flash), not a kernel"}
HIDDEN = {("comm", "--strategy"): "the older name of --compare (its choices), left out of comm's help"}


def test_a_flag_every_command_shares_has_one_set_of_choices():
    subs = _subparsers(build_parser())
    choices: dict[str, dict[str, tuple | None]] = {}
    for command, parser in subs.items():
        for a in parser._actions:
            for flag in a.option_strings:
                if a.help == argparse.SUPPRESS:
                    assert (command, flag) in HIDDEN, (command, flag)
                elif (command, flag) not in OTHER_CHOICES:
                    choices.setdefault(flag, {})[command] = tuple(a.choices) if a.choices is not None else None
    shared = {flag: by for flag, by in choices.items() if len(by) > 1}
    assert {"--dtype", "--strategy", "--doc-sep", "--progress", "--step", "--attention"} <= set(shared)
    for flag, by in shared.items():
        assert len(set(by.values())) == 1, (flag, by)
    assert set(shared["--dtype"]) == {"train", "plan", "comm", "export-hf"}
    for command, flag in (*OTHER_CHOICES, *HIDDEN):
        assert flag in {s for a in subs[command]._actions for s in a.option_strings}, (command, flag)


@pytest.mark.parametrize("command, said", [
    ("train", "boostjax: train: interrupted before any training step; nothing was saved"),
    ("tokenize", "boostjax: tokenize: interrupted; the output is not finished: run the same command again"),
    ("eval", "boostjax: eval: interrupted"),
])
def test_ctrl_c_before_a_command_has_its_own_handler_names_what_it_means(command, said, capsys):
    from boostjax.cli.driver import run

    parser = argparse.ArgumentParser()
    parser.add_argument("command")

    def interrupted(args):
        raise KeyboardInterrupt

    parser.set_defaults(func=interrupted)
    assert run(parser, [command]) == 130
    assert capsys.readouterr().err.strip() == said
