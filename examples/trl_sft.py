"""Fine-tune a Hugging Face model with TRL's SFTTrainer after lowbit.quantize_: lowbit's recipes
are module swaps, so any trainer runs them. A tiny random Llama here (nothing downloaded);
pass --model PATH for a real folder.

    python examples/trl_sft.py --steps 4 --recipe stable-fp4
"""

from __future__ import annotations

import argparse
import tempfile


def sft(model_path: str | None = None, recipe: str = "stable-fp4", steps: int = 4,
        output_dir: str | None = None, texts: list[str] | None = None):
    """Run SFTTrainer for `steps` on a lowbit-converted model; returns (trainer, model)."""
    import torch
    from datasets import Dataset
    from transformers import (AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM,
                              PreTrainedTokenizerFast)
    from trl import SFTConfig, SFTTrainer

    import lowbit

    if model_path is None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        corpus = texts or ["the quick brown fox jumps over the lazy dog"] * 64
        raw = Tokenizer(models.BPE())
        raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        raw.decoder = decoders.ByteLevel()
        raw.train_from_iterator(corpus, trainers.BpeTrainer(
            vocab_size=300, special_tokens=["<eos>"], show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>", pad_token="<eos>")
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=4,
                                             num_key_value_heads=2, max_position_embeddings=128))
    else:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        corpus = texts or ["the quick brown fox jumps over the lazy dog"] * 64
    print(str(lowbit.quantize_(model, recipe)).splitlines()[0])   # in place: QuantLinear layers
    config = SFTConfig(output_dir=output_dir or tempfile.mkdtemp(), max_steps=steps,
                       per_device_train_batch_size=4, learning_rate=3e-3, logging_steps=1,
                       max_length=32, report_to=[], save_strategy="no", use_cpu=True,
                       dataloader_num_workers=0, seed=0)
    trainer = SFTTrainer(model=model, args=config, processing_class=tokenizer,
                         train_dataset=Dataset.from_dict({"text": corpus}))
    trainer.train()
    return trainer, model


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a Hugging Face model folder (default: tiny random)")
    p.add_argument("--recipe", default="stable-fp4")
    p.add_argument("--steps", type=int, default=4)
    a = p.parse_args()
    trainer, _ = sft(a.model, a.recipe, a.steps)
    print([round(r["loss"], 4) for r in trainer.state.log_history if "loss" in r])
