"""lowbit's rollout engine inside TRL's GRPOTrainer, through TRL's `rollout_func` hook.

    from trl import GRPOConfig, GRPOTrainer
    from lowbit.rl.trainer_side import apply_asymmetric_qat
    from lowbit.rl.trl_adapter import EngineRollout

    apply_asymmetric_qat(model)                       # QUADS' trainer side (optional)
    rollout = EngineRollout.for_model(model, precision="nvfp4", rac_ratio=0.25)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(...),
                          train_dataset=dataset, processing_class=tokenizer, rollout_func=rollout)
    rollout.enable_importance_sampling(trainer)       # optional: TRL's TIS on the engine's log-probs
    trainer.train()

The contract (TRL 1.16, `trl/trainer/grpo_trainer.py`): `RolloutFunc = Callable[[list[str],
"GRPOTrainer"], dict[str, Any]]`; "It receives the list of prompts allocated to the current
process and the trainer instance. It must return a dict with "prompt_ids", "completion_ids",
and "logprobs" fields [...] it is responsible for returning the correct number of completions
per prompt". TRL's sampler already repeats each prompt `num_generations` times in that list,
so an `EngineRollout` returns one completion per entry. On each call it:

1. syncs the weights when the trainer's `global_step` moved since the last sync (and on the
   first call): the unwrapped policy's state dict, by Hugging Face parameter names, goes to
   `RolloutEngine.load_state_dict`, which copies and quantizes it (the engine never holds the
   trainer's tensors);
2. tokenizes the prompts as TRL does (`processing_class(text=prompts)`, or the chat template
   with `add_generation_prompt=True` for conversational prompts);
3. samples with the trainer's settings (`temperature`, `top_p`, `top_k`,
   `max_completion_length`, the trainer's `eos_token_ids` as stop tokens; the seed a function of
   `args.seed`, the step and the process), in chunks of the engine's `max_batch_size`;
4. returns the prompt and completion ids (the stop token included, as TRL's own generation
   keeps it) and the engine's log-probability of every sampled token (of softmax(logits / T),
   what TRL recomputes by teacher forcing).

What TRL does with the engine's log-probs. They become `sampling_per_token_logps`, which TRL
1.16 reads for its off-policy sequence mask (`off_policy_mask_threshold`). Its importance-
sampling correction for the engine/trainer mismatch (`vllm_importance_sampling_correction`,
`_mode`, `_clip_min/max`), and the `sampling/sampling_logp_difference/*` and
`sampling/importance_sampling_ratio/*` metrics, run only under
`if self.use_vllm and self.vllm_importance_sampling_correction:` -- and `use_vllm=True` in the
config starts vLLM. `enable_importance_sampling(trainer)` turns that branch on without vLLM:
it sets the trainer's `use_vllm` to True and puts in `vllm_generation` a stand-in whose only
method, `sync_weights()`, is this adapter's sync (TRL calls it when the step moves, before
`rollout_func`). On that branch TRL 1.16 reads nothing else of vLLM except with tools, which
is refused. It leans on TRL's internals (`use_vllm`, `vllm_generation`, `_last_loaded_step`),
tested against TRL 1.16.

Not covered: multimodal prompts and tools (refused), `min_p`, `repetition_penalty` and
`generation_kwargs` (the engine has no such sampling; refused), PEFT-wrapped policies (their
parameter names are not the model's; merge the adapter first), MoE routing replay (TRL's loss
has no hook for recorded expert choices), several processes (each process runs its own engine
on its own prompts; untested).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from lowbit.models.hf import config_from_hf
from lowbit.rl.engine import RolloutEngine
from lowbit.rl.sampling import SamplingParams

__all__ = ["EngineRollout", "engine_for_model"]


def engine_for_model(model: nn.Module, precision: str = "nvfp4", rac_ratio: float = 0.0,
                     device: str | torch.device | None = None, dtype: torch.dtype | None = None,
                     max_batch_size: int = 16, max_seq_len: int = 1024,
                     **engine_kw) -> RolloutEngine:
    """A RolloutEngine shaped as the transformers causal LM `model` (Llama, Qwen2, Qwen3,
    Qwen3-MoE; other architectures are refused with lowbit.models.ModelLoadError), loaded with
    its weights.
    device: the model's by default; max_seq_len: prompt plus completion tokens, capped at the
    model's max_position_embeddings (it sizes the preallocated KV cache, with max_batch_size)."""
    hf = model.config.to_dict()
    if not hf.get("architectures"):   # set by save_pretrained; a model built from a config has none
        hf["architectures"] = [type(model).__name__]
    config = config_from_hf(hf, type(model).__name__)
    if device is None:
        device = next(model.parameters()).device
    engine = RolloutEngine(config, precision=precision, rac_ratio=rac_ratio, device=device,
                           dtype=dtype, max_batch_size=max_batch_size,
                           max_seq_len=min(max_seq_len, config.max_seq_len), **engine_kw)
    engine.load_state_dict(model.state_dict())
    return engine


@dataclass
class EngineRollout:
    """TRL's `rollout_func` on a lowbit RolloutEngine (see the module doc). Call it as TRL does,
    `rollout(prompts, trainer)`."""

    engine: RolloutEngine
    synced_steps: list[int] = field(default_factory=list)
    """The trainer's global_step at every weight sync, in order."""
    stats: list[dict] = field(default_factory=list)
    """Per call: step, rows, generated tokens, rollout/tokens_per_s, time/generate_s, time/sync_s."""

    @classmethod
    def for_model(cls, model: nn.Module, precision: str = "nvfp4", rac_ratio: float = 0.0,
                  **engine_kw) -> EngineRollout:
        """An EngineRollout on `engine_for_model(model, precision, rac_ratio, **engine_kw)`."""
        return cls(engine_for_model(model, precision, rac_ratio, **engine_kw))

    # ---- weight sync ----------------------------------------------------------------------

    def sync_weights(self, trainer) -> float:
        """Load the trainer's policy into the engine now; returns the seconds it took."""
        t0 = time.perf_counter()
        policy = trainer.accelerator.unwrap_model(trainer.model)
        if hasattr(policy, "peft_config"):
            raise ValueError("EngineRollout cannot sync a PEFT-wrapped policy (its parameter names "
                             "are the adapter's); merge the adapter into the model first")
        self.engine.sync(policy.state_dict())
        self.synced_steps.append(int(trainer.state.global_step))
        return time.perf_counter() - t0

    def enable_importance_sampling(self, trainer) -> None:
        """Make TRL apply its vLLM importance-sampling correction (GRPOConfig's
        vllm_importance_sampling_*) to this engine's log-probs, and log its mismatch metrics."""
        if trainer.rollout_func is not self:
            raise ValueError("enable_importance_sampling needs the trainer built with "
                             "rollout_func=this EngineRollout")
        if trainer.use_vllm:
            raise ValueError("the trainer runs vLLM (use_vllm=True); an EngineRollout replaces it")
        if trainer.tools:
            raise ValueError("tools are not supported with an EngineRollout")
        if not trainer.vllm_importance_sampling_correction:
            raise ValueError("GRPOConfig(vllm_importance_sampling_correction=False) turns the "
                             "correction off; set it True (the default) to enable it")
        trainer.vllm_generation = _SyncOnly(self, trainer)
        trainer._last_loaded_step = -1   # TRL syncs when global_step differs from it
        trainer.use_vllm = True

    # ---- the hook ---------------------------------------------------------------------------

    def __call__(self, prompts: list, trainer) -> dict:
        args = trainer.args
        step = int(trainer.state.global_step)
        sync_s = 0.0
        if not self.synced_steps or self.synced_steps[-1] != step:
            sync_s = self.sync_weights(trainer)
        prompt_ids = self._tokenize(prompts, trainer)
        sampling = self._sampling(trainer)
        mode = 0 if trainer.model.training else 1
        # a function of (seed, step, process, train/eval): a resumed run draws what it drew
        base_seed = (int(args.seed) * 1_000_003 + step * 7_919
                     + trainer.accelerator.process_index * 104_729 + mode * 15_485_863)
        completions, logprobs, tokens, t0 = [], [], 0, time.perf_counter()
        for start in range(0, len(prompt_ids), self.engine.max_batch_size):
            chunk = prompt_ids[start:start + self.engine.max_batch_size]
            params = SamplingParams(**sampling, seed=(base_seed + start) % 2**63)
            out = self.engine.generate(chunk, params)
            lists = out.completion_lists()
            completions += lists
            logprobs += [row[:len(ids)].tolist() for row, ids in zip(out.logprobs.cpu(), lists)]
            tokens += out.generated_tokens
        seconds = time.perf_counter() - t0
        self.stats.append({"step": step, "rows": len(prompt_ids), "tokens": tokens,
                           "rollout/tokens_per_s": tokens / max(seconds, 1e-9),
                           "time/generate_s": seconds, "time/sync_s": sync_s})
        return {"prompt_ids": prompt_ids, "completion_ids": completions, "logprobs": logprobs}

    def _tokenize(self, prompts: list, trainer) -> list[list[int]]:
        """As TRL 1.16's GRPOTrainer._tokenize_prompts for text-only prompts."""
        tokenizer = trainer.processing_class
        if getattr(trainer, "_is_vlm", False):
            raise ValueError("EngineRollout generates from text; multimodal processors are not "
                             "supported")
        if isinstance(prompts[0], list):   # conversational: a list of {"role", "content"} messages
            out = tokenizer.apply_chat_template(
                conversation=prompts, chat_template=trainer.chat_template, add_generation_prompt=True,
                tokenize=True, return_dict=True, **trainer.chat_template_kwargs)
            ids = out["input_ids"]
        else:
            ids = tokenizer(text=prompts)["input_ids"]
        return [list(map(int, row)) for row in ids]

    def _sampling(self, trainer) -> dict:
        args = trainer.args
        unsupported = [name for name, off in (("min_p", None), ("generation_kwargs", None))
                       if getattr(args, name, None) not in (off, {})]
        if getattr(args, "repetition_penalty", 1.0) != 1.0:
            unsupported.append("repetition_penalty")
        if unsupported:
            raise ValueError(f"the rollout engine does not support GRPOConfig's "
                             f"{', '.join(unsupported)}; leave them at their defaults")
        return dict(temperature=float(args.temperature), top_p=float(args.top_p),
                    top_k=int(args.top_k or 0), max_new_tokens=int(args.max_completion_length),
                    stop_token_ids=tuple(trainer.eos_token_ids))


class _SyncOnly:
    """What TRL's GRPOTrainer calls on `vllm_generation` on its rollout_func path: sync_weights()."""

    def __init__(self, rollout: EngineRollout, trainer) -> None:
        self.rollout, self.trainer = rollout, trainer

    def sync_weights(self) -> None:
        self.rollout.sync_weights(self.trainer)
