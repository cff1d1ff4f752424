"""What every config shares: `require`, the one check a config's `__post_init__` makes, and
`RunConfig`, the base of the jobs' run configs (`lowbit.train.TrainConfig`, `lowbit.rl.RLConfig`):
their JSON round trip and the rule by which a resume is refused.

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

import dataclasses
from typing import Any, ClassVar

__all__ = ["RunConfig", "require"]


def require(condition: bool, message: str) -> None:
    """A ValueError with `message` (one line: what was wrong and what to do) unless `condition`."""
    if not condition:
        raise ValueError(message)


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
