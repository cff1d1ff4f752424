"""GRPO's math against hand-computed cases, routing replay, a Hugging Face Qwen3-MoE through the
engine and the trainer, exact resume, and `lowbit rl` in CI."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import lowbit
from lowbit.data.tasks import get_task
from lowbit.models import ModelConfig, build_model
from lowbit.rl import grpo
from lowbit.rl.config import RLConfig
from lowbit.rl.engine import RolloutEngine
from lowbit.rl.sampling import SamplingParams
from lowbit.rl.trainer import GRPOTrainer, run_rl
from lowbit.rl.trainer_side import enable_routing_replay, replay_routing, routing_agreement


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    # groups [1, 0, 0] and [0, 1, 1]: means 1/3, 2/3; unbiased std sqrt(1/3)
    s = math.sqrt(1 / 3)
    expected = torch.tensor([2 / 3, -1 / 3, -1 / 3, -2 / 3, 1 / 3, 1 / 3])
    torch.testing.assert_close(grpo.group_advantages(rewards, 3, "none"), expected)
    torch.testing.assert_close(grpo.group_advantages(rewards, 3, "group"), expected / (s + 1e-4))
    batch_std = rewards.std().item()
    torch.testing.assert_close(grpo.group_advantages(rewards, 3, "batch"), expected / (batch_std + 1e-4))
    assert torch.equal(grpo.group_advantages(torch.ones(4), 2), torch.zeros(4))   # no signal, no NaN
    with pytest.raises(ValueError, match="multiple of num_generations"):
        grpo.group_advantages(rewards, 4)


def test_policy_loss_clipping_and_reductions_by_hand():
    # two sequences: 2 tokens and 1 token; ratios exp(logp - old)
    old = torch.zeros(2, 2)
    logp = torch.tensor([[math.log(1.5), math.log(0.5)], [math.log(1.1), 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = torch.tensor([1.0, -2.0])
    cfg = grpo.LossConfig("grpo", epsilon=0.2, epsilon_high=0.28, max_completion_length=4)
    # row 0 (A=1): min(1.5, 1.28) = 1.28, min(0.5, 0.8)=0.5 -> -1.28, -0.5
    # row 1 (A=-2): min(-2.2, -2 * 1.1) = -2.2 -> +2.2
    tok = torch.tensor([[-1.28, -0.5], [2.2, 0.0]])
    loss, m = grpo.policy_loss(logp, old, adv, mask, cfg)
    torch.testing.assert_close(loss, ((tok[0].sum() / 2) + tok[1, 0]) / 2)
    assert float(m["clip_ratio/high_mean"]) == pytest.approx(1 / 3) and float(m["clip_ratio/low_mean"]) == 0
    loss, _ = grpo.policy_loss(logp, old, adv, mask, grpo.LossConfig("dapo", max_completion_length=4))
    torch.testing.assert_close(loss, (tok * mask).sum() / 3)
    loss, _ = grpo.policy_loss(logp, old, adv, mask, grpo.LossConfig("dr_grpo", max_completion_length=4))
    torch.testing.assert_close(loss, (tok * mask).sum() / (2 * 4))
    loss.backward()                        # the clipped token (ratio 1.5, A > 0) has no gradient
    assert logp.grad[0, 0] == 0 and logp.grad[0, 1] != 0
    # k3 KL to a reference, and importance weights multiply the per-token loss
    ref = torch.zeros(2, 2)
    d = -logp.detach()
    kl = torch.exp(d) - d - 1
    loss, m = grpo.policy_loss(logp, old, adv, mask, grpo.LossConfig("dapo", beta=0.1), ref_logp=ref,
                               is_weights=torch.tensor([[0.5, 1.0], [2.0, 0.0]]))
    expected = ((tok + 0.1 * kl) * torch.tensor([[0.5, 1.0], [2.0, 0.0]]) * mask).sum() / 3
    torch.testing.assert_close(loss, expected)
    assert float(m["kl"]) == pytest.approx(float((kl * mask).sum() / 3))


def test_token_logprobs_reference_in_chunks_equals_one_pass_with_gradients():
    # the reference in row chunks (checkpointed under autograd) gives each row the values and
    # gradients of the one-pass form, and the by-hand log-softmax
    from lowbit.formats.logprobs import token_logprobs
    g = torch.Generator().manual_seed(0)
    N, V = 7, 11
    logits = torch.randn(N, V, generator=g)
    targets = torch.randint(0, V, (N,), generator=g)
    results = []
    for chunk in (None, 2, 1):
        x = logits.clone().requires_grad_()
        logp, entropy = token_logprobs(x, targets, 0.7, chunk_rows=chunk)
        (logp.sum() + 0.3 * entropy.sum()).backward()
        results.append((logp.detach(), entropy.detach(), x.grad))
    for got in results[1:]:
        for a, b in zip(got, results[0]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    by_hand = torch.log_softmax(logits[3] / 0.7, -1)
    torch.testing.assert_close(results[1][0][3], by_hand[targets[3]])
    torch.testing.assert_close(results[1][1][3], -(by_hand.exp() * by_hand).sum())
    with torch.no_grad():              # no autograd: plain chunks, the same values
        logp, _ = token_logprobs(logits, targets, 0.7, chunk_rows=2)
    torch.testing.assert_close(logp, results[0][0], rtol=0, atol=1e-6)
    # what autograd keeps for the backward: the one-pass form several float32 (N, V) copies,
    # the chunked form the logits it recomputes from (views of them) and small tensors
    copy = N * V * 4
    for chunk, most in ((None, None), (1, logits.numel() * 4 + copy // 2)):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(
                lambda t: saved.append(t.numel() * t.element_size()) or t, lambda t: t):
            token_logprobs(logits.clone().requires_grad_(), targets, chunk_rows=chunk)
        assert sum(saved) > 3 * copy if most is None else sum(saved) <= most, (chunk, saved)


def _logprob_cases():
    """(logits, targets) cases: dtypes, a vocabulary not a multiple of the kernel's block, huge
    and tiny magnitudes, a row of equal logits, a NaN row, a non-contiguous view."""
    g = torch.Generator().manual_seed(1)
    V = 2048 + 37
    base = torch.randn(6, V, generator=g) * 4
    base[1] *= 1e3                         # huge (within float16): a softmax of one spike
    base[4] += 2e4                         # offset: the same distribution, about 20,000 (float32's
                                           # ulp there is 0.002: a form that subtracts lse from E[z] loses it)
    base[2] *= 1e-6                        # tiny: nearly uniform
    base[3] = 0.5                          # exact ties: uniform, entropy log V
    targets = torch.randint(0, V, (6,), generator=g)
    cases = [(base.to(dtype), targets) for dtype in (torch.float32, torch.bfloat16, torch.float16)]
    wide = torch.randn(6, 2 * V, generator=g)
    cases.append((wide[:, ::2], targets))  # a stride of 2 along V
    return cases


def _kernel_matches_reference(logits, targets, temperature=0.8):
    # the reference runs on the CPU, whose division by the temperature is IEEE's, as the
    # kernel's is: torch on CUDA multiplies by the reciprocal instead, one bit less, and at
    # logits of 2e4 (float32's ulp 0.002) that moved an entropy by 1.4e-4 (one H100, 2026-12-07)
    from lowbit.formats.logprobs import token_logprobs as reference
    x_ref = logits.detach().cpu().clone().requires_grad_()
    x_ker = logits.clone().requires_grad_()
    ref = reference(x_ref, targets.cpu(), temperature)
    got = lowbit.dispatch.token_logprobs(x_ker, targets, temperature)
    g = torch.Generator().manual_seed(2)
    g_logp, g_ent = (torch.randn(targets.shape[0], generator=g) for _ in range(2))
    (ref[0] * g_logp + ref[1] * g_ent).sum().backward()
    (got[0] * g_logp.to(logits.device) + got[1] * g_ent.to(logits.device)).sum().backward()
    for a, b in zip(got, ref):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=2e-5)
    assert x_ker.grad.dtype == logits.dtype
    tol = 1e-5 if logits.dtype == torch.float32 else 1e-2      # one rounding of the output
    torch.testing.assert_close(x_ker.grad.float().cpu(), x_ref.grad.float(), rtol=tol, atol=tol)


def test_token_logprobs_kernel_equals_the_reference_interpreted(monkeypatch):
    from tests.kernel_paths import interpreted_kernels
    interpreted_kernels()
    monkeypatch.setattr("lowbit.dispatch.logprobs.logprob_kernels_for", lambda logits: True)
    for logits, targets in _logprob_cases():
        _kernel_matches_reference(logits, targets)
    # a NaN anywhere in a row makes that row's values NaN (never made finite), its neighbours kept
    logits = torch.randn(3, 100)
    logits[1, 57] = float("nan")
    logp, entropy = lowbit.dispatch.token_logprobs(logits, torch.tensor([0, 1, 2]))
    assert logp[1].isnan() and entropy[1].isnan() and logp[[0, 2]].isfinite().all()
    # the logits' own gradient is none where neither output is used
    x = torch.randn(2, 40, requires_grad=True)
    lowbit.dispatch.token_logprobs(x, torch.tensor([1, 2]))[0].sum().backward()
    torch.testing.assert_close(x.grad.sum(-1), torch.zeros(2), atol=1e-6, rtol=0)   # d logp sums to 0


@pytest.mark.gpu
def test_token_logprobs_kernel_equals_the_reference_on_cuda():
    for logits, targets in _logprob_cases():
        _kernel_matches_reference(logits.cuda(), targets.cuda())
    # Qwen's vocabulary, the bf16 logits of a micro-batch's rows
    logits = (torch.randn(64, 151936, device="cuda") * 3).bfloat16()
    _kernel_matches_reference(logits, torch.randint(0, 151936, (64,), device="cuda"), 1.0)


def test_the_models_logits_at_positions_equal_its_full_logits_there():
    # logits_at runs the lm_head on the asked positions only: the same values as the full
    # forward's logits at them, the gradient reaching the body the same way
    from lowbit.models import ModelConfig, build_model
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=37, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16))
    ids = torch.randint(0, 37, (3, 10))
    positions = grpo.completion_positions(torch.tensor([2, 5, 9]), 4, 10)
    assert positions.tolist()[2] == [8, 9, 9, 9]                 # clamped to the input
    full = model(ids).logits
    at = model(ids, logits_at=positions).logits
    torch.testing.assert_close(at, full.gather(1, positions[:, :, None].expand(-1, -1, 37)), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="logits_at"):
        model(ids, ids, logits_at=positions)


def test_importance_weights_by_hand():
    old = torch.log(torch.tensor([[0.5, 0.9, 0.1]]))
    rollout = torch.log(torch.tensor([[0.25, 0.9, 0.4]]))        # ratios 2, 1, 0.25
    mask = torch.tensor([[1.0, 1.0, 1.0]])
    w, m = grpo.importance_weights(old, rollout, mask, "token", "truncate", cap=1.5)
    torch.testing.assert_close(w, torch.tensor([[1.5, 1.0, 0.25]]))
    assert float(m["sampling/importance_sampling_ratio/max"]) == pytest.approx(2.0)
    assert float(m["sampling/importance_sampling_ratio/min"]) == pytest.approx(0.25)
    assert float(m["sampling/importance_sampling_ratio/capped_frac"]) == pytest.approx(1 / 3)
    w, _ = grpo.importance_weights(old, rollout, mask, "token", "mask", cap=1.5)
    torch.testing.assert_close(w, torch.tensor([[0.0, 1.0, 0.25]]))
    w, _ = grpo.importance_weights(old, rollout, mask, "sequence", "truncate", cap=3.0)
    torch.testing.assert_close(w, torch.full((1, 3), 0.5))       # 2 * 1 * 0.25
    m = grpo.mismatch_metrics(rollout, old, mask)
    diffs = torch.tensor([math.log(2), 0, math.log(4)])
    assert float(m["sampling/sampling_logp_difference/mean"]) == pytest.approx(float(diffs.mean()))
    assert float(m["sampling/sampling_logp_difference/max"]) == pytest.approx(math.log(4))
    d = old - rollout
    assert float(m["sampling/kl_k3"]) == pytest.approx(float((torch.exp(d) - d - 1).mean()))


def test_routing_replay_makes_the_trainers_experts_the_engines():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, dim=64, n_layers=2, n_heads=2, n_experts=4, max_seq_len=32)
    model = build_model(cfg).eval()
    assert enable_routing_replay(model) == 2
    x = torch.randint(0, 64, (2, 6))
    routed = torch.stack([torch.stack([torch.randperm(4)[:2] for _ in range(6)]) for _ in range(2)])
    routed = routed[:, :, None].expand(2, 6, 2, 2).clone()      # (B, T, layers, k)
    routed[1, 5] = -1                                           # not recorded: the trainer chooses
    chosen = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, o: chosen.append(o[2]))
             for layer in model.model.layers]
    with torch.no_grad(), replay_routing(model, routed):
        replayed = model(x).logits
    for i, index in enumerate(chosen):
        index = index.view(2, 6, 2)
        assert torch.equal(index[0], routed[0, :, i]) and torch.equal(index[1, :5], routed[1, :5, i])
        own = model.model.layers[i].mlp.gate.own_index.view(2, 6, 2)
        assert torch.equal(index[1, 5], own[1, 5])
    for h in hooks:
        h.remove()
    with torch.no_grad():
        plain = model(x).logits                                 # outside: the model's own routing
    assert not torch.allclose(plain, replayed)
    own = torch.stack([layer.mlp.gate.own_index.view(2, 6, 2) for layer in model.model.layers], 2)
    assert routing_agreement(model, own) == 1.0


def test_hugging_face_qwen3_moe_through_engine_and_trainer():
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=32, norm_topk_prob=True,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(hf_cfg).eval()
    cfg = ModelConfig(vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, qk_norm=True,
                      n_experts=4, experts_per_token=2, moe_ffn_dim=32, norm_eps=hf_cfg.rms_norm_eps,
                      max_seq_len=32)
    engine = RolloutEngine(cfg, max_batch_size=4)
    engine.load_state_dict(hf.state_dict())
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    rollout = engine.generate(prompts, SamplingParams(max_new_tokens=6, seed=0))
    trainer = build_model(cfg)
    trainer.load_state_dict(hf.state_dict())                  # the trainer takes the same names
    for b, p in enumerate(prompts):
        seq = torch.tensor([p + rollout.completion_lists()[b]])
        with torch.no_grad():
            for model in (hf, trainer):
                logits = model(seq).logits[0].float()
                lp = torch.log_softmax(logits, -1)[len(p) - 1:-1].gather(-1, seq[0, len(p):, None])[:, 0]
                torch.testing.assert_close(lp, rollout.logprobs[b], atol=5e-5, rtol=0)


def _config(tmp_path, **kw):
    base = dict(warmstart_steps=60, steps=4, prompts_per_step=2, num_generations=4, eval_every=0,
                eval_problems=8, max_completion_length=4, checkpoint_every=2, progress=False,
                out_dir=str(tmp_path), rollout="nvfp4", align="quads", lr=3e-3)
    base.update(kw)
    return RLConfig(**base)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_reference_policy_runs_as_the_policy_does(tmp_path, device):
    """The reference policy (beta > 0) is the warm-start policy, so at the first step its
    log-probs are the policy's and the KL is 0: it runs under the trainer's autocast, as the
    policy does (in float32 on a GPU, against the policy's bf16, the first step's KL was bf16's
    rounding, not 0)."""
    config = _config(tmp_path, steps=1, beta=0.04, rollout="bf16", align="none", checkpoint_every=0,
                     device=device)
    [record] = [r for r in run_rl(config).records if r["event"] == "train"]
    assert record["kl"] == pytest.approx(0.0, abs=1e-7)   # bf16 against float32: about 1e-4


def test_the_compiled_trainer_takes_the_eager_steps(tmp_path):
    """--compile runs each of the trainer's decoder layers through torch.compile: QUADS's steps
    (asymmetric QAT, NVFP4 rollouts) have the eager run's losses and gradient norms, to float
    rounding, and every layer, micro-batch and step runs the one graph compiled for the first
    layer (with a gradient, and without for the old log-probs)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()   # the graphs counted are this test's, whatever compiled before it

    runs = []
    for compiled in (False, True):
        config = _config(tmp_path, run_name=f"compiled-{compiled}", steps=3, checkpoint_every=0,
                         num_iterations=2, compile=compiled, device="cpu")
        trainer = GRPOTrainer(config)
        layers = trainer.policy.model.layers
        assert all((layer._compiled_call_impl is not None) == compiled for layer in layers)
        assert len(layers) > 1 and trainer.step_fn.forward is trainer.policy   # the model itself eager
        graphs = counters["stats"]["unique_graphs"]
        runs.append([(r["loss"], r["grad_norm"]) for r in trainer.run().records if r["event"] == "train"])
        if compiled:   # one graph with a gradient, one without (the old log-probs)
            assert counters["stats"]["unique_graphs"] - graphs == 2
    eager, compiled = runs
    assert len(eager) == 3 and eager[0][1] > 0
    for a, b in zip(eager, compiled):
        assert b == pytest.approx(a, rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_shared_prompts_take_the_steps_of_whole_rows(tmp_path, compile):
    """--share-prompts runs each prompt once for its group of completions: the policy's loss
    pass, its no-grad pass (num_iterations 2) and the reference policy's (beta > 0) give the
    losses and gradient norms of each completion's whole row, to float rounding, QUADS's
    asymmetric QAT and NVFP4 rollouts included; compiled too (one graph a pass)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()   # the graphs counted are this test's, whatever compiled before it

    runs = []
    for share in (False, True):
        config = _config(tmp_path, run_name=f"share-{share}-{compile}", steps=2, checkpoint_every=0,
                         num_iterations=2, beta=0.04, prompts_per_step=4, micro_batch_size=8,
                         share_prompts=share, max_completion_length=6, compile=compile, device="cpu")
        trainer = GRPOTrainer(config)
        graphs = counters["stats"]["unique_graphs"]
        records = [r for r in trainer.run().records if r["event"] == "train"]
        runs.append([(r["loss"], r["grad_norm"], r["kl"]) for r in records])
        # the policy's two passes and the reference's, over two micro-batches of two groups; at
        # most 6 completion tokens, never the 8 rows of a micro-batch: torch.compile takes sizes
        # equal when first traced as equal always (duck sizing), and compiles once more when they part
        if compile and share:
            assert counters["stats"]["unique_graphs"] - graphs <= 3
    rows, shared = runs
    assert len(rows) == 2 and rows[0][1] > 0
    assert shared[0] == pytest.approx(rows[0], rel=1e-4, abs=1e-6)
    # Adam's steps divide by the gradients' own size, so their rounding grows from step to step
    assert shared[1] == pytest.approx(rows[1], rel=1e-2, abs=1e-4)


def test_shared_tokens_put_the_recorded_experts_where_the_shared_layout_runs_them():
    # two prompts (2 and 3 tokens, padded to 3) of two completions each (2 tokens); rows of
    # prompt + completion, T = 5; one layer, k = 1: each row's recorded expert is 10 * row + position
    from lowbit.rl.trainer import shared_tokens

    routed = (10 * torch.arange(4)[:, None] + torch.arange(5)).reshape(4, 5, 1, 1)
    routed[:2, 4] = -1                               # rows 0 and 1 end at 4 tokens: nothing recorded
    lengths = torch.tensor([2, 2, 3, 3])
    prompt_ids, completions = torch.zeros(4, 3, dtype=torch.int64), torch.zeros(4, 2, dtype=torch.int64)
    got = shared_tokens(routed, lengths, completions, prompt_ids, 2).reshape(-1).tolist()
    assert got == [0, 1, -1,  20, 21, 22,            # prompts from rows 0 and 2, padding -1
                   2, 3,  12, 13,  23, 24,  33, 34]  # completions at p_b + j
    assert shared_tokens(routed, lengths, completions, prompt_ids, 0) is routed
    assert shared_tokens(None, lengths, completions, prompt_ids, 2) is None


def test_shared_prompts_replay_an_moe_policys_routing(tmp_path):
    """--share-prompts on an MoE policy with routing replay: the engine's experts, recorded at
    each row's positions, are replayed at the shared layout's tokens (shared_tokens), so with a
    bf16 engine (float32 on the CPU) every recorded position agrees and the log-probs are the
    engine's; the steps are the rows' (two iterations: the no-grad pass replays too)."""
    runs = []
    for share in (False, True):
        config = _config(tmp_path, run_name=f"moe-share-{share}", rollout="bf16", align="none",
                         n_experts=4, warmstart_steps=40, steps=2, prompts_per_step=4,
                         checkpoint_every=0, routing_replay=True, share_prompts=share, device="cpu")
        runs.append([r for r in run_rl(config).records if r["event"] == "train"])
    rows, shared = runs
    assert all(r["routing/agreement"] == 1.0 for r in shared)
    assert all(r["sampling/sampling_logp_difference/max"] < 1e-5 for r in shared)
    keys = ("loss", "grad_norm")
    assert [shared[0][k] for k in keys] == pytest.approx([rows[0][k] for k in keys], rel=1e-4, abs=1e-6)




def test_warm_start_stops_at_its_target_accuracy(tmp_path, monkeypatch):
    import lowbit.rl.warmstart as warmstart

    # an accuracy that climbs 0.1 per check: the target 0.25 is reached at the third check
    checks = []

    def climbing(engine, task, tokenizer, problems, max_new_tokens, stop_ids):
        checks.append(len(problems))
        return 0.1 * len(checks)

    monkeypatch.setattr(warmstart, "greedy_accuracy", climbing)
    config = _config(tmp_path, warmstart_steps=80, warmstart_target=0.25, task_size=2, steps=1)
    task = get_task("add", digits=2)
    state = warmstart.warm_start(config, task, warmstart.policy_config(config, task), "cpu",
                                 lambda message: None)
    assert checks == [warmstart.VALIDATION_PROBLEMS] * 3        # checked every 80 // 40 steps
    [run] = [p for p in (tmp_path / "warmstart").iterdir() if p.is_dir()]   # beside it: its lock
    final = json.loads((run / "final.json").read_text())
    assert final["steps"] == 6
    hooks = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [round(r["validation_accuracy"], 6) for r in hooks if r["event"] == "hook"] == [0.1, 0.2, 0.3]
    assert set(state) == set(warmstart.warm_start(config, task, warmstart.policy_config(config, task),
                                                  "cpu", lambda message: None))   # cached now
    assert len(checks) == 3
    # the target is part of the cache key: without it the warm start is another run
    plain = _config(tmp_path, warmstart_steps=80, task_size=2, steps=1)
    warmstart.warm_start(plain, task, warmstart.policy_config(plain, task), "cpu", lambda m: None)
    assert len([p for p in (tmp_path / "warmstart").iterdir() if p.is_dir()]) == 2 and len(checks) == 3


def test_warm_start_validation_set_is_held_out_and_distinct():
    task = get_task("add", digits=2)
    held_out = task.eval_problems(256)
    both = task.eval_problems(256 + 256)
    assert both[:256] == held_out and len({p.prompt for p in both}) == 512
    with pytest.raises(ValueError, match="too few distinct problems"):
        import lowbit.rl.warmstart as warmstart
        config = RLConfig(warmstart_steps=10, warmstart_target=0.5, task_size=1, progress=False,
                          out_dir="/nonexistent-lowbit-test")
        small = get_task("add", digits=1)
        warmstart.warm_start(config, small, warmstart.policy_config(config, small), "cpu", print)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_micro_batches_split_the_work_not_the_loss(tmp_path, loss_type):
    """--micro-batch-size runs the trainer's passes on parts of a step's completions: the first
    step (the same rollouts) has the loss, gradient norm, mismatch and clip metrics of the step
    taken at once, to float rounding, for every loss type (dapo's token mean divides by the
    whole step's count); micro-batches of the whole step are the step at once, bit for bit."""
    kw = dict(steps=1, prompts_per_step=2, num_generations=4, loss_type=loss_type, beta=0.04,
              importance_sampling="token", num_iterations=2, checkpoint_every=0)
    whole = run_rl(_config(tmp_path, run_name="whole", **kw)).records
    same = run_rl(_config(tmp_path, run_name="same", micro_batch_size=8, **kw)).records
    parts = run_rl(_config(tmp_path, run_name="parts", micro_batch_size=2, **kw)).records
    timing = ("time/", "rollout/tokens_per_s")
    pick = lambda records: [{k: v for k, v in r.items() if not k.startswith(timing)}
                            for r in records if r["event"] == "train"]
    assert pick(same) == pick(whole)
    (a,), (b,) = pick(whole), pick(parts)
    assert a.keys() == b.keys() and a["reward"] == b["reward"]
    for key in ("loss", "grad_norm", "kl", "sampling/sampling_logp_difference/mean", "entropy",
                "clip_ratio/region_mean"):
        assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    with pytest.raises(ValueError, match="--micro-batch-size must divide a step's 8 completions"):
        _config(tmp_path, micro_batch_size=3)


@pytest.mark.parametrize("is_level,is_mode", [("token", "truncate"), ("sequence", "mask")])
def test_on_policy_old_logprobs_come_from_the_update_and_equal_a_separate_pass(tmp_path, is_level,
                                                                               is_mode):
    """With one iteration the update's own forward gives the old log-probs (GRPOBatch.logp_old
    None): over a step's micro-batches, with a reference model, routing replay and importance
    sampling, the same losses and gradients bit for bit as old log-probs from a separate no-grad
    pass (the path of more iterations), and the same mismatch, entropy, importance-sampling and
    routing metrics (to rounding; minima and maxima exactly); a run takes that pass only for
    its reference model."""
    from lowbit.rl.trainer import GRPOBatch, GRPOTrainer, measure_old_policy, reduce_metrics
    from lowbit.train.graphs import accumulate_gradients, split_batch

    cfg = _config(tmp_path, steps=1, prompts_per_step=2, num_generations=4, checkpoint_every=0,
                  n_experts=4, warmstart_steps=4, routing_replay=True, micro_batch_size=2,
                  beta=0.04, importance_sampling=is_level, is_mode=is_mode, is_cap=1.2)
    trainer = GRPOTrainer(cfg)
    problems, rollout = trainer.generate(0)
    batch = trainer.batch(rollout)
    advantages = grpo.group_advantages(trainer.score(problems, rollout), 4,
                                       cfg.scale_rewards).to(trainer.device)
    mask = batch.mask.float()
    separate: dict = {}
    logp_old, entropy, ref_logp = trainer.old_logprobs(batch, batch.routed, separate)
    weights, measured = measure_old_policy(logp_old, entropy, batch.rollout_logprobs, mask,
                                           (is_level, is_mode, 1.2))
    separate.update(measured)
    apart = GRPOBatch(batch.input_ids, batch.prompt_lengths, batch.completions, mask, logp_old,
                      advantages, weights, ref_logp, batch.routed, (mask.sum() / 4).expand(8))
    short = apart._replace(logp_old=None, is_weights=None, rollout_logp=batch.rollout_logprobs,
                           engine_routed=batch.routed)
    results = []
    for step_batch in (apart, short):
        trainer.policy.zero_grad()
        trainer.loss_fn.metrics = []
        with trainer.step_fn.autocast:
            loss = accumulate_gradients(lambda mb: trainer.loss_fn(trainer.policy, mb), step_batch, 4)
        results.append((loss, [p.grad.clone() for p in trainer.policy.parameters() if p.grad is not None],
                        trainer.loss_fn.metrics))
    (loss_a, grads_a, parts_a), (loss_s, grads_s, parts_s) = results
    assert torch.equal(loss_a, loss_s) and len(grads_a) == len(grads_s)
    assert all(torch.equal(g, h) for g, h in zip(grads_a, grads_s))
    measured = reduce_metrics([(separate, mask.sum()), *parts_a])   # as train_on reduces them
    metrics_s = reduce_metrics(parts_s)
    assert measured.keys() == metrics_s.keys() and "routing/agreement" in metrics_s
    for key, value in measured.items():
        if key.endswith(("/min", "/max")):
            assert metrics_s[key] == value, key
        else:
            assert metrics_s[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    with pytest.raises(ValueError, match="needs rollout_logp"):
        trainer.loss_fn(trainer.policy, split_batch(short._replace(rollout_logp=None), 4)[0])
    calls = []
    original = trainer.old_logprobs
    trainer.old_logprobs = lambda *a, **k: calls.append(k.get("policy", True)) or original(*a, **k)
    trainer.run()
    assert calls == [False]   # the run's one step: the reference's pass only


def test_a_micro_batch_without_loss_tokens_measures_nothing():
    """Metrics over no loss tokens (every completion masked out, e.g. all truncated under
    --mask-truncated-completions) stay out of the step's: a step one of whose micro-batches has
    none gives its other's numbers exactly, and a step with none has no mismatch metrics (its
    importance ratio's min and max are 1)."""
    from lowbit.rl.trainer import measure_old_policy, reduce_metrics

    g = torch.Generator().manual_seed(0)
    old, rollout, entropy = (torch.randn(2, 3, generator=g) for _ in range(3))
    some, none = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]), torch.zeros(2, 3)
    part = lambda mask: (measure_old_policy(old, entropy, rollout, mask, ("token", "truncate", 1.5))[1],
                         mask.sum())
    alone = reduce_metrics([part(some)])
    assert reduce_metrics([part(some), part(none)]) == alone == reduce_metrics([part(none), part(some)])
    assert {"sampling/sampling_logp_difference/max", "entropy"} <= alone.keys()
    empty = reduce_metrics([part(none), part(none)])
    assert not any(k.startswith(("sampling/sampling_logp", "sampling/kl")) for k in empty), empty
    assert empty["sampling/importance_sampling_ratio/min"] == empty["sampling/importance_sampling_ratio/max"] == 1.0


class HostReads(TorchDispatchMode):
    """Counts what makes the host wait for the device, among the ops below autograd (the
    backward's too): a value read back (.item(), float(), int(), `if tensor`: all
    aten._local_scalar_dense) and a result whose shape the values decide (nonzero, indexing
    with a boolean mask); .tolist() of a CPU tensor runs no op, so the test counts it by
    `read()`. Not counted: the model's forward (lowbit.models) reading on the CPU what a GPU
    does not (F.one_hot's check of its indices, the MoE reference's expert token counts)."""

    READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
             torch.ops.aten.masked_select.default)
    PACKAGE, MODELS = (str(Path(module.__file__).parent) for module in (lowbit, lowbit.models))

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def read(self) -> None:
        frame = sys._getframe(1)
        while frame is not None and not frame.f_code.co_filename.startswith(self.PACKAGE):
            frame = frame.f_back   # to the innermost frame in lowbit: who asked for the read
        self.count += frame is None or not frame.f_code.co_filename.startswith(self.MODELS)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.READS or (func is torch.ops.aten.index.Tensor and any(
                i is not None and i.dtype == torch.bool for i in args[1])):
            self.read()
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("num_iterations", [1, 2])
def test_a_step_reads_its_metrics_back_once_whatever_its_micro_batches(tmp_path, monkeypatch,
                                                                       num_iterations):
    """train_on leaves each micro-batch's metrics on the device and reads them all back after
    the last (on a GPU every read waits for the launch queue to drain, and the RL step is
    launch-bound): the step in 4 micro-batches reads as often as the step at once, on-policy
    and with a no-grad pass first, with a reference model, routing replay, importance sampling
    and asymmetric QAT. What remains is the step's own: the gradient norm, TrainStep's loss,
    the metrics' one read (and on the CPU the optimizer's step counts)."""
    from lowbit.rl.trainer import GRPOTrainer

    tolist, host = torch.Tensor.tolist, HostReads()   # host: the count of the train_on under way
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: host.read() or tolist(t))
    reads = {}
    for micro in (8, 2):
        trainer = GRPOTrainer(_config(tmp_path, run_name=f"micro-{micro}", steps=1, checkpoint_every=0,
                                      n_experts=4, warmstart_steps=4, routing_replay=True, beta=0.04,
                                      importance_sampling="token", num_iterations=num_iterations,
                                      micro_batch_size=micro))
        try:
            problems, rollout = trainer.generate(0)
            rewards, batch = trainer.score(problems, rollout), trainer.batch(rollout)
            with HostReads() as host:
                metrics = trainer.train_on(0, batch, rewards)
            reads[micro] = host.count
        finally:
            trainer.folder.release()
        assert metrics is not None and {"routing/agreement", "kl", "entropy"} <= metrics.keys()
    assert reads[2] == reads[8] > 0, reads


def test_without_a_micro_batch_size_the_step_is_split_to_a_token_budget(tmp_path, monkeypatch):
    """No --micro-batch-size: the largest divisor of the step's completions whose micro-batch
    holds at most MICRO_BATCH_TOKENS tokens (longest held-out prompt + completion each); a
    small step runs at once, a budget below it splits it, and the step is the same to float
    rounding (the split itself is tested above)."""
    import lowbit.rl.trainer as trainer
    from lowbit.rl.trainer import GRPOTrainer, auto_micro_batch

    assert auto_micro_batch(128, 122 + 128) == 32      # a 0.6B GSM8K step of 128 (8,192 tokens)
    assert auto_micro_batch(128, 64) == 128 and auto_micro_batch(8, 10**6) == 1
    assert auto_micro_batch(12, 8_192 // 5) == 4       # 5 fit; 4 is the largest divisor that does
    assert auto_micro_batch(12, 8_192 // 5, group=3) == 3 and auto_micro_batch(8, 10**6, group=4) == 4
    kw = dict(steps=1, prompts_per_step=2, num_generations=4, checkpoint_every=0)
    assert GRPOTrainer(_config(tmp_path, run_name="whole", **kw)).micro_batch_size == 8
    monkeypatch.setattr(trainer, "MICRO_BATCH_TOKENS", 1)           # every completion alone
    split = GRPOTrainer(_config(tmp_path, run_name="split", **kw))
    assert split.micro_batch_size == 1 and split.step_fn.config.grad_accum_steps == 8
    assert "in micro-batches of 1" in split.describe()
    # the size chosen is the run's: a resume under another budget keeps it
    kw.update(steps=2, run_name="kept")
    run_rl(_config(tmp_path, max_steps_per_session=1, **kw))
    monkeypatch.setattr(trainer, "MICRO_BATCH_TOKENS", 10**6)
    assert GRPOTrainer(_config(tmp_path, **kw), resume=True).micro_batch_size == 1


def test_the_trainers_engine_takes_racs_channel_group(tmp_path):
    from lowbit.rl.trainer import GRPOTrainer

    kw = dict(steps=1, prompts_per_step=2, num_generations=4, checkpoint_every=0)
    engine = GRPOTrainer(_config(tmp_path, rac_group=16, **kw)).engine
    assert engine.rac_group == 16 and engine.rac_ratio == 0.25
    assert engine.weights.layers[0].qkv_proj.rac_group == 16
    # and RAC's residual folded into the activation (--rac-fold); without RAC it is refused
    engine = GRPOTrainer(_config(tmp_path, rac_fold=True, run_name="fold", **kw)).engine
    assert engine.rac_fold and engine.weights.layers[0].qkv_proj.rac_fold
    with pytest.raises(ValueError, match="--rac-fold adds RAC's residual into the activation: give a --rac-ratio"):
        _config(tmp_path, rac_fold=True, align="none", rollout="nvfp4", run_name="nofold")
    # its setting label, and --compare's setting read back from it
    from lowbit.rl.compare import config_for_setting
    folded = _config(tmp_path, rac_fold=True, rac_group=64)
    assert folded.setting == "nvfp4+quads+g64+fold"
    back = config_for_setting(_config(tmp_path), folded.setting)
    assert (back.rac_fold, back.rac_group, back.setting) == (True, 64, folded.setting)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_resume_is_exact(tmp_path, compile):
    # --compile (on the CPU): the resumed run compiles its layers again and takes the same steps
    kw = dict(compile=True, device="cpu") if compile else {}
    straight = run_rl(_config(tmp_path, run_name="a", **kw))     # both read one cached warm start
    first = run_rl(_config(tmp_path, run_name="b", max_steps_per_session=2, **kw))
    assert first.steps == 2
    assert not (first.run_dir / "final.json").exists()     # a session's end is not the run's
    resumed = run_rl(_config(tmp_path, run_name="b", **kw), resume=True)
    keys = ("reward", "loss", "grad_norm", "sampling/sampling_logp_difference/mean")
    pick = lambda result: [[r[k] for k in keys] for r in result.records if r["event"] == "train"]
    assert pick(straight) == pick(resumed) and len(pick(resumed)) == 4
    assert any(r["grad_norm"] > 0 for r in straight.records if r["event"] == "train")
    with pytest.raises(ValueError, match="config differs"):
        run_rl(_config(tmp_path, run_name="b", lr=1e-4, **kw), resume=True)
    with pytest.raises(ValueError, match="already holds a run"):
        run_rl(_config(tmp_path, run_name="b", **kw))


def test_moe_policy_through_rl_with_routing_replay(tmp_path):
    """An MoE policy through warm start, engine and GRPO steps. With a bf16 engine (float32 on
    the CPU) the trainer routes every recorded position as the engine did: an agreement of 1.0
    says the engine's recorded experts line up with the trainer's positions, and the log-probs
    agree to rounding. With nvfp4 rollouts, replay gives the trainer the engine's experts."""
    kw = dict(n_experts=4, warmstart_steps=40, steps=2, prompts_per_step=4, checkpoint_every=0,
              routing_replay=True)
    train = lambda result: [r for r in result.records if r["event"] == "train"]
    exact = train(run_rl(_config(tmp_path, run_name="bf16", rollout="bf16", align="none", **kw)))
    assert len(exact) == 2
    assert all(r["routing/agreement"] == 1.0 for r in exact)
    assert all(r["sampling/sampling_logp_difference/max"] < 1e-5 for r in exact)
    quantized = train(run_rl(_config(tmp_path, run_name="nvfp4", rollout="nvfp4", align="qat", **kw)))
    assert all(0 < r["routing/agreement"] <= 1 and r["sampling/sampling_logp_difference/max"] > 1e-3
               for r in quantized)
    assert any(r["grad_norm"] > 0 for r in exact + quantized)


def test_kl_iterations_truncation_masking_and_sequence_is_through_the_loop(tmp_path):
    """beta > 0 (a reference model), num_iterations = 2, mask_truncated_completions and
    sequence-level masked importance sampling, through GRPOTrainer's pieces and its loop."""
    from lowbit.rl.trainer import GRPOTrainer

    cfg = _config(tmp_path, run_name="options", rollout="nvfp4", align="none", steps=2,
                  checkpoint_every=0, beta=0.04, num_iterations=2, mask_truncated_completions=True,
                  importance_sampling="sequence", is_mode="mask", is_cap=1.5, max_completion_length=3)
    trainer = GRPOTrainer(cfg)
    _, rollout = trainer.generate(0)
    batch = trainer.batch(rollout)
    assert (~rollout.stopped).any() and rollout.stopped.any()     # some rows truncated at 3 tokens
    assert torch.equal(batch.mask, rollout.completion_mask & rollout.stopped[:, None])
    records = [r for r in trainer.run().records if r["event"] == "train"]
    assert len(records) == 2
    for p in trainer.policy.parameters():                         # two optimizer steps per RL step
        assert int(trainer.optimizer.state[p]["step"]) == 4
        break
    # the metrics are the second iteration's: the policy has moved from the reference by then
    assert all(r["kl"] >= 0 for r in records) and any(r["kl"] > 0 for r in records)
    assert all(0 <= r["sampling/importance_sampling_ratio/capped_frac"] <= 1 for r in records)


def test_tasks_are_seeded_and_held_out():
    task = get_task("countdown")
    held = {p.prompt for p in task.eval_problems(50)}
    a = task.problems(0, 3, 20, exclude=held)
    assert a == task.problems(0, 3, 20, exclude=held) and not held & {p.prompt for p in a}
    assert all(task.reward(p, p.solution) == 1.0 for p in a)
    p = a[0]
    nums = p.prompt.split(" -> ")[0].split()[1:]
    assert task.reward(p, "+".join(nums) + "\n") == float(sum(map(int, nums)) == int(p.answer))
    assert task.reward(p, "99\n") == 0.0                          # must use the numbers
    with pytest.raises(ValueError, match="held-out set covers"):
        get_task("add", digits=1).problems(0, 0, 4, exclude={f"{a}+{b}=" for a in range(10) for b in range(10)})


def test_worked_addition_shows_each_column_and_rewards_the_sum():
    task = get_task("add-worked", digits=4)
    plain = get_task("add", digits=4)
    held = task.eval_problems(200)
    assert [(p.prompt, p.answer) for p in held] == [(p.prompt, p.answer) for p in plain.eval_problems(200)]
    for p in held:
        a, b = map(int, p.prompt.removesuffix("=").split("+"))
        *columns, last = p.solution.removesuffix("\n").split(" ")
        assert last == f"={a + b}" and len(columns) == 4 and task.reward(p, p.solution) == 1.0
        carry = 0
        for i, column in enumerate(columns):           # from the right, each with its carry in
            x, y = a // 10 ** i % 10, b // 10 ** i % 10
            assert column == f"{x}+{y}{'+1' if carry else ''}={x + y + carry}", (p, column)
            carry = (x + y + carry) // 10
        assert 30 <= len(p.solution) <= 41
    p = held[0]
    assert task.reward(p, f"wrong work ={p.answer}\nmore") == 1.0      # the answer after the last "="
    assert task.reward(p, f"{p.solution[:-1]}0\n") == 0.0
    assert task.reward(p, p.answer + "\n") == 0.0                       # no "=": no answer
    assert task.name == "addw4"


def test_a_completion_limit_below_the_solutions_is_warned(tmp_path, capsys):
    from lowbit.cli import main

    flags = ["rl", "--task", "add-worked", "--task-size", "3", "--steps", "1", "--warmstart-steps", "1",
             "--eval-problems", "4", "--eval-every", "0", "--prompts-per-step", "1", "--num-generations", "2",
             "--rollout", "bf16", "--align", "none", "--no-progress", "--device", "cpu", "--out-dir", str(tmp_path)]
    assert main([*flags, "--max-completion-length", "8"]) == 0
    err = capsys.readouterr().err
    assert "--max-completion-length 8 is shorter than 4 of the 4 held-out problems' reference" in err
    assert main([*flags, "--max-completion-length", "40", "--overwrite"]) == 0
    assert "max-completion-length" not in capsys.readouterr().err


def test_gsm8k_loads_and_its_reward_reads_the_final_number(corpus_env):
    task = get_task("gsm8k")
    assert (len(task.train), len(task.test)) == (7473, 1319)        # shared/data/gsm8k's splits
    assert not {p.prompt for p in task.train} & {p.prompt for p in task.test}
    first = task.eval_problems(3)[0]                                 # the test split, in order
    assert first.prompt.startswith("Question: Janet") and first.prompt.endswith("\nAnswer:")
    assert first.answer == "18" and "<<" not in first.solution and first.solution.endswith("\n")
    # every reference solution earns its reward: the number after its "####"
    assert all(task.reward(p, p.solution) == 1.0 for p in task.test)
    for completion, reward in ((" 16 - 3 - 4 = 9 eggs, 9 * 2 = 18 #### 18", 1.0),
                               ("She makes $18.00 a day.", 1.0),       # no "####": the last number
                               ("#### 18.", 1.0),                       # a closing period
                               ("#### 19", 0.0), ("#### 18 then 19", 0.0), ("eighteen", 0.0),
                               ("#### -18", 0.0)):
        assert task.reward(first, completion) == reward, completion
    big = next(p for p in task.test if int(p.answer) >= 1000)
    assert task.reward(big, f"#### {int(big.answer):,}") == 1.0     # 1,000 reads as 1000
    assert task.problems(0, 0, 4) == task.problems(0, 0, 4)          # seeded draws from train


def test_cli_rl_runs(tmp_path, capsys, figures):
    """`lowbit rl --quick` in this process (tests/test_robustness.py's table holds the bad flags)."""
    from lowbit.cli import main

    assert main(["rl", "--quick", "--no-progress", "--out-dir", str(tmp_path)]) == 0
    assert "| nvfp4+quads |" in capsys.readouterr().out
    run = tmp_path / "rl-tiny-add-nvfp4+quads"
    assert (run / "rl.png").is_file() and (run / "checkpoints" / "latest.pt").is_file()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert {"reward", "sampling/sampling_logp_difference/max", "rollout/tokens_per_s"} <= set(
        next(r for r in records if r["event"] == "train"))
    assert main(["rl", "--quick", "--no-progress", "--rollout", "bf16", "--align", "none",
                 "--out-dir", str(tmp_path)]) == 0
    assert "| bf16 |" in capsys.readouterr().out


def test_cli_rl_compare_runs_every_setting_on_the_same_seeds(tmp_path, capsys):
    from lowbit.cli import main

    assert main(["rl", "--quick", "--compare", "bf16,nvfp4,nvfp4+quads", "--no-progress",
                 "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert all(f"| {s} |" in out for s in ("bf16", "nvfp4", "nvfp4+quads"))
    folder = tmp_path / "compare-add"
    assert (folder / "rl.png").is_file() and (folder / "summary.md").is_file()
    rows = {r["setting"]: r for r in json.loads((folder / "summary.json").read_text())}
    assert {r["seed"] for r in rows.values()} == {0} and {r["steps"] for r in rows.values()} == {3}
    assert rows["bf16"]["logp_gap_mean"] < 1e-5            # float32 engine and trainer on the CPU
    # the same prompts and seeds: QUADS (QAT + RAC) narrows naive NVFP4's log-prob gap
    assert 0 < rows["nvfp4+quads"]["logp_gap_mean"] < rows["nvfp4"]["logp_gap_mean"]


def test_cli_rl_compare_over_seeds_pairs_the_common_evaluators_change(tmp_path, capsys):
    # every setting at every seed, named -s<seed>; the paired table of lowbit train --compare
    # on the bf16 evaluator's accuracy change from step 0, in points, higher is better
    from lowbit.cli import main
    from lowbit.rl.compare import accuracy_change_curve, paired_metric
    from lowbit.train.metrics import read_metrics

    assert main(["rl", "--quick", "--compare", "bf16,nvfp4", "--seeds", "0,1", "--no-progress",
                 "--compare-window", "2", "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    folder = tmp_path / "compare-add"
    runs = {p.name for p in tmp_path.iterdir() if p.name.startswith("rl-")}
    assert runs == {f"rl-tiny-add-{s}-s{seed}" for s in ("bf16", "nvfp4") for seed in (0, 1)}
    paired = json.loads((folder / "seeds" / "summary.json").read_text())
    metric = paired_metric(2)
    assert paired["metric"] == metric and "mean of the last 2 evaluations" in metric
    assert paired["relative"] is False
    assert paired["higher_is_better"] is True and paired["baseline"] == "bf16"
    (arm,) = paired["arms"]
    assert arm["arm"] == "nvfp4" and arm["seeds"] == [0, 1]
    for seed, gap in zip((0, 1), arm["gaps_pct"]):   # each gap is the two runs' changes apart
        changes = [dict(accuracy_change_curve(read_metrics(tmp_path / f"rl-tiny-add-{s}-s{seed}"),
                                              2))[paired["step"]] for s in ("nvfp4", "bf16")]
        assert gap == pytest.approx(changes[0] - changes[1])
        assert accuracy_change_curve(read_metrics(tmp_path / f"rl-tiny-add-bf16-s{seed}"))[0] == (0, 0.0)
    assert f"{metric} at step {paired['step']}" in out and "%" not in arm["verdict"]
    assert (folder / "seeds" / "seeds.png").is_file()
    # benchmarks/rl_raw.py gathers these runs into a results file: each run's evaluations and
    # steps as its metrics hold them, the paired table as written, no scratch path
    from run_helpers import ROOT, script_module
    raw_file = tmp_path / "raw.json"
    summary_file = folder / "seeds" / "summary.json"   # a comparison run from elsewhere: relative paths
    summary_file.write_text(summary_file.read_text().replace(f"{tmp_path}/", "../scratch/"))
    assert script_module(ROOT / "benchmarks" / "rl_raw.py").main(
        [str(raw_file), f"seeds={tmp_path}", "--date", "2026-12-06", "--commit", "abc1234",
         "--machine", "2-core CPU", "--command", "lowbit rl --quick ..."]) == 0
    raw = json.loads(raw_file.read_text())
    assert raw["meta"]["machine"] == "2-core CPU"
    assert str(tmp_path) not in raw_file.read_text() and "scratch" not in raw_file.read_text()
    # the paired table as written, its run folders named without the scratch path
    assert raw["results"]["comparisons"]["seeds"]["seeds"] == json.loads(
        json.dumps(paired).replace(f"{tmp_path}/", ""))
    run = raw["results"]["runs"]["seeds/rl-tiny-add-nvfp4-s1"]
    assert run["setting"] == "nvfp4" and run["seed"] == 1 and run["config"]["rollout"] == "nvfp4"
    records = read_metrics(tmp_path / "rl-tiny-add-nvfp4-s1")
    evals = [r for r in records if r["event"] == "eval"]
    assert [e["step"] for e in run["evals"]] == [r["step"] for r in evals]
    assert [e["accuracy_bf16"] for e in run["evals"]] == [r["eval/accuracy_bf16"] for r in evals]
    rewards = [r["reward"] for r in records if r["event"] == "train"]
    assert run["per_step"]["reward"] == [round(r, 5) for r in rewards] and run["steps_run"] == len(rewards)
    assert run["per_step"]["step"] == [r["step"] for r in records if r["event"] == "train"]
    # refused in one line: --seeds without --compare, or with --seed, or not seeds
    for flags, message in ((["--seeds", "0,1"], "--seeds goes with --compare"),
                           (["--compare", "bf16,nvfp4", "--seeds", "0,1", "--seed", "3"], "drop --seed"),
                           (["--compare", "bf16,nvfp4", "--seeds", "0,0"], "distinct non-negative"),
                           (["--compare-window", "3"], "--compare-window goes with"),
                           (["--compare", "bf16,nvfp4", "--rac-group", "64"], "drop --rac-group"),
                           (["--compare", "bf16,nvfp4", "--rac-fold"], "drop --rac-fold"),
                           (["--compare", "bf16,nvfp4", "--rollout", "bf16"], "drop --rollout"),
                           (["--compare", "bf16,nvfp4", "--seeds", "0,1", "--compare-window", "0"],
                            "window is a number of evaluations")):
        code = main(["rl", "--quick", *flags, "--out-dir", str(tmp_path)])
        err = capsys.readouterr().err
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_rl_compare_adds_an_arm_to_finished_runs_whose_checkpoints_were_removed(tmp_path, capsys):
    # the way a comparison grows across jobs that cannot carry checkpoints: finished runs'
    # folders without checkpoints are taken as they are (checked against config.json)
    import shutil

    from lowbit.cli import main
    base = ["rl", "--quick", "--no-progress", "--out-dir", str(tmp_path)]
    assert main([*base, "--compare", "bf16,nvfp4"]) == 0
    runs = ("rl-tiny-add-bf16", "rl-tiny-add-nvfp4")
    before = {r: (tmp_path / r / "metrics.jsonl").read_text() for r in runs}
    for r in runs:
        shutil.rmtree(tmp_path / r / "checkpoints")
    capsys.readouterr()
    assert main([*base, "--compare", "bf16,nvfp4,nvfp4+quads", "--resume"]) == 0
    out = capsys.readouterr().out
    assert out.count("| ok |") == 3 and "stopped at" not in out, out   # taken as finished
    # the new QAT arm scores W4A16 too, but bf16's run has no such evaluations: no table on it
    assert "W4A16 evaluator" not in out and not (tmp_path / "compare-add" / "seeds-w4a16").exists()
    assert all((tmp_path / r / "metrics.jsonl").read_text() == before[r] for r in runs)
    rows = {r["setting"]: r for r in json.loads((tmp_path / "compare-add" / "summary.json").read_text())}
    assert set(rows) == {"bf16", "nvfp4", "nvfp4+quads"}
    assert main([*base, "--compare", "bf16,nvfp4", "--resume", "--temperature", "0.5"]) == 2
    err = capsys.readouterr().err
    assert "its config.json differs from the config asked for in temperature" in err
    assert len(err.strip().splitlines()) == 1
    # with QUADS as the baseline the W4A16 table is written; naive's run, finished before the
    # evaluator, says why it has no value there rather than "ok"
    assert main([*base, "--compare", "nvfp4+quads,nvfp4", "--resume"]) == 0
    table = json.loads((tmp_path / "compare-add" / "seeds-w4a16" / "summary.json").read_text())
    status = {r["arm"]: r["status"] for r in table["rows"]}
    assert status == {"nvfp4+quads": "ok", "nvfp4": "ok; no W4A16 evaluation from step 0"}
    (arm,) = table["arms"]
    assert arm["runs_ended_early"] == 0 and arm["verdict"] == "no pairs"   # finished, not measured


def test_the_paired_curve_averages_the_last_evaluations():
    from lowbit.rl.compare import accuracy_change_curve
    records = [{"event": "train", "step": 1}] + [
        {"event": "eval", "step": s, "eval/accuracy_bf16": a}
        for s, a in ((0, 0.5), (10, 0.75), (20, 0.25), (30, 1.0))] + [
        {"event": "eval", "step": 40, "eval/accuracy": 0.1}]   # no common evaluator: left out
    assert accuracy_change_curve(records) == [(0, 0.0), (10, 0.25), (20, -0.25), (30, 0.5)]
    assert accuracy_change_curve(records, 3) == [(0, 0.0), (10, 0.125), (20, 0.0), (30, 0.5 / 3)]
    assert accuracy_change_curve(records, 100)[-1] == (30, 0.5 / 4)
    assert accuracy_change_curve([]) == []
    # an evaluator turned on at a resume has no step 0 to count from: no curve
    later = records + [{"event": "eval", "step": 50, "eval/accuracy_w4a16": 0.5}]
    assert accuracy_change_curve(later, key="eval/accuracy_w4a16") == []


def test_compile_decode_gives_the_eager_rollouts(tmp_path):
    """--compile-decode reaches the engine, and its rollouts are the eager engine's: the same
    rewards and lengths, log-probs equal to float32 rounding."""
    kw = dict(rollout="bf16", align="none", steps=2, checkpoint_every=2)
    eager = run_rl(_config(tmp_path, run_name="eager", **kw))
    compiled = run_rl(_config(tmp_path, run_name="compiled", compile_decode=True, **kw))
    train = lambda result: [r for r in result.records if r["event"] == "train"]
    assert len(train(compiled)) == 2
    for a, b in zip(train(eager), train(compiled)):
        assert a["reward"] == b["reward"]
        assert a["completions/mean_length"] == b["completions/mean_length"]
        assert b["sampling/sampling_logp_difference/mean"] == pytest.approx(
            a["sampling/sampling_logp_difference/mean"], abs=1e-4)


def _built_engines(monkeypatch) -> list:
    """Every RolloutEngine the RL trainer builds from now on, in order of construction."""
    from lowbit.rl import trainer as trainer_module
    built = []
    real = trainer_module.RolloutEngine

    def spy(*args, **kwargs):
        engine = real(*args, **kwargs)
        built.append(engine)
        return engine
    monkeypatch.setattr(trainer_module, "RolloutEngine", spy)
    return built


def test_packed_gemm_reaches_the_engine_and_needs_nvfp4_rollouts(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="--packed-gemm multiplies packed NVFP4 weights"):
        RLConfig(rollout="bf16", align="none", packed_gemm=True, progress=False)
    built = _built_engines(monkeypatch)
    result = run_rl(_config(tmp_path, rollout="nvfp4-w4a16", align="none", steps=1,
                            checkpoint_every=1, packed_gemm=True))
    rollout_engines = [e for e in built if e.settings.precision.value != "bf16"]
    assert rollout_engines and all(e.settings.packed_gemm for e in rollout_engines)
    assert [r for r in result.records if r["event"] == "train"]


def test_every_run_is_scored_by_its_own_engine_and_by_a_common_bf16_one(tmp_path):
    from lowbit.rl.compare import format_summary, summary_rows

    nvfp4 = run_rl(_config(tmp_path, run_name="n", rollout="nvfp4", align="none", steps=2, eval_every=2))
    bf16 = run_rl(_config(tmp_path, run_name="b", rollout="bf16", align="none", steps=2, eval_every=2))
    for result in (nvfp4, bf16):
        evals = [r for r in result.records if r["event"] == "eval"]
        assert evals[0]["step"] == 0 and all("eval/accuracy_bf16" in r for r in evals)
    # a bf16 run's own engine is the common evaluator; an nvfp4 run's is not
    assert all(r["eval/accuracy"] == r["eval/accuracy_bf16"]
               for r in bf16.records if r["event"] == "eval")
    rows = summary_rows([nvfp4.run_dir, bf16.run_dir])
    assert all(0 <= r["eval_accuracy_bf16_first"] <= 1 for r in rows)
    assert "held-out acc, bf16 (first -> last, change)" in format_summary(rows)
    # a folder that lost its config.json is refused, not labelled with a default setting
    (bf16.run_dir / "config.json").unlink()
    with pytest.raises(ValueError, match="has no config.json: it is not a lowbit rl run folder"):
        summary_rows([nvfp4.run_dir, bf16.run_dir])


def test_every_arm_sharing_a_warm_start_is_scored_from_the_same_weights_at_step_0(tmp_path, monkeypatch):
    # the common evaluator's first weights are the warm start's in every arm (QAT's latent
    # weights, not their NVFP4 values; no RAC, no rounding), so a change from step 0 is measured
    # from one shared point: the step-0 scores agree and the weights behind them are equal
    from lowbit.rl.engine import RolloutEngine as Engine

    first: dict[str, list] = {}
    current = {}
    real_load = Engine.load_state_dict

    def recording(engine, state, *args, **kwargs):
        real_load(engine, state, *args, **kwargs)
        if engine.settings.precision.value == "bf16" and current["arm"] not in first:
            first[current["arm"]] = [engine.linear_values(i, n).clone()
                                      for i in range(engine.config.n_layers)
                                      for n in ("q_proj", "o_proj", "down_proj")]
    monkeypatch.setattr(Engine, "load_state_dict", recording)
    step0 = {}
    for arm, rollout, align in (("b", "bf16", "none"), ("n", "nvfp4", "none"), ("q", "nvfp4", "quads")):
        current["arm"] = arm
        result = run_rl(_config(tmp_path, run_name=arm, rollout=rollout, align=align, steps=1,
                                eval_every=1, checkpoint_every=1))
        step0[arm] = next(r for r in result.records if r["event"] == "eval" and r["step"] == 0)
    assert set(first) == {"b", "n", "q"}
    assert len([p for p in (tmp_path / "warmstart").iterdir() if p.is_dir()]) == 1   # one, shared
    for arm in ("n", "q"):
        assert len(first[arm]) == len(first["b"]) > 0
        assert all(torch.equal(a, b) for a, b in zip(first["b"], first[arm]))
        assert step0[arm]["eval/accuracy_bf16"] == step0["b"]["eval/accuracy_bf16"]


def test_collapse_is_three_evaluations_below_half_the_peak():
    from lowbit.rl.trainer import collapsed

    assert not collapsed([0.4, 0.3, 0.25, 0.2])            # not below half of 0.4 in each
    assert collapsed([0.4, 0.5, 0.2, 0.1, 0.0])            # 0.2, 0.1, 0 < 0.25
    assert not collapsed([0.4, 0.1, 0.1, 0.3])             # recovered
    assert not collapsed([0.0, 0.0, 0.0, 0.0])             # no peak, nothing to fall from
    assert not collapsed([0.5, 0.1, 0.1])                  # too few evaluations


def test_static_activation_scales_reach_the_engine_at_every_sync(tmp_path, capsys):
    """--rollout-activation-scale static: the engine runs a served NVFP4 checkpoint's static
    input scales, recalibrated on the policy at every sync; the run's config records it; a bad
    value or a rollout without NVFP4 activations is refused in one line (exit 2)."""
    from lowbit.cli import main
    from lowbit.export import calibrate_input_amax

    for argv, words in ((["--rollout-activation-scale", "dynamic"], "use one of per-token, static"),
                        (["--rollout", "fp8", "--align", "none", "--rollout-activation-scale",
                          "static"], "use --rollout nvfp4")):
        assert main(["rl", *argv, "--out-dir", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1
    from lowbit.rl.trainer import GRPOTrainer
    trainer = GRPOTrainer(_config(tmp_path, warmstart_steps=0, rollout_activation_scale="static"))
    try:
        assert json.loads((trainer.run_dir / "config.json").read_text())[
            "rollout_activation_scale"] == "static"
        assert trainer.run_dir.name.endswith("nvfp4+quads+static-act")
        o_proj = trainer.engine.weights.layers[0].o_proj
        held, before = o_proj.input_amax, o_proj.input_amax.clone()
        with trainer.step_fn.autocast:                  # as the trainer's forward runs
            amax = calibrate_input_amax(trainer.policy, trainer.calibration)
        assert before.item() == amax["model.layers.0.self_attn.o_proj"]
        with torch.no_grad():                           # a step's update, then the sync
            for p in trainer.policy.parameters():
                p.mul_(1.5)
        trainer.sync()
        assert o_proj.input_amax is held and not torch.equal(held, before)   # recalibrated, in place
    finally:
        trainer.folder.release()


def test_the_w4a16_evaluator_scores_the_weights_as_asymmetric_qat_multiplies_them(tmp_path, monkeypatch):
    # --eval-w4a16: a third evaluator, an nvfp4-w4a16 engine on the trainer's weights, scored
    # at every evaluation; checked here against an engine of that precision built apart from
    # the run, on its last checkpoint
    from lowbit.rl.precision import Precision, quantize_weight
    from lowbit.train.checkpoint import load_checkpoint
    from lowbit.rl.warmstart import greedy_accuracy, policy_tokenizer
    from lowbit.rl.compare import format_summary, summary_rows

    built = _built_engines(monkeypatch)
    result = run_rl(_config(tmp_path, steps=2, eval_every=2, checkpoint_every=2, eval_w4a16=True))
    evals = [r for r in result.records if r["event"] == "eval"]
    assert [r["step"] for r in evals] == [0, 2] and all("eval/accuracy_w4a16" in r for r in evals)
    own, bf16, w4a16 = built
    assert w4a16.settings.precision.value == "nvfp4-w4a16" and bf16.settings.precision.value == "bf16"
    # its weights: the trainer's latent weights in NVFP4 (what QAT's forward multiplies), not the
    # bf16 evaluator's latent ones
    latent = bf16.linear_values(0, "q_proj")
    expected = quantize_weight(latent, Precision.NVFP4).dequantize().to(latent.dtype)
    assert torch.equal(w4a16.linear_values(0, "q_proj"), expected)
    assert not torch.equal(w4a16.linear_values(0, "q_proj"), latent)
    # and its score is the greedy accuracy of those weights on the held-out set
    config = _config(tmp_path, steps=2, eval_w4a16=True)
    task = get_task(config.task)
    tokenizer, stop_ids = policy_tokenizer(config)
    apart = RolloutEngine(w4a16.config, "nvfp4-w4a16", max_batch_size=w4a16.max_batch_size)
    apart.load_state_dict(load_checkpoint(result.run_dir / "checkpoints" / "latest.pt")["model"])
    again = greedy_accuracy(apart, task, tokenizer, task.eval_problems(config.eval_problems),
                            config.max_completion_length, stop_ids)
    assert evals[-1]["eval/accuracy_w4a16"] == again
    rows = summary_rows([result.run_dir])
    assert rows[0]["eval_accuracy_w4a16_first"] == evals[0]["eval/accuracy_w4a16"]
    assert rows[0]["eval_accuracy_w4a16"] == evals[-1]["eval/accuracy_w4a16"]
    assert "held-out acc, W4A16 (first -> last, change)" in format_summary(rows)


def test_a_comparison_with_qat_settings_pairs_the_w4a16_evaluator_too(tmp_path, capsys):
    from lowbit.cli import main
    from lowbit.train.metrics import read_metrics
    base = ["rl", "--quick", "--no-progress", "--out-dir", str(tmp_path)]
    assert main([*base, "--compare", "bf16,nvfp4+quads"]) == 0
    out = capsys.readouterr().out
    folder = tmp_path / "compare-add"
    for run in ("rl-tiny-add-bf16", "rl-tiny-add-nvfp4+quads"):   # every run, bf16's too
        evals = [r for r in read_metrics(tmp_path / run) if r["event"] == "eval"]
        assert evals and all(isinstance(r.get("eval/accuracy_w4a16"), float) for r in evals)
    paired = json.loads((folder / "seeds-w4a16" / "summary.json").read_text())
    assert "W4A16 evaluator" in paired["metric"] and paired["baseline"] == "bf16"
    assert "(W4A16 evaluator" in out and "held-out acc, W4A16" in out
    # resumed without a QAT setting: the runs are taken as they are, the stale table is gone
    assert main([*base, "--compare", "bf16,nvfp4", "--resume"]) == 0
    out = capsys.readouterr().out
    assert not (folder / "seeds-w4a16").exists() and "W4A16 evaluator" not in out
