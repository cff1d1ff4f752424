"""lowbit's recipes inside another trainer: TRL's SFTTrainer fine-tunes a tiny Hugging Face
model after lowbit.convert (examples/trl_sft.py)."""

import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")


def test_sft_trainer_trains_a_converted_model(tmp_path):
    from lowbit.nn import QuantLinear, quantization_disabled

    spec = importlib.util.spec_from_file_location(
        "trl_sft", Path(__file__).resolve().parents[1] / "examples" / "trl_sft.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    trainer, model = example.sft(recipe="stable-fp4", steps=3, output_dir=str(tmp_path))
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 2 * 7 and all(m.linear_recipe is not None for m in layers[2:])
    # the trained model runs the recipe's quantized GEMMs: its logits are not the BF16 ones
    idx = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    model.eval()
    with torch.no_grad():
        quantized = model(idx).logits
        with quantization_disabled(model):
            plain = model(idx).logits
    assert not torch.equal(quantized, plain)
