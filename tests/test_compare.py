"""lowbit.train.compare: comparisons over paired seeds, the statistics against an independent
computation (Python's statistics module), runs as processes with a deadline, and
`lowbit train --compare R1,R2 --seeds S1,S2 --parallel-runs N` on the tiny model."""

from __future__ import annotations

import json
import statistics
import time

import pytest
import torch

from lowbit.train.cli_args import add_train_arguments, run_train
from lowbit.train.run_dir import RunDir
from lowbit.train.compare import (RunOutcome, RunSpec, check_specs, compare_runs,
                                  seed_statistics, t_critical)


def grid(values: dict[str, list[float]]) -> tuple[list[RunSpec], dict[str, RunOutcome]]:
    """Specs and outcomes of arms x seeds whose curve ends at step 10 with these values."""
    specs, outcomes = [], {}
    for arm, per_seed in values.items():
        for seed, v in enumerate(per_seed):
            name = f"{arm}-s{seed}"
            specs.append(RunSpec(arm, seed, name))
            outcomes[name] = RunOutcome([(0, 9.0), (5, v + 1), (10, v)])
    return specs, outcomes


def test_seed_statistics_match_an_independent_paired_t_test():
    base = [4.4761, 4.4956, 4.4522]
    worse = [4.60, 4.62, 4.58]           # ~ +2.8% on every seed, little spread: significant
    noisy = [4.40, 4.60, 4.45]           # -1.7%, +2.3%, -0.05%: inside the noise
    specs, outcomes = grid({"bf16": base, "worse": worse, "noisy": noisy})
    step, rows, stats, spread = seed_statistics(specs, outcomes)
    assert step == 10
    assert spread == pytest.approx(statistics.stdev(base) / statistics.mean(base) * 100, rel=1e-12)
    for arm_stats, values in zip(stats, (worse, noisy)):
        gaps = [(v - b) / b * 100 for v, b in zip(values, base)]
        assert arm_stats.gaps_pct == pytest.approx(gaps, rel=1e-12)
        assert arm_stats.mean_pct == pytest.approx(statistics.mean(gaps), rel=1e-12)
        assert arm_stats.std_pct == pytest.approx(statistics.stdev(gaps), rel=1e-12)
        t = statistics.mean(gaps) / (statistics.stdev(gaps) / 3 ** 0.5)
        assert (arm_stats.verdict != "within noise") == (abs(t) > 4.303)
        half = 4.303 * statistics.stdev(gaps) / 3 ** 0.5
        assert arm_stats.ci95_pct == pytest.approx((statistics.mean(gaps) - half,
                                                    statistics.mean(gaps) + half), rel=1e-9)
    assert [s.verdict for s in stats] == ["worse", "within noise"]
    assert [s.within_spread_every_seed for s in stats] == [False, False]
    assert [r.gap_pct for r in rows[:3]] == [0.0, 0.0, 0.0]
    assert t_critical(2) == 4.303 and t_critical(1000) == 1.960
    # better on every seed by a consistent margin
    specs, outcomes = grid({"bf16": base, "better": [b * 0.98 + 0.001 * i
                                                     for i, b in enumerate(base)]})
    assert seed_statistics(specs, outcomes)[2][0].verdict == "better"


def test_a_diverged_run_drops_its_pair_and_does_not_move_the_step():
    specs, outcomes = grid({"bf16": [4.0, 4.1, 4.2], "r": [4.1, 4.2, 4.3]})
    outcomes["r-s1"] = RunOutcome([(0, 9.0), (5, float("nan"))], "diverged at step 5")
    step, rows, stats, _ = seed_statistics(specs, outcomes)
    assert step == 10
    assert stats[0].seeds == [0, 2] and stats[0].runs_ended_early == 1
    assert rows[4].value is None and rows[4].status == "diverged at step 5"
    # one pair left: no verdict
    outcomes["r-s2"] = RunOutcome([], "failed: boom")
    assert seed_statistics(specs, outcomes)[2][0].verdict == "one seed"


def test_specs_must_form_a_full_grid_of_arms_and_seeds():
    with pytest.raises(ValueError, match="at least two different arms"):
        check_specs([RunSpec("a", 0, "x"), RunSpec("a", 1, "y")])
    with pytest.raises(ValueError, match="missing: b at seed 1"):
        check_specs([RunSpec("a", 0, "x"), RunSpec("b", 0, "y"), RunSpec("a", 1, "z")])
    with pytest.raises(ValueError, match="x is used twice"):
        check_specs([RunSpec("a", 0, "x"), RunSpec("b", 0, "x")])
    assert check_specs([RunSpec("a", 0, "x"), RunSpec("b", 0, "y")]) == (["a", "b"], [0])


class ScriptedRunner:
    """A run whose config says what it does: its final value, or to hang, or to fail."""

    def __call__(self, config: dict) -> RunOutcome:
        if config.get("hang"):
            time.sleep(600)
        if config.get("fail"):
            raise RuntimeError("the run broke")
        return RunOutcome([(0, 3.0), (10, config["value"])])

    def partial(self, config: dict) -> RunOutcome:
        return RunOutcome([(0, 3.0)])


def test_processes_report_outcomes_and_failures(tmp_path):
    specs = [RunSpec("base", 0, "base-s0", {"value": 2.0}),
             RunSpec("broken", 0, "broken-s0", {"fail": True})]
    c = compare_runs(specs, ScriptedRunner(), tmp_path / "cmp", parallel_runs=2, progress=False)
    assert [r.status for r in c.rows][0] == "ok" and c.step == 10 and c.rows[0].value == 2.0
    assert c.rows[1].status.startswith("failed: RuntimeError: the run broke")
    assert "the run broke" in (tmp_path / "cmp" / "logs" / "broken-s0.log").read_text()
    assert c.arms[0].verdict == "no pairs"
    assert (tmp_path / "cmp" / "seeds.png").read_bytes()[:4] == b"\x89PNG"


def test_runs_going_at_the_deadline_are_stopped_and_keep_their_evaluations(tmp_path):
    specs = [RunSpec("base", 0, "base-s0", {"hang": True}),
             RunSpec("hung", 0, "hung-s0", {"hang": True})]
    t0 = time.monotonic()
    c = compare_runs(specs, ScriptedRunner(), tmp_path / "cmp", parallel_runs=2, deadline_s=2,
                     progress=False)
    assert time.monotonic() - t0 < 30
    assert [r.status for r in c.rows] == ["stopped at the deadline"] * 2
    # the stopped runs' evaluations so far (runner.partial) fix the step compared
    assert c.step == 0 and [r.gap_pct for r in c.rows] == [0.0, 0.0]
    saved = json.loads((tmp_path / "cmp" / "summary.json").read_text())
    assert saved["runs"]["hung-s0"]["curve"] == [[0, 3.0]] and saved["step"] == 0


def test_cli_compare_over_seeds_in_parallel_pairs_the_data_order(tmp_path, corpus_env, capsys):
    import argparse

    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    common = ["--steps", "2", "--seq-len", "16", "--batch-size", "2", "--eval-every", "1",
              "--eval-batches", "1", "--checkpoint-every", "0", "--no-diagnostics",
              "--no-progress", "--device", "cpu", "--out-dir", str(tmp_path)]
    run_train(parser.parse_args([*common, "--compare", "bf16,mxfp4", "--seeds", "3",
                                 "--parallel-runs", "2", "--run-name", "cmp"]))
    out = capsys.readouterr().out
    assert "| cmp-mxfp4-s3 | mxfp4 | 3 |" in out and "| mxfp4 |" in out
    # A run of the comparison is the run `lowbit train --seed 3` makes on its own (same data
    # order and init: the seed pairs runs), here in this process with the children's one thread.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_train(parser.parse_args([*common, "--recipe", "mxfp4", "--seed", "3",
                                     "--run-name", "alone"]))
    finally:
        torch.set_num_threads(threads)
    alone = json.loads((tmp_path / "alone" / "metrics.jsonl").read_text().splitlines()[0])
    first = json.loads((tmp_path / "cmp-mxfp4-s3" / "metrics.jsonl").read_text().splitlines()[0])
    assert alone["event"] == first["event"] == "eval" and alone["val_loss"] == first["val_loss"]
    final = lambda name: json.loads((tmp_path / name / "final.json").read_text())["val_loss"]
    assert final("alone") == final("cmp-mxfp4-s3")
    with pytest.raises(ValueError, match="--seeds needs distinct"):
        run_train(parser.parse_args([*common, "--compare", "bf16,mxfp4", "--seeds", "0,0"]))
    with pytest.raises(ValueError, match="go with --compare"):
        run_train(parser.parse_args([*common, "--seeds", "0,1"]))
    with pytest.raises(ValueError, match="drop --seed"):
        run_train(parser.parse_args([*common, "--compare", "bf16,mxfp4", "--seeds", "0,1",
                                     "--seed", "2"]))



def test_cli_compare_stopped_by_its_time_limit_resumes_to_the_end(tmp_path, corpus_env, capsys):
    # --stop-after-minutes: each run stops at the end of its first step (a limit shorter than
    # a step), checkpointed and not finished; the table says so and compares what they reached;
    # the same command with --resume (and no limit) finishes them
    import argparse

    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    common = ["--steps", "3", "--seq-len", "16", "--batch-size", "2", "--eval-every", "1",
              "--eval-batches", "1", "--checkpoint-every", "0", "--no-diagnostics",
              "--no-progress", "--device", "cpu", "--out-dir", str(tmp_path), "--compare",
              "bf16,mxfp4", "--run-name", "lim"]
    run_train(parser.parse_args([*common, "--stop-after-minutes", "1e-9"]))
    out = capsys.readouterr().out
    assert out.count("stopped at step 1 by its time limit (--resume continues it)") == 2, out
    for run in ("lim-bf16", "lim-mxfp4"):
        assert not (tmp_path / run / "final.json").exists()
    run_train(parser.parse_args([*common, "--resume"]))
    out = capsys.readouterr().out
    assert "stopped at" not in out and out.count("| ok |") == 2, out
    assert json.loads((tmp_path / "lim-mxfp4" / "final.json").read_text())["steps"] == 3
    with pytest.raises(ValueError, match="stop_after_minutes must be a positive number"):
        run_train(parser.parse_args([*common, "--stop-after-minutes", "0"]))


def test_a_comparison_takes_finished_runs_whose_checkpoints_were_removed(tmp_path, corpus_env, capsys):
    # finish two arms, delete their checkpoints (to save space or carry results elsewhere),
    # then add an arm with --resume: the two results are taken as they are (their curves and
    # "ok"), checked against config.json; a changed config is refused in one line
    import argparse
    import shutil

    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    common = ["--steps", "2", "--seq-len", "16", "--batch-size", "2", "--eval-every", "1",
              "--eval-batches", "1", "--checkpoint-every", "0", "--no-diagnostics",
              "--no-progress", "--device", "cpu", "--out-dir", str(tmp_path), "--run-name", "pr"]
    run_train(parser.parse_args([*common, "--compare", "bf16,mxfp4"]))
    capsys.readouterr()
    metrics = {run: (tmp_path / run / "metrics.jsonl").read_text() for run in ("pr-bf16", "pr-mxfp4")}
    for run in metrics:
        shutil.rmtree(tmp_path / run / "checkpoints")
        assert RunDir(tmp_path / run).result_only and not RunDir(tmp_path / run).finished
    run_train(parser.parse_args([*common, "--compare", "bf16,mxfp4,nvfp4", "--resume"]))
    out = capsys.readouterr().out
    assert out.count("| ok |") == 3, out
    for run, text in metrics.items():   # taken, not run again
        assert (tmp_path / run / "metrics.jsonl").read_text() == text
    assert (tmp_path / "pr-nvfp4" / "final.json").is_file()
    with pytest.raises(ValueError, match=r"cannot take .*pr-bf16's result: its config.json differs "
                                         r"from the config asked for in lr"):
        run_train(parser.parse_args([*common, "--compare", "bf16,mxfp4", "--resume", "--lr", "5e-4"]))


def test_a_taken_result_is_checked_as_a_resume_would_be(tmp_path):
    # RunDir.check_result on a finished run without checkpoints: its job record (job.json, or
    # an old run's config.json fields) and starting weights, and a live writer's lock
    import fcntl

    from lowbit.train.checkpoint import CheckpointError, write_json_atomic
    from lowbit.train.config import TrainConfig
    from lowbit.train.job_record import JobRecord

    config = TrainConfig(out_dir=str(tmp_path), run_name="q", device="cpu")
    qat = {"weights": "int2:g64"}
    job = JobRecord("qat", qat, "runs/base", "a" * 64)
    folder = tmp_path / "q"
    folder.mkdir()
    write_json_atomic(folder / "config.json", config.to_dict())
    write_json_atomic(folder / "final.json", {"steps": 1})
    run = RunDir(folder)
    assert run.result_only
    with run:   # written before job records: the job fields in config.json
        run.check_result(config, JobRecord("train"))    # config.json names no QAT: a train run
        with pytest.raises(ValueError, match="differs from the config asked for in kind"):
            run.check_result(config, job)
    write_json_atomic(folder / "job.json", job.to_dict())
    with run:
        run.check_result(config, JobRecord("qat", qat, "moved/base", "a" * 64))   # moved: taken
        with pytest.raises(CheckpointError, match="started from other weights"):
            run.check_result(config, JobRecord("qat", qat, "runs/base", "b" * 64))
        with pytest.raises(ValueError, match="differs from the config asked for in qat"):
            run.check_result(config, JobRecord("qat", {"weights": "int3:g64"}, "runs/base", "a" * 64))
    with open(folder / ".lowbit.lock", "a+") as held:   # another process writing it
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(ValueError, match="is in use"):
            RunDir(folder).check_result(config, job)



def test_the_seeds_figure_wraps_a_long_metric_into_its_axis_labels(tmp_path, monkeypatch):
    # a metric as long as lowbit rl's (evaluator, window) is broken into lines, not cut at the
    # figure's edge; the figure is still written
    from lowbit.train import plot
    metric = "held-out accuracy change from step 0 (bf16 evaluator, mean of the last 5 evaluations)"
    curves = {"bf16": {0: [(0, 0.0), (5, 0.2)], 1: [(0, 0.0), (5, 0.3)]},
              "nvfp4": {0: [(0, 0.0), (5, 0.1)], 1: [(0, 0.0), (5, 0.2)]}}
    figures = []
    save = plot.save_figure
    monkeypatch.setattr(plot, "save_figure", lambda fig, path: (figures.append(fig), save(fig, path))[1])
    path = plot.plot_gap_bands(curves, tmp_path / "seeds.png", metric=metric, relative=False)
    assert path.stat().st_size > 0
    labels = [ax.get_ylabel() for ax in figures[0].axes]
    assert labels[0].replace("\n", " ") == f"{metric} (mean ± sd over seeds)"
    assert all(len(line) <= 60 for label in labels for line in label.split("\n"))
    assert "\n" in labels[0]
