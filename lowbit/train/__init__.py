"""Training, and what every job's run is made of: one optimizer step (step.TrainStep, a loss
function of (model, batch)), one run loop (runner.RunLoop: cadence, evaluation, checkpoints and
exact resume, logs, progress, final.json) that `lowbit train`, QAT and `lowbit rl` plug into,
run folders, checkpoints, plots.

    from lowbit.train import TrainConfig, train
    result = train(TrainConfig(model="tiny", corpus="tinyshakespeare", max_steps=200))
    print(result.val_loss, result.run_dir)   # runs/tiny-tinyshakespeare-bf16/

A run folder holds config.json, job.json (what made the run: JobRecord), metrics.jsonl,
TensorBoard events, checkpoints/latest.pt, loss.png and final.json. `train(config,
resume=True)` continues it bit for bit.
"""

from lowbit.train.compare import (ArmStats, CompareRow, Comparison, RunOutcome, RunSpec,
                                  compare, compare_runs)
from lowbit.train.build import build_optimizer
from lowbit.train.config import TrainConfig
from lowbit.train.job_record import JobRecord
from lowbit.train.loop import RunResult, TrainingData, evaluate, learning_rate_at, train
from lowbit.train.plot import plot_runs
from lowbit.train.runner import NonFiniteLossError, TrainingInterrupted
from lowbit.train.step import LossFn, StepConfig, TrainStep, next_token_loss

__all__ = [
    "TrainConfig", "JobRecord", "train", "RunResult", "NonFiniteLossError", "TrainingData", "evaluate",
    "learning_rate_at", "plot_runs", "compare", "Comparison", "CompareRow",
    "compare_runs", "RunSpec", "RunOutcome", "ArmStats", "TrainStep", "StepConfig", "LossFn",
    "next_token_loss", "TrainingInterrupted", "build_optimizer",
]
