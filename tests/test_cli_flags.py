"""One way to declare a flag: in the config dataclass's field (lowbit.config.flag). The value
flags of `lowbit train`, `lowbit rl`, `lowbit qat` and `lowbit export` are the fields'
declarations, every declaration is in its command's parser, and what is left as a plain
add_argument call is a job-level flag named here, so that a second style of declaring flags
cannot creep back."""

import argparse
from dataclasses import dataclass, field

import pytest

from lowbit.cli import build_parser
from lowbit.config import add_flags, flag, flag_fields, flag_values
from lowbit.export.cli_args import config_from_args as export_config_from_args
from lowbit.export.config import ExportConfig
from lowbit.qat.cli_args import job_from_args
from lowbit.qat.config import JacQuantConfig, QATConfig
from lowbit.qat.run import QATJob
from lowbit.rl.config import RLConfig
from lowbit.train.config import TrainConfig

# each command: the config classes whose fields declare its flags, and the flags it declares
# itself because they are not config fields
COMMANDS = {
    "train": ((TrainConfig,), {
        "--compare", "--seeds", "--parallel-runs", "--resume", "--overwrite",
        # switches set on every run, even a --resume (never taken from the saved run, as the value
        # flags not given are), and mostly the negation of their field
        "--no-bf16-autocast", "--compile", "--cuda-graph", "--no-diagnostics", "--no-progress"}),
    "rl": ((RLConfig,), {"--compare", "--seeds", "--parallel-runs", "--compare-window", "--quick",
                         "--resume", "--overwrite", "--no-progress"}),
    "qat": ((QATJob, QATConfig, JacQuantConfig), {
        "--compare",   # the arms: QATJob's configs and lr_multipliers, parsed from one text
        # switches that set QATJob's booleans on every run (two of them the field's negation)
        "--resume", "--overwrite", "--no-progress", "--allow-unfinished", "--no-baselines",
        "--baselines-only"}),
    "export": ((ExportConfig,), set()),   # its positional RUN_OR_MODEL is ExportConfig.source
}
# what a command needs to parse at all
REQUIRED = {"export": ["model-folder", "--out", "out"]}


def subparser(name: str) -> argparse.ArgumentParser:
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices[name]


def flags_of(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_is_a_field_declaration_or_a_named_job_flag(command):
    classes, job_flags = COMMANDS[command]
    declared = {f.metadata["flag"]["option"]: f for cls in classes for f in flag_fields(cls)}
    seen = set()
    for action in flags_of(subparser(command)):
        option = action.option_strings[0]
        seen.add(option)
        if option in job_flags:
            assert action.dest not in declared.keys() | {f.name for f in declared.values()}, option
            continue
        assert option in declared, (f"`lowbit {command} {option}` is added by hand; declare it in "
                                    f"its config field with lowbit.config.flag")
        assert action.dest == declared[option].name and action.default is None, option
    assert declared.keys() <= seen, f"declared but not in `lowbit {command}`: {declared.keys() - seen}"
    assert job_flags <= seen, f"named here but gone from `lowbit {command}`: {job_flags - seen}"


@pytest.mark.parametrize("command", COMMANDS)
def test_no_flags_given_means_every_field_at_its_default(command):
    args = subparser(command).parse_args(REQUIRED.get(command, []))
    dests = [a.dest for a in flags_of(subparser(command))]
    assert len(dests) == len(set(dests)), "two flags share a dest"
    for cls in COMMANDS[command][0]:   # export's --out is required: given, to parse at all
        assert flag_values(args, cls) == ({"out": "out"} if cls is ExportConfig else {})


def test_help_shows_the_fields_default():
    help_of = {a.option_strings[0]: a.help for a in flags_of(subparser("train"))}
    assert help_of["--steps"].endswith(f"(default: {TrainConfig.max_steps})")
    assert help_of["--betas"].endswith("(default: 0.9,0.95)")   # as the flag spells it
    help_of = {a.option_strings[0]: a.help for a in flags_of(subparser("qat"))}
    assert help_of["--b-eps"].endswith(f"(default: {JacQuantConfig.eps})")


def test_qat_and_export_build_the_fields_defaults_from_flags_not_given():
    assert job_from_args(subparser("qat").parse_args([])) == QATJob(configs=[QATConfig()])
    job = job_from_args(subparser("qat").parse_args(["--seeds", "2,0", "--run-name", "x",
                                                     "--steps", "7", "--from", "run"]))
    assert (job.seeds, job.name, job.steps, job.source) == ((2, 0), "x", 7, "run")
    config = export_config_from_args(subparser("export").parse_args(REQUIRED["export"]))
    assert config == ExportConfig(source="model-folder", out="out") and config.progress
    config = export_config_from_args(subparser("export").parse_args(
        [*REQUIRED["export"], "--no-progress", "--overwrite", "--calib-batches", "3"]))
    assert (config.progress, config.overwrite, config.calib_batches) == (False, True, 3)


@dataclass
class Toy:
    steps: int = field(default=3, metadata=flag("--steps", "steps (default: %(default)s)"))
    rate: float | None = field(default=None, metadata=flag("--rate", "a rate"))
    quiet: bool = field(default=False, metadata=flag("--quiet", "say less", action="store_true"))
    pair: tuple[int, int] = field(default=(1, 2), metadata=flag("--pair", "(default: %(default)s)",
                                                               type=str))
    label: str = field(default="50%", metadata=flag("--label", "(default: %(default)s)"))
    hidden: int = 0


def test_add_flags_and_flag_values_round_trip():
    parser = argparse.ArgumentParser()
    add_flags(parser, Toy)
    assert [a.dest for a in flags_of(parser)] == ["steps", "rate", "quiet", "pair", "label"]
    assert flag_values(parser.parse_args(["--rate", "0.5", "--quiet"]), Toy) == {"rate": 0.5, "quiet": True}
    assert flag_values(parser.parse_args(["--steps", "7"]), Toy) == {"steps": 7}
    assert "steps (default: 3)" in parser.format_help() and "(default: 1,2)" in parser.format_help()
    assert "(default: 50%)" in parser.format_help()   # a default's % is not a format


def test_a_flag_whose_type_is_not_plain_needs_one():
    @dataclass
    class Pair:
        pair: tuple[int, int] = field(default=(1, 2), metadata=flag("--pair", "two numbers"))

    with pytest.raises(TypeError, match="Pair.pair's flag needs a type="):
        add_flags(argparse.ArgumentParser(), Pair)
