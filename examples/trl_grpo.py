"""GRPO with TRL's GRPOTrainer on a policy under QUADS' trainer-side QAT (NVFP4 fake-quantized
weights, high-precision activations, straight-through gradients), optionally generating with
lowbit's rollout engine (NVFP4 W4A4 + RAC) through TRL's rollout_func. A tiny random Llama and a
toy reward here (nothing downloaded); pass --model PATH for a real folder.

    python examples/trl_grpo.py --steps 2                                  # TRL generates
    python examples/trl_grpo.py --steps 2 --rollout nvfp4 --rac-ratio 0.25 # lowbit's engine
    python examples/trl_grpo.py --steps 2 --rollout bf16 --align none      # engine, no QAT

With --rollout, TRL's importance-sampling correction runs on the engine's log-probs
(`vllm_importance_sampling_mode`, token_truncate here) and logs the mismatch
(sampling/sampling_logp_difference/*). See docs/rl.md, "In TRL".
"""

from __future__ import annotations

import argparse
import os
import tempfile

PROMPTS = ["the quick", "a lazy dog", "brown fox", "over the"]


def reward_letter_o(completions: list[str], **_) -> list[float]:
    """A toy reward: the share of the letter 'o' in the completion."""
    return [c.count("o") / max(len(c), 1) for c in completions]


def tiny_policy():
    """A tiny random Llama and a byte-level BPE tokenizer trained on a sentence."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 8, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<eos>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>", pad_token="<eos>")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, max_position_embeddings=128))
    return model, tokenizer


def grpo(model_path: str | None = None, steps: int = 2, align: str = "qat",
         rollout: str | None = None, rac_ratio: float = 0.0, **kw):
    """Build (below) and train for `steps`; returns (trainer, model, engine_rollout or None)."""
    trainer, model, engine_rollout = build(model_path, steps, align, rollout, rac_ratio, **kw)
    trainer.train()
    return trainer, model, engine_rollout


def build(model_path: str | None = None, steps: int = 2, align: str = "qat",
          rollout: str | None = None, rac_ratio: float = 0.0, output_dir: str | None = None,
          learning_rate: float = 1e-2, device: str | None = None, **config_kw):
    """A GRPOTrainer for `steps` (not trained yet); returns (trainer, model, engine_rollout or None).

    align: "qat" applies lowbit.rl.trainer_side.apply_asymmetric_qat to the policy, "none"
    leaves it as loaded. rollout: None lets TRL generate (transformers' generate on the
    policy); a precision (bf16, fp8, nvfp4-w4a16, nvfp4) generates with lowbit's RolloutEngine
    through rollout_func, weights synced every step, TRL's IS correction on its log-probs.
    device: cuda when there is a GPU (bf16 autocast there), else cpu (float32)."""
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from lowbit.rl.trainer_side import apply_asymmetric_qat
    from lowbit.rl.trl_adapter import EngineRollout

    if align not in ("qat", "none"):
        raise ValueError(f"align must be qat or none (got {align!r})")
    if model_path is None:
        model, tokenizer = tiny_policy()
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    if align == "qat":
        print(apply_asymmetric_qat(model))   # in place: q/k/v/o, gate/up/down through NVFP4 weights
    engine_rollout = None
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if rollout is not None:
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")   # rollout_func is experimental in TRL
        engine_rollout = EngineRollout.for_model(model, precision=rollout, rac_ratio=rac_ratio,
                                                 device=device,
                                                 max_batch_size=16, max_seq_len=64)
    settings = dict(output_dir=output_dir or tempfile.mkdtemp(), max_steps=steps,
                    per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
                    learning_rate=learning_rate, logging_steps=1, report_to=[], save_strategy="no",
                    use_cpu=device == "cpu", bf16=device != "cpu", gradient_checkpointing=False,
                    dataloader_num_workers=0, seed=0, vllm_importance_sampling_mode="token_truncate")
    settings.update(config_kw)
    trainer = GRPOTrainer(model=model, reward_funcs=reward_letter_o, args=GRPOConfig(**settings),
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                          processing_class=tokenizer, rollout_func=engine_rollout)
    if engine_rollout is not None:
        engine_rollout.enable_importance_sampling(trainer)
    return trainer, model, engine_rollout


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a Hugging Face model folder (default: tiny random)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--align", choices=("qat", "none"), default="qat",
                   help="qat: QUADS' asymmetric QAT on the policy; none: the policy as loaded")
    p.add_argument("--rollout", choices=("bf16", "fp8", "nvfp4-w4a16", "nvfp4"), default=None,
                   help="generate with lowbit's rollout engine in this precision (default: TRL generates)")
    p.add_argument("--rac-ratio", type=float, default=0.0, help="RAC channel ratio (with --rollout nvfp4)")
    return p


if __name__ == "__main__":
    parser = build_parser()
    a = parser.parse_args()
    try:
        trainer, _, engine_rollout = grpo(a.model, a.steps, a.align, a.rollout, a.rac_ratio)
    except ValueError as e:
        parser.error(str(e))
    keys = ("reward", "sampling/sampling_logp_difference/mean", "sampling/importance_sampling_ratio/mean")
    for record in trainer.state.log_history:
        if "reward" in record:
            print({"step": record["step"], **{k: round(record[k], 5) for k in keys if k in record}})
    if engine_rollout is not None:
        print("weights synced at steps", engine_rollout.synced_steps)
