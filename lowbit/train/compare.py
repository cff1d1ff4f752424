"""Compare runs that differ in one thing (the *arm*: a recipe, a QAT estimator, ...) over
paired seeds: every arm at every seed, the gap of each arm to the baseline (the first arm)
seed by seed, its mean and standard deviation, and which gaps stand out of the seed noise.

The comparison itself knows nothing about training. It takes run specs and a runner:

    specs = [RunSpec(arm="bf16", seed=0, name="cmp-bf16-s0", config=...), ...]
    result = compare_runs(specs, runner, summary_dir, parallel_runs=4)

- `RunSpec.config` is whatever the runner takes (a TrainConfig here); `runner(config)` runs
  one run and returns a `RunOutcome`: its evaluation curve [(step, value), ...] (lower is
  better) and a status ("ok", or why it ended early: a diverged run is a result, not an
  error). With parallel_runs > 1 each run is a process of its own (multiprocessing's spawn),
  so the runner and the configs must pickle: a module-level function, or an instance of a
  module-level class. Its output goes to `<summary_dir>/logs/<name>.log`.
- A runner may have `partial(config) -> RunOutcome`: what is left of a run stopped at the
  deadline (its evaluations so far). Without it such a run has no curve.
- Runs of the same seed must see the same data in the same order; that is the runner's
  config to ensure (for training, TrainConfig.seed fixes the init and the data order).

The statistics (`seed_statistics`), at the step compared: the last evaluation step that every
run that did not end early reached (the final step when all finished).
- gap_s = (value[arm, s] - value[baseline, s]) / value[baseline, s] * 100, for each seed s
  at which both runs have a value at that step (paired seeds); or, for a comparison with
  relative=False (a metric near zero, such as an accuracy's change from step 0), the plain
  difference value[arm, s] - value[baseline, s] in the metric's units (the `*_pct` fields
  then hold those units, Comparison.relative says which);
- mean and sample standard deviation (n - 1) of gap_s over those n seeds;
- the criterion, "the difference exceeds the seed spread": a two-sided paired t-test at 95%,
  i.e. |mean| > t(0.975, n - 1) * sd / sqrt(n), which is the 95% confidence interval of the
  mean gap excluding 0 (t(0.975, 2) = 4.30 for three seeds). Then the arm is "worse" or
  "better" than the baseline (lower is better, as for a loss, unless higher_is_better);
  else "within noise"; with one seed no verdict;
- the baseline's seed spread: the sample standard deviation of the baseline's own values over
  seeds, in % of their mean, and whether an arm is within it on every seed
  (max_s |gap_s| <= spread).

Writes to `summary_dir`: summary.md (both tables and the criterion), summary.json (every
run's curve and status, the statistics) and seeds.png (the gap to the baseline per evaluation
step: the mean over seeds, and a band of +- one standard deviation).

`compare(configs)` is `lowbit train --compare R1,R2 --seeds 0,1,2`: the same over training
runs (`TrainRunner`), with loss.png of all the runs beside.

Run folders, for every job that compares runs (`lowbit train`, `lowbit qat` and `lowbit rl`
--compare): `check_run_folders` checks each run's folder before the first run starts, so no
run is refused after others have trained, and says what each run does. With resume, an
interrupted comparison continues (`continue_state`): a finished run (final.json) is taken as
it is, an unfinished one resumes from its checkpoint, one not begun yet starts.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Callable, Sequence

from tqdm import tqdm

from lowbit.recipes import quantizes
from lowbit.train.build import resolve_recipe
from lowbit.files import write_text_atomic
from lowbit.train.checkpoint import write_json_atomic
from lowbit.train.config import TrainConfig
from lowbit.train.job_record import JobRecord
from lowbit.train.loop import train
from lowbit.train.runner import NonFiniteLossError
from lowbit.train.metrics import read_metrics
from lowbit.train.plot import plot_gap_bands, plot_runs
from lowbit.train.run_dir import RunDir

__all__ = ["RunSpec", "RunOutcome", "ArmStats", "CompareRow", "Comparison", "compare_runs",
           "write_comparison", "run_all", "seed_statistics", "format_table", "TrainRunner", "compare",
           "t_critical", "val_curve", "check_runs", "check_run_folders", "continue_state",
           "parse_seeds", "stopped_status"]

# What may differ between the training runs of a comparison; everything else must match, or the
# curves would differ for reasons other than the recipe (the seed pairs the runs).
# Diagnostics only observe (FIELDS_FREE_ON_RESUME), so one seed may take them and others not.
_MAY_DIFFER = frozenset({"recipe", "seed", "run_name", "progress", "diagnostics", "diag_every"})


# ---- the generic part ---------------------------------------------------------------------

@dataclass(frozen=True)
class RunSpec:
    arm: str
    """What is compared (a recipe name, say); the first arm of the specs is the baseline."""
    seed: int
    """Runs of one seed are paired: same data, same order."""
    name: str
    """Unique among the specs: the run's folder and log name, and its label."""
    config: Any = None
    """What the runner takes."""


@dataclass
class RunOutcome:
    curve: list[tuple[int, float]]
    """(step, value) per evaluation, in step order (a validation loss, say)."""
    status: str = "ok"
    """"ok" (ran to the end), or why it ended early, e.g. "diverged at step 40"."""
    run_dir: str | None = None
    note: str | None = None
    """Something the tables say beside the status, e.g. an evaluator the run lacks."""

    @property
    def finished(self) -> bool:
        return self.status == "ok"

    @property
    def label(self) -> str:
        """The status as the tables print it: with the note, if any."""
        return self.status if self.note is None else f"{self.status}; {self.note}"


@dataclass
class CompareRow:
    """One run at the step compared."""

    run: str
    arm: str
    seed: int
    value: float | None
    """The run's value at the step compared; None where it has none (ended early)."""
    gap_pct: float | None
    """(value - the same seed's baseline value) / that baseline value * 100; with
    Comparison.relative False, value - the baseline value."""
    status: str


@dataclass
class ArmStats:
    arm: str
    seeds: list[int]
    """The paired seeds: both this arm and the baseline have a value at the step compared."""
    gaps_pct: list[float]
    """The gap at each of those seeds."""
    mean_pct: float | None
    std_pct: float | None
    """Sample standard deviation (n - 1); None with fewer than two seeds."""
    ci95_pct: tuple[float, float] | None
    """The 95% confidence interval of the mean gap (t distribution, n - 1 degrees of freedom)."""
    verdict: str
    """"worse" / "better" (the interval excludes 0), "within noise", "one seed", "no pairs"."""
    within_spread_every_seed: bool | None
    """max |gap_s| <= the baseline's seed spread; None without a spread."""
    runs_ended_early: int


@dataclass
class Comparison:
    metric: str
    step: int | None
    """The step compared (see the module doc)."""
    baseline: str
    baseline_spread_pct: float | None
    """The baseline's sample standard deviation over seeds, in % of its mean."""
    rows: list[CompareRow]
    arms: list[ArmStats]
    outcomes: dict[str, RunOutcome]
    figure: Path
    table: Path
    extra_figures: list[Path] = field(default_factory=list)
    relative: bool = True
    """Gaps in % of the baseline's value; False: in the metric's own units."""
    higher_is_better: bool = False
    """An accuracy (True) or a loss (False): which sign of the gap is "better"."""


# Two-sided 95% quantiles of Student's t, t(0.975, df), df = 1..30 (standard tables).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)

CRITERION = ("a difference exceeds the seed spread when a two-sided paired t-test over the "
             "seeds rejects a zero mean gap at 95%: |mean| > t(0.975, n-1) * sd / sqrt(n)")


def t_critical(df: int) -> float:
    """t(0.975, df); past 30 degrees of freedom the normal quantile 1.960 (slightly liberal)."""
    if df < 1:
        raise ValueError(f"a t quantile needs at least one degree of freedom, got {df}")
    return _T975[df - 1] if df <= len(_T975) else 1.960


def check_specs(specs: Sequence[RunSpec]) -> tuple[list[str], list[int]]:
    """(arms, seeds) in order of first appearance; refuses fewer than two arms, a run name used
    twice, or a grid with a hole (every arm must run at every seed, or seeds do not pair)."""
    arms = list(dict.fromkeys(s.arm for s in specs))
    seeds = list(dict.fromkeys(s.seed for s in specs))
    if len(arms) < 2:
        raise ValueError(f"a comparison needs at least two different arms (recipes, estimators, ...), "
                         f"got {arms}")
    names = [s.name for s in specs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"each run of a comparison needs its own name; {', '.join(twice)} "
                         f"is used twice")
    grid = {(s.arm, s.seed) for s in specs}
    missing = [f"{a} at seed {s}" for a in arms for s in seeds if (a, s) not in grid]
    if missing or len(grid) != len(specs):
        raise ValueError(f"every arm must run once at every seed, so the seeds pair; "
                         f"{'missing: ' + ', '.join(missing) if missing else 'an arm and seed repeat'}")
    return arms, seeds


def compare_runs(specs: Sequence[RunSpec], runner: Callable[[Any], RunOutcome],
                 summary_dir: str | Path, *, parallel_runs: int = 1,
                 deadline_s: float | None = None, metric: str = "val loss",
                 title: str | None = None, progress: bool = True) -> Comparison:
    """Run every spec (see the module doc), then write the statistics, tables and figure.

    parallel_runs: how many runs at once, each in a process of its own (1: one after another
        in this process). deadline_s: seconds from now after which runs still going are stopped
        (processes only); their curves so far come from runner.partial, if it has one.
    """
    check_specs(specs)
    summary_dir = Path(summary_dir)
    outcomes = run_all(specs, runner, parallel_runs=parallel_runs, deadline_s=deadline_s,
                       log_dir=summary_dir / "logs", progress=progress)
    return write_comparison(specs, outcomes, summary_dir, metric=metric, title=title)


def write_comparison(specs: Sequence[RunSpec], outcomes: dict[str, RunOutcome],
                     summary_dir: str | Path, *, metric: str = "val loss",
                     title: str | None = None, relative: bool = True,
                     higher_is_better: bool = False) -> Comparison:
    """The statistics of runs already run (outcomes by spec name), written to summary_dir:
    summary.md, summary.json and seeds.png (see the module doc)."""
    arms, seeds = check_specs(specs)
    summary_dir = Path(summary_dir)
    step, rows, stats, spread = seed_statistics(specs, outcomes, relative, higher_is_better)
    summary_dir.mkdir(parents=True, exist_ok=True)
    table = summary_dir / "summary.md"
    comparison = Comparison(metric, step, arms[0], spread, rows, stats, outcomes,
                            summary_dir / "seeds.png", table, relative=relative,
                            higher_is_better=higher_is_better)
    write_text_atomic(table, format_table(comparison))
    write_json_atomic(summary_dir / "summary.json", _to_json(comparison))
    curves = {a: {s.seed: outcomes[s.name].curve for s in specs if s.arm == a} for a in arms}
    plot_gap_bands(curves, comparison.figure, metric=metric,
                   title=title or f"{len(seeds)} seed{'s' * (len(seeds) > 1)}", relative=relative)
    return comparison


def run_all(specs: Sequence[RunSpec], runner: Callable[[Any], RunOutcome], *,
            parallel_runs: int = 1, deadline_s: float | None = None,
            log_dir: str | Path | None = None, progress: bool = True) -> dict[str, RunOutcome]:
    """{spec.name: the runner's outcome}, one run after another or parallel_runs at a time."""
    if not isinstance(parallel_runs, int) or parallel_runs < 1:
        raise ValueError(f"parallel runs must be a positive integer (got {parallel_runs!r})")
    if parallel_runs == 1:
        outcomes = {}
        for spec in tqdm(specs, desc="runs", unit="run", disable=not progress):
            outcomes[spec.name] = runner(spec.config)
        return outcomes
    if log_dir is None:
        raise ValueError("parallel runs need a log_dir for their output")
    return _run_processes(specs, runner, parallel_runs, deadline_s, Path(log_dir), progress)


def _run_processes(specs, runner, parallel_runs, deadline_s, log_dir: Path, progress):
    log_dir.mkdir(parents=True, exist_ok=True)
    context = multiprocessing.get_context("spawn")  # CUDA cannot be forked into children
    deadline = None if deadline_s is None else time.monotonic() + deadline_s
    threads = max(1, (os.cpu_count() or 1) // parallel_runs)
    waiting, running, outcomes = list(specs), {}, {}
    bar = tqdm(total=len(specs), desc=f"runs ({parallel_runs} at a time)", unit="run",
               disable=not progress)
    try:
        while waiting or running:
            while waiting and len(running) < parallel_runs:
                spec = waiting.pop(0)
                receive, send = context.Pipe(duplex=False)
                process = context.Process(target=_child, name=spec.name, args=(
                    runner, spec.config, str(log_dir / f"{spec.name}.log"), threads, send))
                process.start()
                send.close()
                running[spec.name] = (spec, process, receive)
            for name, (spec, process, receive) in list(running.items()):
                if receive.poll():
                    outcomes[name] = _received(receive, log_dir / f"{name}.log")
                elif process.is_alive():
                    continue
                else:
                    outcomes[name] = RunOutcome([], f"failed: the process exited with code "
                                                    f"{process.exitcode}; see {log_dir / name}.log")
                process.join()
                del running[name]
                bar.update(1)
            if deadline is not None and time.monotonic() > deadline:
                for name, (spec, process, _) in running.items():
                    process.terminate()
                    process.join()
                    outcomes[name] = _stopped(runner, spec)
                    bar.update(1)
                for spec in waiting:
                    outcomes[spec.name] = RunOutcome([], "not started before the deadline")
                running, waiting = {}, []
            time.sleep(0.2)
    finally:
        for _, process, _ in running.values():   # interrupted: leave no orphans
            process.terminate()
        bar.close()
    return {spec.name: outcomes[spec.name] for spec in specs}


def _child(runner, config, log_path: str, threads: int, send) -> None:
    """A run in its own process: output to its log, the outcome (or the error) to the pipe."""
    import torch

    torch.set_num_threads(threads)  # the parallel runs share the cores
    with open(log_path, "w", buffering=1) as log:
        sys.stdout = sys.stderr = log
        try:
            send.send(("ok", runner(config)))
        except BaseException as e:  # reported to the parent, which decides
            traceback.print_exc(file=log)
            send.send(("error", f"{type(e).__name__}: {e}"))


def _received(receive, log_path: Path) -> RunOutcome:
    kind, payload = receive.recv()
    if kind == "ok":
        return payload
    return RunOutcome([], f"failed: {payload.splitlines()[0] if payload else ''} (see {log_path})")


def _stopped(runner, spec: RunSpec) -> RunOutcome:
    partial = getattr(runner, "partial", None)
    outcome = partial(spec.config) if partial is not None else RunOutcome([])
    outcome.status = "stopped at the deadline"
    return outcome


def seed_statistics(specs: Sequence[RunSpec], outcomes: dict[str, RunOutcome],
                    relative: bool = True, higher_is_better: bool = False):
    """(step compared, a CompareRow per run, an ArmStats per arm but the baseline, the baseline's
    seed spread): the module doc's definitions; relative False takes gaps and the spread in
    the metric's units."""
    arms, seeds = check_specs(specs)
    # the step: the last one every run that was not cut short (diverged/failed) reached
    candidates = [o for o in outcomes.values() if o.finished or o.status.startswith("stopped at")]
    steps = [set(s for s, _ in o.curve) for o in candidates if o.curve]
    step = max(set.intersection(*steps)) if steps and set.intersection(*steps) else None
    value = {}
    for spec in specs:
        at = dict(outcomes[spec.name].curve)
        v = at.get(step)
        value[spec.arm, spec.seed] = v if v is not None and math.isfinite(v) else None
    base = arms[0]
    rows = []
    for spec in specs:
        v, b = value[spec.arm, spec.seed], value[base, spec.seed]
        rows.append(CompareRow(spec.name, spec.arm, spec.seed, v, _gap(v, b, relative),
                               outcomes[spec.name].label))
    base_values = [value[base, s] for s in seeds if value[base, s] is not None]
    spread = None
    if len(base_values) >= 2:
        mean = sum(base_values) / len(base_values)
        spread = _std(base_values) / mean * 100 if relative else _std(base_values)
    stats = []
    for arm in arms[1:]:
        paired = [(s, _gap(value[arm, s], value[base, s], relative)) for s in seeds
                  if value[arm, s] is not None and value[base, s] is not None]
        gaps = [g for _, g in paired]
        n = len(gaps)
        mean = sum(gaps) / n if n else None
        std = _std(gaps) if n >= 2 else None
        ci = verdict = None
        if n == 0:
            verdict = "no pairs"
        elif n == 1:
            verdict = "one seed"
        else:
            half = t_critical(n - 1) * std / math.sqrt(n)
            ci = (mean - half, mean + half)
            above, below = ("better", "worse") if higher_is_better else ("worse", "better")
            verdict = above if ci[0] > 0 else below if ci[1] < 0 else "within noise"
        within = None if spread is None or not gaps else max(abs(g) for g in gaps) <= spread
        ended = sum(1 for s in specs if s.arm == arm and not outcomes[s.name].finished)
        stats.append(ArmStats(arm, [s for s, _ in paired], gaps, mean, std, ci, verdict, within,
                              ended))
    return step, rows, stats, spread


def _gap(value: float | None, base: float | None, relative: bool = True) -> float | None:
    if value is None or base is None or (relative and base == 0):
        return None
    return (value - base) / base * 100 if relative else value - base


def _std(values: Sequence[float]) -> float:
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def format_table(c: Comparison) -> str:
    """summary.md: the gaps over seeds, then every run; gaps relative to the first arm (or,
    for c.relative False, differences in the metric's units)."""
    unit, digits = ("%", 2) if c.relative else ("", 4)

    def gap(v, sign="+"):
        return "—" if v is None else f"{v:{sign}.{digits}f}{unit}"

    seeds = list(dict.fromkeys(row.seed for row in c.rows))
    definition = (f"({c.metric} - the same seed's {c.baseline}) / {c.baseline} in %" if c.relative
                  else f"{c.metric} - the same seed's {c.baseline}")
    better = "higher" if c.higher_is_better else "lower"
    lines = [f"{c.metric} at step {c.step} (the last evaluation every run that did not end "
             f"early reached; {better} is better); gap = {definition}, over {len(seeds)} "
             f"paired seed{'s' * (len(seeds) > 1)} ({', '.join(map(str, seeds))}).", "",
             f"| arm | gap vs {c.baseline}: mean ± sd | 95% CI | per seed | verdict | "
             f"within {c.baseline}'s seed spread on every seed |",
             "| --- | ---: | ---: | ---: | --- | --- |"]
    for a in c.arms:
        mean = gap(a.mean_pct) + ("" if a.std_pct is None else f" ± {gap(a.std_pct, '')}")
        ci = "—" if a.ci95_pct is None else f"[{gap(a.ci95_pct[0])}, {gap(a.ci95_pct[1])}]"
        per_seed = " / ".join(gap(g) for g in a.gaps_pct) or "—"
        within = {None: "—", True: "yes", False: "no"}[a.within_spread_every_seed]
        ended = f" ({a.runs_ended_early} ended early)" if a.runs_ended_early else ""
        lines.append(f"| {a.arm} | {mean} | {ci} | {per_seed} | {a.verdict}{ended} | {within} |")
    spread = gap(c.baseline_spread_pct, "")
    of_mean = ", in % of the mean" if c.relative else ""
    lines += ["", f"Criterion: {CRITERION}. Seed spread of {c.baseline}: {spread} (sample sd of "
              f"its {c.metric} over the seeds{of_mean}).", "",
              f"| run | arm | seed | {c.metric} | gap vs {c.baseline} | status |",
              "| --- | --- | ---: | ---: | ---: | --- |"]
    for row in c.rows:
        value = "—" if row.value is None else f"{row.value:.4f}"
        lines.append(f"| {row.run} | {row.arm} | {row.seed} | {value} | {gap(row.gap_pct)} | "
                     f"{row.status} |")
    return "\n".join(lines) + "\n"


def _to_json(c: Comparison) -> dict:
    return {"metric": c.metric, "step": c.step, "baseline": c.baseline,
            "relative": c.relative, "higher_is_better": c.higher_is_better,
            "baseline_spread_pct": c.baseline_spread_pct, "criterion": CRITERION,
            "arms": [asdict(a) for a in c.arms], "rows": [asdict(r) for r in c.rows],
            "runs": {name: {"status": o.label, "run_dir": o.run_dir,
                            "curve": [[s, v] for s, v in o.curve]}
                     for name, o in c.outcomes.items()}}


# ---- training runs: lowbit train --compare ------------------------------------------------

@dataclass(frozen=True)
class TrainRunner:
    """Runs a TrainConfig with lowbit.train.train; the curve is its validation loss.

    diagnostics_fn: train()'s, for the configs whose `diagnostics` is on and that quantize
    (e.g. lowbit.diagnostics.training.per_layer_training_diagnostics); a module-level function,
    so that it pickles for parallel runs. None: train()'s own diagnostics."""

    overwrite: bool = False
    diagnostics_fn: Callable | None = None
    resume: bool = False
    """Continue the run (continue_state): a finished one is taken as it is."""

    def __call__(self, config: TrainConfig) -> RunOutcome:
        diagnostics_fn = (self.diagnostics_fn if config.diagnostics and quantizes(config.recipe)
                          else None)
        run_dir = Path(config.out_dir) / config.name
        state = continue_state(RunDir(run_dir)) if self.resume else "start"
        if state == "done":
            return RunOutcome(val_curve(run_dir), "ok", str(run_dir))
        try:
            result = train(config, resume=state == "resume", overwrite=self.overwrite,
                           diagnostics_fn=diagnostics_fn)
        except NonFiniteLossError as e:
            outcome = self.partial(config)
            outcome.status = f"diverged at step {e.step} (non-finite loss)"
            return outcome
        status = "ok" if RunDir(result.run_dir).finished else stopped_status(result.steps)
        return RunOutcome(val_curve(result.run_dir), status, str(result.run_dir))

    def partial(self, config: TrainConfig) -> RunOutcome:
        run_dir = Path(config.out_dir) / config.name
        curve = val_curve(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
        return RunOutcome(curve, "ended early", str(run_dir))


def stopped_status(step: int) -> str:
    """The status of a run whose call --stop-after-minutes ended at `step` (not finished); it
    starts "stopped at", so seed_statistics compares it where the runs all reached."""
    return f"stopped at step {step} by its time limit (--resume continues it)"


def val_curve(run_dir) -> list[tuple[int, float]]:
    """A run folder's (step, validation loss) per evaluation, in step order."""
    curve = {}
    for r in read_metrics(run_dir):
        if r["event"] == "eval":
            v = r["val_loss"]
            curve[r["step"]] = float(v) if isinstance(v, (int, float, str)) else math.nan
    return sorted(curve.items())


def compare(configs: Sequence[TrainConfig], name: str | None = None, *,
            overwrite: bool = False, resume: bool = False, parallel_runs: int = 1,
            deadline_s: float | None = None, progress: bool = True,
            diagnostics_fn: Callable | None = None) -> Comparison:
    """Train every config (a recipe x seed grid that differs in nothing else) and write the
    comparison under `<out_dir>/<name>/` (default name "compare-<model>-<corpus>"), plus
    loss.png of all runs. The first config's recipe is the baseline. resume: continue an
    interrupted comparison (check_run_folders). diagnostics_fn: see TrainRunner."""
    _check_comparable(configs)
    check_runs(configs, overwrite, resume)
    base = configs[0]
    summary_dir = Path(base.out_dir) / (name or f"compare-{base.model}-{base.corpus}")
    specs = [RunSpec(c.recipe, c.seed, c.name, c) for c in configs]
    if parallel_runs > 1:
        # tokenize (and train the BPE) once, here, so the parallel runs read the cache
        from lowbit.train.build import build_data
        build_data(base)
    comparison = compare_runs(specs, TrainRunner(overwrite, diagnostics_fn, resume), summary_dir,
                              parallel_runs=parallel_runs, deadline_s=deadline_s,
                              progress=progress,
                              title=f"{base.model} on {base.corpus}, {base.total_steps} steps")
    run_dirs = [Path(c.out_dir) / c.name for c in configs
                if (Path(c.out_dir) / c.name / "metrics.jsonl").is_file()]
    if run_dirs:
        comparison.extra_figures.append(plot_runs(
            run_dirs, summary_dir / "loss.png",
            title=f"{base.model} on {base.corpus}, {base.total_steps} steps"))
    return comparison


def check_runs(configs: Sequence[TrainConfig], overwrite: bool = False,
               resume: bool = False) -> list[str]:
    """Refuse, before the first run's first step, what would stop a later run: an unknown
    recipe, or a run folder that cannot be started or continued (check_run_folders, whose
    answer it returns)."""
    for config in configs:
        resolve_recipe(config.recipe)
    return check_run_folders([(RunDir(Path(c.out_dir) / c.name), c, JobRecord()) for c in configs],
                             resume=resume, overwrite=overwrite)


def continue_state(run_dir: RunDir) -> str:
    """What continuing a comparison does with one of its runs: "done" (its final.json is
    there: taken as it is, also with its checkpoints removed, RunDir.result_only), "resume"
    (it has a checkpoint: it continues from there), or "start" (nothing to continue)."""
    if run_dir.finished or run_dir.result_only:
        return "done"
    return "resume" if run_dir.checkpoints.exists() else "start"


def check_run_folders(folders: Sequence[tuple[RunDir, Any] | tuple[RunDir, Any, JobRecord]], *,
                      resume: bool = False, overwrite: bool = False) -> list[str]:
    """Check the folder of every run of a comparison, (RunDir, the run's config) each, and its
    JobRecord third for runs of train() (RunDir.check's job), before the first run starts;
    returns what each run does: continue_state's answer with resume, else "start".

    Refused (one line, naming the folder): a folder another process is writing; without
    resume, one that holds a run (unless overwrite); with resume, a run whose checkpoint has
    another config or other starting weights (finished runs included: a result is taken only
    for the config asked for), or one that stopped before its first checkpoint (which offers
    --overwrite). A resume of a comparison none of whose runs has begun is refused as a
    resume of its first run is: a mistyped name must not start afresh."""
    if resume and overwrite:   # before any folder's branch below (a taken result checks neither)
        raise ValueError("resume and overwrite exclude each other; pick one")
    states = [continue_state(run_dir) if resume else "start" for run_dir, *_ in folders]
    if resume and all(state == "start" for state in states):
        states[0] = "resume"   # refused below, with RunDir's words
    for (run_dir, config, *job), state in zip(folders, states):
        with run_dir:   # locked only to look
            if state == "done" and run_dir.result_only:   # its config.json is what there is
                run_dir.check_result(config, job[0] if job else None)
                continue
            run_dir.check(config, resume=state != "start", overwrite=overwrite,
                          job=job[0] if job else None)
    return states


def _check_comparable(configs: Sequence[TrainConfig]) -> None:
    """Everything that can refuse the comparison, before any run starts."""
    from lowbit.recipes import get_recipe

    if len({c.recipe for c in configs}) < 2:
        raise ValueError("compare needs at least two recipes, e.g. --compare bf16,mxfp4")
    check_specs([RunSpec(c.recipe, c.seed, c.name) for c in configs])
    first = configs[0].to_dict()
    for config in configs[1:]:
        for key, value in config.to_dict().items():
            if key not in _MAY_DIFFER and value != first[key]:
                raise ValueError(f"compared runs must differ only in recipe and seed; "
                                 f"{config.name} has {key}={value!r} but {configs[0].name} "
                                 f"has {first[key]!r}")
    for recipe in dict.fromkeys(c.recipe for c in configs):
        get_recipe(recipe)   # an unknown name is refused now, not after the first runs


def parse_seeds(text: str) -> list[int]:
    """--seeds of every job that compares runs: distinct non-negative integers, e.g. "0,1,2"."""
    try:
        seeds = [int(part) for part in str(text).split(",")]
    except ValueError:
        seeds = []
    if not seeds or min(seeds) < 0 or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds needs distinct non-negative integers separated by commas, "
                         f"e.g. 0,1,2 (got {text!r})")
    return seeds
