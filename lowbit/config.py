"""What every config shares: `require`, the one check a config's `__post_init__` makes;
`RunConfig`, the base of the jobs' run configs (`lowbit.train.TrainConfig`, `lowbit.rl.RLConfig`):
their JSON round trip and the rule by which a resume is refused; and `flag`, the one way a
config field declares its command-line flag (`add_flags`, `flag_values`).

Flags. A field that the command line sets declares its flag where it is declared, as Hugging
Face's HfArgumentParser reads them from the dataclass:
    max_steps: int = field(default=300, metadata=flag("--steps", "optimizer steps (default: %(default)s)"))
`add_flags(parser, TrainConfig)` adds one argparse flag per such field, in field order, with
dest the field's name and default None: "not given, the field's default", so that the code can
tell what the user set (a --resume that fills the rest from the saved run, --quick's values
under the given ones); `flag_values(args, TrainConfig)` reads the given ones back. A help's
%(default)s is the field's default.

The resume rule. A run folder's checkpoint holds the config the run started with; a resume
with a config that differs from it in a field that changes the run (its data, model, schedule,
numerics) is refused, naming the fields. Fields in `FREE_ON_RESUME` only decide what is
observed or where files go, and may change. A config saved before a field existed lacks it:
it is compared as `ADDED_LATER`'s value for the field if listed there (the behaviour such runs
had, where the field's default now means something else), else as the field's declared default.
`ADDED_LATER` may nest: a dict value fills in the keys of a dict-valued field that the saved
one has.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import time
import typing
from typing import Any, ClassVar

__all__ = ["RunConfig", "require", "flag", "flag_fields", "add_flags", "flag_values",
           "CALL_STARTED", "call_started", "stop_after_minutes_field",
           "check_stop_after_minutes"]

CALL_STARTED = "LOWBIT_CALL_STARTED"
"""The environment variable holding when the running lowbit command started (time.time()):
set by lowbit.cli.main at its entry, inherited by the processes of parallel runs."""

_IMPORTED = time.time()


def stop_after_minutes_field():
    """The `stop_after_minutes` field every job's config declares (train, QAT, RL), with its
    flag: wall-clock minutes from the command's start (call_started) after which the run stops
    at the end of its step, checkpointed and not finished, for a later --resume; None: no
    limit. Check it with check_stop_after_minutes."""
    return dataclasses.field(default=None, metadata=flag(
        "--stop-after-minutes", "stop M minutes after the command started, at a step's end, "
        "checkpointed; --resume continues (default: no limit)", metavar="M"))


def check_stop_after_minutes(value) -> None:
    """Refuse a time limit that is not a positive number of minutes (None: no limit)."""
    require(value is None or (isinstance(value, (int, float)) and math.isfinite(value) and value > 0),
            f"stop_after_minutes must be a positive number of minutes (got {value!r}); e.g. "
            f"--stop-after-minutes 50")


def call_started() -> float:
    """When this lowbit command started, wall-clock seconds (what a run's --stop-after-minutes
    counts from, as Megatron's --exit-duration-in-mins counts from the job's start): CALL_STARTED
    where the CLI set it, else when lowbit.config was first imported (lowbit used as a library:
    the process's start, near enough)."""
    try:
        return float(os.environ[CALL_STARTED])
    except (KeyError, ValueError):
        return _IMPORTED


def require(condition: bool, message: str) -> None:
    """A ValueError with `message` (one line: what was wrong and what to do) unless `condition`."""
    if not condition:
        raise ValueError(message)


def flag(option: str, help: str, **argparse_options) -> dict:
    """A field's `metadata` declaring its flag: the option, a one-line help (%(default)s: the
    field's default), and add_argument's other options where needed (metavar, choices, action,
    nargs, const, type). A flag with no action or type takes the field's type, which must then
    be int, float or str (or one of them | None)."""
    return {"flag": {"option": option, "help": help, **argparse_options}}


def flag_fields(config_class) -> list[dataclasses.Field]:
    """The fields of `config_class` that declare a flag, in declaration order."""
    return [f for f in dataclasses.fields(config_class) if "flag" in f.metadata]


def add_flags(parser: argparse.ArgumentParser, config_class) -> None:
    """Add the flags `config_class`'s fields declare (see the module docstring)."""
    hints = typing.get_type_hints(config_class)
    for f in flag_fields(config_class):
        options = dict(f.metadata["flag"])
        option, text = options.pop("option"), options.pop("help")
        if "action" not in options and "type" not in options:
            hint = hints[f.name]   # `int | None` is int
            kinds = [t for t in typing.get_args(hint) or [hint] if t is not type(None)]
            if len(kinds) != 1 or kinds[0] not in (int, float, str):
                raise TypeError(f"{config_class.__name__}.{f.name}'s flag needs a type=")
            options["type"] = kinds[0]
        default = ",".join(map(str, f.default)) if isinstance(f.default, tuple) else str(f.default)
        parser.add_argument(option, dest=f.name, default=None,
                            help=text.replace("%(default)s", default.replace("%", "%%")), **options)


def flag_values(args: argparse.Namespace, config_class) -> dict:
    """{field name: value} for the flags of `config_class` given on the command line."""
    return {f.name: getattr(args, f.name) for f in flag_fields(config_class)
            if getattr(args, f.name, None) is not None}


class RunConfig:
    """Base of a job's run config, itself a dataclass (see the module docstring)."""

    FREE_ON_RESUME: ClassVar[frozenset[str]] = frozenset()
    ADDED_LATER: ClassVar[dict[str, Any]] = {}

    def to_dict(self) -> dict:
        """JSON-ready fields (what config.json and the checkpoint hold): tuples become lists."""
        return {k: list(v) if isinstance(v, tuple) else v
                for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls, fields: dict):
        """Inverse of to_dict; an unknown key is an error rather than silently dropped."""
        unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(cls)})
        require(not unknown, f"unknown {cls.__name__} field(s): {', '.join(unknown)}")
        return cls(**fields)

    def changed_fields(self, saved: dict) -> list[str]:
        """The fields in which this config would change the run `saved` (a to_dict of the
        config it started with) describes, with both values, e.g. "lr: 0.001 -> 0.002"."""
        now = self.to_dict()
        declared = {f.name: f.default for f in dataclasses.fields(self)
                    if f.default is not dataclasses.MISSING}
        saved = _with_added_later(saved, self.ADDED_LATER)
        saved = {**{k: declared[k] for k in now if k not in saved and k in declared}, **saved}
        changes = []
        for key in sorted(set(saved) | set(now)):
            if key in self.FREE_ON_RESUME:
                continue
            before, after = saved.get(key, "<absent>"), now.get(key, "<absent>")
            if isinstance(before, tuple):
                before = list(before)
            if before != after:
                changes.append(f"{key}: {before!r} -> {after!r}")
        return changes


def _with_added_later(saved, added):
    """`saved` with the keys of `added` it lacks, at every depth of its dicts: a missing plain
    value is added; a nested dict fills in only where the saved one has that dict (a run's
    qat = None, or no qat at all, is left as it was)."""
    if not isinstance(saved, dict) or not isinstance(added, dict):
        return saved
    out = dict(saved)
    for key, value in added.items():
        if key in out:
            out[key] = _with_added_later(out[key], value)
        elif not isinstance(value, dict):
            out[key] = value
    return out
