"""JobRecord: what made a run, kept beside its TrainConfig (which says how it trains).

    job.json             {"kind": "qat", "qat": {...QATConfig.to_dict()...},
                          "init_from": "runs/base", "init_fingerprint": "3f2a..."}

train() writes the record into the run folder as job.json and into every checkpoint ("job"),
and `RunDir.open` reads it back (SavedRun.job). A resume checks it as it checks the config
(lowbit.config.RunConfig's rule): the job and its QAT settings must be the ones the run started
with; where the starting weights lie (init_from) may change, the weights themselves may not
(init_fingerprint, checked with its own message by lowbit.train.checkpoint.check_same_start).

Runs written before job records kept the last three as TrainConfig fields, in config.json and
in the checkpoint's config (OLD_CONFIG_KEYS). `JobRecord.of_checkpoint` takes the record from
there when the checkpoint has none, and TrainConfig leaves those keys to it, so such runs open,
export and resume as they did.
"""

from __future__ import annotations

from dataclasses import dataclass

from lowbit.config import RunConfig, require

__all__ = ["JobRecord", "KINDS", "OLD_CONFIG_KEYS", "JOB_FILE"]

KINDS = ("train", "qat")
"""The jobs that run through train(): "train" (`lowbit train`, and train() called from Python or
by lowbit rl's warm start), "qat" (`lowbit qat`)."""

OLD_CONFIG_KEYS = ("qat", "init_from", "init_fingerprint")
"""The fields a run's saved TrainConfig held before job records."""

JOB_FILE = "job.json"


@dataclass(frozen=True)
class JobRecord(RunConfig):
    # Where the starting weights lie may change (a moved source run resumes); their fingerprint
    # is checked on its own, with its own message (check_same_start).
    FREE_ON_RESUME = frozenset({"init_from", "init_fingerprint"})
    # QAT runs saved before these JacQuant options existed ran with them off, in float32, and
    # with B around AdamW's step (resumed as they ran: --no-b-in-adamw)
    ADDED_LATER = {"qat": {"jacquant": {"shuffle_b": False, "b_dtype": "float32", "b_in_adamw": False}}}

    kind: str = "train"
    """The job that made the run, one of KINDS. Part of the run: resume refuses a change."""
    qat: dict | None = None
    """A QAT run's settings (lowbit.qat.QATConfig.to_dict(): weight format, estimator, ...);
    None for other jobs. Part of the run: resume refuses a change."""
    init_from: str | None = None
    """The run folder or Hugging Face folder whose weights the run started from (QAT's --from
    or --model); None: a random init or the model train() was given. Only recorded (the weights
    come from the checkpoint once the run has one)."""
    init_fingerprint: str | None = None
    """SHA-256 of the weights the run started from (lowbit.qat.run.source_fingerprint of
    init_from's); resume refuses other starting weights (check_same_start), so a moved source
    resumes and another one does not. None: not checked."""

    def __post_init__(self) -> None:
        require(self.kind in KINDS, f"job kind must be one of {', '.join(KINDS)} (got {self.kind!r})")
        require((self.qat is not None) == (self.kind == "qat"),
                 f"a job record holds QAT settings exactly when its kind is qat (got kind "
                 f"{self.kind!r} with qat {'set' if self.qat is not None else 'None'})")

    @classmethod
    def of_checkpoint(cls, checkpoint: dict) -> JobRecord:
        """The record a lowbit train or QAT checkpoint holds, or for one written before job
        records, the one its config's old fields (OLD_CONFIG_KEYS) say."""
        if "job" in checkpoint:
            return cls.from_dict(checkpoint["job"])
        saved = checkpoint["config"]
        qat = saved.get("qat")
        return cls("train" if qat is None else "qat", qat, saved.get("init_from"),
                   saved.get("init_fingerprint"))
