"""RL with low-precision rollouts (QUADS, arXiv 2607.15810): a rollout engine with its own
weights (lowbit.rl.engine, precision modes and RAC in lowbit.rl.precision), the trainer-side
asymmetric QAT and routing replay (lowbit.rl.trainer_side), GRPO's math (lowbit.rl.grpo) and
loop (lowbit.rl.trainer), `lowbit rl` (lowbit.rl.cli_args), the engine as TRL's rollout_func
(lowbit.rl.trl_adapter). See docs/rl.md."""

from lowbit.rl.engine import Rollout, RolloutEngine
from lowbit.rl.precision import Precision
from lowbit.rl.sampling import SamplingParams

__all__ = ["RolloutEngine", "Rollout", "SamplingParams", "Precision"]
