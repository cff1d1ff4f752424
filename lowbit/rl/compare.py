"""Several rollout settings on the same seeds, prompts and warm start; one figure, one table.

A setting is `rollout[+align][@rac_ratio][+gG][+is][+static-act]`: `bf16`, `fp8`,
`nvfp4-w4a16`, `nvfp4` (naive W4A4), `nvfp4+qat` (asymmetric QAT), `nvfp4+quads` (QAT + RAC at
25%), `nvfp4+quads@0.5`, `nvfp4+quads+g64` (RAC's channels chosen in groups of 64), `nvfp4@1`
(RAC alone), `nvfp4+is` (token-level truncated importance sampling), `nvfp4+static-act` (a
served checkpoint's static activation scales). Each runs in its own folder;
`<out_dir>/compare-<task>/` gets rl.png (reward, held-out accuracy, mean and max log-prob gap
per step) and summary.md / summary.json. Every run's folder is checked before the first run
starts, and with resume an interrupted comparison continues, as `lowbit train --compare`'s
(lowbit.train.compare.check_run_folders).

With seeds (`--seeds 0,1,2`) every setting runs at every seed (runs named `<name>-s<seed>`;
a seed fixes the prompts, the sampling and the warm start, so one seed's runs pair), and
`<folder>/seeds/` gets the paired statistics of `lowbit train --compare`
(lowbit.train.compare.write_comparison) on one metric: the common evaluator's held-out accuracy
(the trainer's weights through a bf16 engine), as its change from the run's own step 0, averaged
over the run's last `window` evaluations up to each one (default 5, `--compare-window`: one
evaluation of a few hundred problems moves by several points from one to the next). The gap to
the first setting is in accuracy points (not %), higher is better. When a setting trains with
asymmetric QAT (`+qat`, `+quads`), every run also scores its weights with NVFP4 weights and
bf16 activations (RLConfig.eval_w4a16: the numerics that QAT trains under, which the bf16
evaluator, reading latent weights, does not see) and `<folder>/seeds-w4a16/` gets the same
statistics on that evaluator.
"""

from __future__ import annotations

import dataclasses
import math
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Sequence

from lowbit.rl.config import RLConfig
from lowbit.rl.plot import plot_rl_runs
from lowbit.rl.trainer import RUN_FILES, RLResult, run_rl
from lowbit.files import write_text_atomic
from lowbit.train.checkpoint import write_json_atomic
from lowbit.train.compare import (RunOutcome, RunSpec, check_run_folders, continue_state, run_all,
                                  stopped_status, write_comparison)
from lowbit.train.runner import NonFiniteLossError
from lowbit.train.metrics import read_metrics
from lowbit.train.run_dir import RunDir

__all__ = ["config_for_setting", "compare_settings", "summary_rows", "format_summary",
           "accuracy_change_curve", "paired_metric", "EVAL_WINDOW", "EVALUATORS", "RLRunner"]

EVAL_WINDOW = 5
"""Evaluations averaged into each point of the paired metric (accuracy_change_curve)."""


EVALUATORS = {"eval/accuracy_bf16": "bf16", "eval/accuracy_w4a16": "W4A16"}
"""The common evaluators' metrics (the trainer's weights through one engine for every run) and
their names in the paired tables."""


def paired_metric(window: int, key: str = "eval/accuracy_bf16") -> str:
    """The paired statistics' metric, in words."""
    over = "" if window == 1 else f", mean of the last {window} evaluations"
    return f"held-out accuracy change from step 0 ({EVALUATORS[key]} evaluator{over})"


def config_for_setting(base: RLConfig, setting: str) -> RLConfig:
    """`base` with the rollout, alignment, RAC ratio, channel group and fold, IS correction and
    activation scale `setting` names: the inverse of RLConfig.setting,
    ROLLOUT[+ALIGN][@RATIO][+gG][+fold][+is[-LEVEL]][+static-act] (`+is` alone is token-level IS)."""
    text = setting.strip()
    scale = "per-token"
    if text.endswith("+static-act"):
        text, scale = text[: -len("+static-act")], "static"
    importance = "none"
    head, sep, level = text.rpartition("+is")
    if sep and (level == "" or level.startswith("-")):
        text, importance = head, level[1:] or "token"
    fold = text.endswith("+fold")
    if fold:
        text = text[: -len("+fold")]
    group = 0
    head, sep, value = text.rpartition("+g")
    if sep and re.fullmatch(r"[1-9][0-9]*", value):
        text, group = head, int(value)
    ratio = None
    if "@" in text:
        text, value = text.split("@", 1)
        try:
            ratio = float(value)
        except ValueError:
            raise ValueError(f"setting {setting!r}: the RAC ratio after @ must be a number") from None
    rollout, _, align = text.partition("+")
    try:
        return dataclasses.replace(base, rollout=rollout, align=align or "none", rac_ratio=ratio,
                                   rac_group=group, rac_fold=fold,
                                   importance_sampling=importance, rollout_activation_scale=scale,
                                   run_name="")
    except ValueError as e:
        raise ValueError(f"--compare setting {setting!r}: {e} (settings are ROLLOUT[+ALIGN]"
                         f"[@RATIO][+gG][+fold][+is[-LEVEL]][+static-act], e.g. nvfp4+quads+g64)") from None


@dataclass(frozen=True)
class RLRunner:
    """Runs an RLConfig with run_rl, for lowbit.train.compare.run_all (a module-level class,
    so that it pickles for parallel runs): the curve is the common evaluator's held-out accuracy
    change from step 0, each point the mean of the last `window` evaluations
    (accuracy_change_curve)."""

    overwrite: bool = False
    resume: bool = False
    """Continue the run (continue_state): a finished one is taken as it is."""
    window: int = EVAL_WINDOW

    def __call__(self, config: RLConfig) -> RunOutcome:
        folder = RunDir(Path(config.out_dir) / config.name, files=RUN_FILES)
        state = continue_state(folder) if self.resume else "start"
        if state != "done":
            try:
                run_rl(config, resume=state == "resume", overwrite=self.overwrite)
            except NonFiniteLossError as e:   # a collapse is a result of the comparison
                outcome = self.partial(config)
                outcome.status = f"diverged at step {e.step} (non-finite loss)"
                return outcome
        result = _result(folder.path)   # --stop-after-minutes may have ended it unfinished
        status = "ok" if state == "done" or folder.finished else stopped_status(result.steps)
        return RunOutcome(accuracy_change_curve(result.records, self.window), status,
                          str(folder.path))

    def partial(self, config: RLConfig) -> RunOutcome:
        run_dir = Path(config.out_dir) / config.name
        records = read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
        return RunOutcome(accuracy_change_curve(records, self.window), "ended early", str(run_dir))


def compare_settings(base: RLConfig, settings: Sequence[str], *, overwrite: bool = False,
                     resume: bool = False, name: str | None = None,
                     seeds: Sequence[int] | None = None, parallel_runs: int = 1,
                     window: int = EVAL_WINDOW) -> tuple[list[RLResult], Path]:
    """Run each setting (at each of `seeds`, else at base.seed), one after another or
    `parallel_runs` at a time, each in a process of its own (lowbit.train.compare.run_all; a
    shared warm start is trained by one of them while the others wait); returns the results
    (a run that stopped early: what it reached) and the summary folder. resume: continue an
    interrupted comparison (finished runs are taken as they are). window: evaluations averaged
    into each point of the paired statistics (accuracy_change_curve)."""
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"the comparison's window is a number of evaluations, 1 or more (got "
                         f"{window!r})")
    plan = []                                                   # (setting, seed, config)
    for seed in (seeds if seeds else [base.seed]):
        for setting in settings:     # every config is made (and refused) before any runs
            config = config_for_setting(dataclasses.replace(base, seed=seed), setting)
            if seeds:
                config = dataclasses.replace(config, run_name=f"{config.name}-s{seed}")
            plan.append((config.setting, seed, config))
    if any(c.align in ("qat", "quads") for _, _, c in plan):
        # a QAT run's trainer multiplies NVFP4 weights: score every run that way too
        plan = [(setting, seed, dataclasses.replace(c, eval_w4a16=True)) for setting, seed, c in plan]
    configs = [c for _, _, c in plan]
    names = [c.name for c in configs]
    if len(settings) < 2 or len(set(names)) != len(names):
        raise ValueError(f"--compare needs two or more distinct settings, got {', '.join(settings)}")
    # the folders as GRPOTrainer keeps them: its files
    folders = [(RunDir(Path(c.out_dir) / c.name, files=RUN_FILES), c) for c in configs]
    check_run_folders(folders, resume=resume, overwrite=overwrite)
    folder = Path(base.out_dir) / (name or f"compare-{base.task}")
    specs = [RunSpec(setting, seed, c.name, c) for setting, seed, c in plan]
    outcomes = run_all(specs, RLRunner(overwrite, resume, window), parallel_runs=parallel_runs,
                       log_dir=folder / "logs", progress=base.progress and parallel_runs > 1)
    results = [_result(Path(c.out_dir) / c.name) for c in configs
               if (Path(c.out_dir) / c.name / "metrics.jsonl").is_file()]
    write_summary([r.run_dir for r in results], folder)
    count = len(seeds) if seeds else 1
    title = f"{base.task}, {count} seed{'s' * (count > 1)}"
    write_comparison(specs, outcomes, folder / "seeds", metric=paired_metric(window), relative=False,
                     higher_is_better=True, title=title)
    key = "eval/accuracy_w4a16"
    records = {Path(r.run_dir): r.records for r in results}   # read once, above
    w4a16 = {name: _w4a16_outcome(accuracy_change_curve(records.get(Path(o.run_dir or ""), []), window, key), o)
             for name, o in outcomes.items()} if configs[0].eval_w4a16 else {}
    if w4a16 and all(w4a16[s.name].curve for s in specs if s.arm == specs[0].arm):   # the baseline has it
        write_comparison(specs, w4a16, folder / "seeds-w4a16", metric=paired_metric(window, key),
                         relative=False, higher_is_better=True, title=f"{title}, W4A16 evaluator")
    elif (folder / "seeds-w4a16").is_dir():   # an earlier comparison's, with QAT settings
        shutil.rmtree(folder / "seeds-w4a16")
    return results, folder


def _w4a16_outcome(curve: list[tuple[int, float]], outcome: RunOutcome) -> RunOutcome:
    """A run's outcome on the W4A16 evaluator: its curve and status; a finished run without the
    curve (it finished before the evaluator existed, or had it turned on at a resume) says so."""
    note = "no W4A16 evaluation from step 0" if outcome.finished and not curve else None
    return RunOutcome(curve, outcome.status, outcome.run_dir, note)


def accuracy_change_curve(records: Sequence[dict], window: int = 1,
                          key: str = "eval/accuracy_bf16") -> list[tuple[int, float]]:
    """A run's (step, its `key` accuracy - that at the run's first evaluation) per evaluation,
    from its metrics records (RLResult.records, or read_metrics of its folder): what the RL did
    to the policy, by an evaluator every run shares (EVALUATORS). window > 1: each point the
    mean of that change over the last `window` evaluations up to it (fewer at the start)."""
    evals = [r for r in records if r["event"] == "eval"]
    if not evals or not isinstance(evals[0].get(key), (int, float)):
        return []   # none, or only from a later step (turned on at a resume): no step 0 to go from
    evals = [r for r in evals if isinstance(r.get(key), (int, float))]
    start = evals[0][key]
    change = [r[key] - start for r in evals]
    curve = []
    for i, r in enumerate(evals):
        last = change[max(0, i - window + 1):i + 1]
        curve.append((r["step"], sum(last) / len(last)))
    return curve


def _result(run_dir: Path) -> RLResult:
    """A run as its folder holds it: final.json's numbers, or, for a run that has not finished,
    the steps, the mean reward of the last (up to) 10 and the held-out accuracy it reached."""
    records = read_metrics(run_dir)
    final = RunDir(run_dir).final_record()
    if final is not None:
        accuracy = final.get("eval_accuracy")
        return RLResult(run_dir, final["steps"], float(final["final_reward"]),
                        None if accuracy is None else float(accuracy), records)
    train = [r for r in records if r["event"] == "train"]
    rewards = [r["reward"] for r in train[-10:] if isinstance(r.get("reward"), (int, float))]
    accuracy = [r["eval/accuracy"] for r in records
                if r["event"] == "eval" and isinstance(r.get("eval/accuracy"), (int, float))]
    return RLResult(run_dir, train[-1]["step"] if train else 0,
                    sum(rewards) / len(rewards) if rewards else math.nan,
                    accuracy[-1] if accuracy else None, records)


def summary_rows(run_dirs: Sequence[Path], last: int = 10) -> list[dict]:
    """Per run: its setting, final reward (mean of the last `last` steps), held-out accuracy
    at its first and last evaluation, and the mean / max log-prob gap and k3 KL over all its steps."""
    rows = []
    for run_dir in run_dirs:
        records = read_metrics(run_dir)
        config = RunDir(run_dir).config_record()
        if config is None:
            raise ValueError(f"{run_dir} has no config.json: it is not a lowbit rl run folder")
        train = [r for r in records if r["event"] == "train"]
        evals = [r for r in records if r["event"] == "eval"]

        w4a16 = [r["eval/accuracy_w4a16"] for r in evals
                 if isinstance(r.get("eval/accuracy_w4a16"), (int, float))]

        def mean(key, rs):
            values = [r[key] for r in rs if isinstance(r.get(key), (int, float))]
            return sum(values) / len(values) if values else math.nan

        rows.append({
            "run": Path(run_dir).name, "setting": RLConfig.from_dict(config).setting,
            "seed": config.get("seed", 0), "steps": len(train),
            "reward_first": mean("reward", train[:last]), "reward_last": mean("reward", train[-last:]),
            "eval_accuracy_first": evals[0]["eval/accuracy"] if evals else math.nan,
            "eval_accuracy": evals[-1]["eval/accuracy"] if evals else math.nan,
            # the common evaluator (the trainer's weights in bf16); runs before it: nan
            "eval_accuracy_bf16_first": evals[0].get("eval/accuracy_bf16", math.nan) if evals else math.nan,
            "eval_accuracy_bf16": evals[-1].get("eval/accuracy_bf16", math.nan) if evals else math.nan,
            # the W4A16 evaluator (eval_w4a16), nan where a run has none
            "eval_accuracy_w4a16_first": w4a16[0] if w4a16 else math.nan,
            "eval_accuracy_w4a16": w4a16[-1] if w4a16 else math.nan,
            "logp_gap_mean": mean("sampling/sampling_logp_difference/mean", train),
            "logp_gap_max": max((r.get("sampling/sampling_logp_difference/max", math.nan) for r in train),
                                default=math.nan),
            "kl_k3": mean("sampling/kl_k3", train),
            "rollout_tokens_per_s": mean("rollout/tokens_per_s", train)})
    return rows


def format_summary(rows: list[dict]) -> str:
    w4a16 = any(math.isfinite(r.get("eval_accuracy_w4a16", math.nan)) for r in rows)
    extra = " held-out acc, W4A16 (first -> last, change) |" if w4a16 else ""
    lines = ["| setting | steps | reward (first 10) | reward (last 10) | held-out acc, own engine "
             f"(first -> last) | held-out acc, bf16 (first -> last, change) |{extra} mean gap | "
             "max gap | k3 KL | rollout tok/s |",
             "| --- | ---: | ---: | ---: | ---: | ---: |" + " ---: |" * w4a16 + " ---: | ---: | ---: | ---: |"]
    seeds = len({r.get("seed", 0) for r in rows}) > 1

    def change(r, key):
        first, last = r.get(f"{key}_first", math.nan), r.get(key, math.nan)
        return f"{first:.3f} -> {last:.3f} ({last - first:+.3f})"

    for r in rows:
        label = f"{r['setting']}, seed {r['seed']}" if seeds else r["setting"]
        cell = f" {change(r, 'eval_accuracy_w4a16')} |" if w4a16 else ""
        lines.append(f"| {label} | {r['steps']} | {r['reward_first']:.3f} | {r['reward_last']:.3f} | "
                     f"{r['eval_accuracy_first']:.3f} -> {r['eval_accuracy']:.3f} | "
                     f"{change(r, 'eval_accuracy_bf16')} |{cell} "
                     f"{r['logp_gap_mean']:.4f} | {r['logp_gap_max']:.3f} | "
                     f"{r['kl_k3']:.2e} | {r['rollout_tokens_per_s']:,.0f} |")
    return "\n".join(lines) + "\n"


def write_summary(run_dirs: Sequence[Path], folder: Path, title: str | None = None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    rows = summary_rows(run_dirs)
    plot_rl_runs(run_dirs, folder / "rl.png", title=title)
    write_text_atomic(folder / "summary.md", format_summary(rows))
    write_json_atomic(folder / "summary.json", rows)
