"""QUADS inside TRL: GRPOTrainer steps on a policy under asymmetric QAT (examples/trl_grpo.py), and
lowbit's rollout engine as TRL's rollout_func (lowbit.rl.trl_adapter), on a tiny random Llama."""

import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")

from lowbit.formats import QuantSpec, quantize_dequantize  # noqa: E402
from lowbit.nn import QuantLinear, quantization_disabled  # noqa: E402
from lowbit.rl.trl_adapter import EngineRollout, engine_for_model  # noqa: E402

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
# NVFP4 as defined: 1x16 blocks along in_features, E4M3 block scales, FP32 tensor scale
NVFP4 = QuantSpec.make("nvfp4", (1, 16))


def _example():
    spec = importlib.util.spec_from_file_location(
        "trl_grpo", Path(__file__).resolve().parents[1] / "examples" / "trl_grpo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _linear_weights(model):
    """(layer index, projection name, weight) of every decoder linear of a transformers Llama."""
    for i, layer in enumerate(model.model.layers):
        for name in ATTENTION:
            yield i, name, getattr(layer.self_attn, name).weight
        for name in MLP:
            yield i, name, getattr(layer.mlp, name).weight


def _teacher_forced(model, prompt, completion):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    logp = torch.log_softmax(logits, -1)[len(prompt) - 1:-1]
    return logp.gather(-1, torch.tensor(completion)[:, None])[:, 0]


def test_grpo_step_with_asymmetric_qat(tmp_path):
    example = _example()
    initial = {k: v.clone() for k, v in example.tiny_policy()[0].state_dict().items()}
    trainer, model, _ = example.grpo(steps=1, align="qat", output_dir=str(tmp_path), device="cpu")
    records = [r for r in trainer.state.log_history if "reward" in r]
    assert trainer.state.global_step == 1 and len(records) == 1
    assert torch.isfinite(torch.tensor(records[0]["loss"])) and records[0]["grad_norm"] > 0
    after = model.state_dict()
    assert set(after) == set(initial)                       # the QAT swap keeps every name
    for i, name, weight in _linear_weights(model):          # the step moved every linear
        assert not torch.equal(weight, initial[_key(i, name)]), (i, name)
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == 14
    assert not isinstance(model.lm_head, QuantLinear)
    # the policy's forward is a plain transformers forward on reference-fake-quantized weights
    reference = type(model)(model.config).eval()
    state = {k: v.detach().clone() for k, v in after.items()}
    for i, name, weight in _linear_weights(model):
        state[_key(i, name)] = quantize_dequantize(weight.detach(), NVFP4)
    reference.load_state_dict(state)
    idx = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    model.eval()
    with torch.no_grad():
        logits, expected = model(idx).logits, reference(idx).logits
        with quantization_disabled(model):
            plain = model(idx).logits
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    assert (logits - plain).abs().max() > 1e-3              # the weights' quantization shows


def _key(i, name):
    part = "self_attn" if name in ATTENTION else "mlp"
    return f"model.layers.{i}.{part}.{name}.weight"


def test_engine_rollouts_through_trl_match_a_bf16_policy(tmp_path):
    example = _example()
    initial_model, tokenizer = example.tiny_policy()
    trainer, model, rollout = example.grpo(steps=2, align="none", rollout="bf16",
                                           output_dir=str(tmp_path), device="cpu")
    assert rollout.synced_steps == [0, 1]                   # TRL's sync hook, once per step
    records = [r for r in trainer.state.log_history if "reward" in r]
    assert len(records) == 2
    for r in records:   # TRL's own mismatch metrics, on the engine's log-probs
        assert r["sampling/sampling_logp_difference/max"] < 1e-4
        assert abs(r["sampling/importance_sampling_ratio/mean"] - 1) < 1e-4
    # the hook as TRL calls it: each prompt repeated num_generations times, one completion each
    prompts = [p for p in example.PROMPTS[:2] for _ in range(4)]
    out = rollout(prompts, trainer)
    assert rollout.synced_steps == [0, 1, 2]                # the step moved: synced first
    assert set(out) == {"prompt_ids", "completion_ids", "logprobs"}
    assert len(out["completion_ids"]) == len(out["logprobs"]) == 8
    eos, stale = tokenizer.eos_token_id, engine_for_model(initial_model, "bf16", max_seq_len=64,
                                                               device="cpu")
    for text, prompt, completion, logprobs in zip(prompts, out["prompt_ids"], out["completion_ids"],
                                                  out["logprobs"]):
        assert prompt == tokenizer(text)["input_ids"]
        assert len(logprobs) == len(completion) and 1 <= len(completion) <= 8
        assert eos not in completion[:-1] and (completion[-1] == eos or len(completion) == 8)
        expected = _teacher_forced(model, prompt, completion)
        torch.testing.assert_close(torch.tensor(logprobs), expected, atol=2e-5, rtol=0)
        # weights two steps old are measurably another policy: the sync is what keeps the gap ~0
        old = stale.score([prompt + completion])[0][len(prompt) - 1:]
        assert (old - expected).abs().max() > 1e-3


def test_quads_rollouts_through_trl(tmp_path):
    trainer, model, rollout = _example().grpo(steps=1, align="qat", rollout="nvfp4", rac_ratio=0.25,
                                              output_dir=str(tmp_path), device="cpu")
    engine = rollout.engine
    assert engine.precision.value == "nvfp4" and engine.rac_ratio == 0.25
    record = next(r for r in trainer.state.log_history if "reward" in r)
    # W4A4 activations leave a gap; token_truncate caps the ratios TRL applies at its clip max 3
    assert record["sampling/sampling_logp_difference/mean"] > 1e-4
    assert 0 < record["sampling/importance_sampling_ratio/min"]
    assert record["sampling/importance_sampling_ratio/max"] <= 3.0
    rollout.sync_weights(trainer)
    for i, name, weight in _linear_weights(model):   # the engine runs the trainer's QAT weights
        stored = engine.linear_values(i, name)
        assert torch.equal(stored, quantize_dequantize(weight.detach(), NVFP4)), (i, name)


def test_refusals(tmp_path):
    example = _example()
    trainer, _, rollout = example.build(steps=1, align="none", rollout="bf16", min_p=0.1,
                                        output_dir=str(tmp_path), device="cpu")
    with pytest.raises(ValueError, match="does not support GRPOConfig's min_p"):
        rollout(["the quick"] * 4, trainer)
    with pytest.raises(ValueError, match="the trainer runs vLLM"):   # already enabled
        rollout.enable_importance_sampling(trainer)
    plain, _, _ = example.build(steps=1, align="none", output_dir=str(tmp_path), device="cpu")
    with pytest.raises(ValueError, match="rollout_func=this EngineRollout"):
        EngineRollout(rollout.engine).enable_importance_sampling(plain)
    from transformers import GPT2Config, GPT2LMHeadModel

    from lowbit.models import ModelLoadError
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel is not supported"):
        engine_for_model(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)))


@pytest.mark.parametrize("kind,norm_topk", [("llama", None), ("qwen3", None), ("qwen3-moe", False),
                                            ("qwen3-moe", True), ("qwen2", None), ("llama3", None)])
def test_engine_for_model_scores_as_transformers(kind, norm_topk):
    """qwen2: q/k/v biases; llama3: RoPE scaling, tied embeddings, attention and MLP biases
    (random, so a bias in the wrong place shows)."""
    from hf_models import hf_model, randomize

    model = hf_model(kind).eval()
    randomize(model)
    if norm_topk is not None:   # transformers' Qwen3-MoE default is False; Qwen3-30B-A3B's True
        model.config.norm_topk_prob = norm_topk
        for layer in model.model.layers:
            layer.mlp.gate.norm_topk_prob = norm_topk
    engine = engine_for_model(model, "bf16", max_seq_len=32, device="cpu")
    seq = torch.randint(0, 300, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    expected = _teacher_forced(model, seq[:1], seq[1:])
    torch.testing.assert_close(engine.score([seq])[0], expected, atol=2e-5, rtol=0)


def test_conversational_prompts_take_the_chat_template(tmp_path):
    trainer, _, rollout = _example().build(steps=1, align="none", rollout="bf16",
                                           output_dir=str(tmp_path), device="cpu")
    tokenizer = trainer.processing_class
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                               "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
    prompts = [[{"role": "user", "content": text}] for text in ("the quick", "a lazy dog")
               for _ in range(2)]
    out = rollout(prompts, trainer)
    for prompt, ids in zip(prompts, out["prompt_ids"]):
        text = f"user: {prompt[0]['content']}\nassistant:"
        assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
