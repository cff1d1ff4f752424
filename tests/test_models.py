"""lowbit.models: shapes, training signal, causality, GQA, MoE routing math, presets,
config validation, and parity with Hugging Face LLaMA / Qwen3 / Qwen3-MoE."""

import inspect
import math

import pytest
import torch
import torch.nn.functional as F

from lowbit.models import PRESETS, Experts, ModelConfig, SparseMoeBlock, build_model, load_balancing_loss

TINY = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=32)
TINY_MOE = dict(TINY, n_experts=4, experts_per_token=2, moe_ffn_dim=16)


def _tokens(B, T, V=64, seed=0):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


# --- forward ------------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [TINY, TINY_MOE,
                                dict(TINY_MOE, qk_norm=True, n_kv_heads=2, tie_embeddings=True)],
                         ids=["dense", "moe", "moe-qknorm-gqa-tied"])
def test_forward_shapes(kw):
    model = build_model(ModelConfig(**kw))
    idx = _tokens(3, 10)
    out = model(idx)
    assert out.logits.shape == (3, 10, 64)
    assert out.loss is None and out.aux_loss.shape == ()
    out = model(idx, targets=_tokens(3, 10, seed=1))
    assert out.loss.shape == () and torch.isfinite(out.loss)
    # At init the logits are near zero, so the cross-entropy is near log(V).
    assert abs(out.loss.item() - math.log(64)) < 0.3


def test_dense_aux_loss_is_zero_and_moe_loss_adds_it():
    out = build_model(ModelConfig(**TINY))(_tokens(2, 8), _tokens(2, 8, seed=1))
    assert out.aux_loss.item() == 0.0
    cfg = ModelConfig(**TINY_MOE, moe_aux_loss_coef=0.5)
    model = build_model(cfg)
    idx, targets = _tokens(2, 8), _tokens(2, 8, seed=1)
    out = model(idx, targets)
    ce = F.cross_entropy(out.logits.view(-1, 64), targets.view(-1))
    torch.testing.assert_close(out.loss, ce + 0.5 * out.aux_loss)
    assert 1.0 <= out.aux_loss.item() <= cfg.n_experts  # the loss's range: uniform .. collapsed


def test_targets_minus_100_are_ignored():
    model = build_model(ModelConfig(**TINY))
    idx, targets = _tokens(2, 8), _tokens(2, 8, seed=1)
    masked = targets.clone()
    masked[:, :4] = -100
    out = model(idx, masked)
    expected = F.cross_entropy(out.logits[:, 4:].reshape(-1, 64), targets[:, 4:].reshape(-1))
    torch.testing.assert_close(out.loss, expected)


def test_sequence_longer_than_max_seq_len_is_an_error():
    model = build_model(ModelConfig(**TINY))
    with pytest.raises(ValueError, match="exceeds max_seq_len=32"):
        model(_tokens(1, 33))


# --- training signal ----------------------------------------------------------------------

@pytest.mark.parametrize("kw", [TINY, TINY_MOE], ids=["dense", "moe"])
def test_loss_decreases_on_a_repeated_batch(kw):
    model = build_model(ModelConfig(**kw))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx = _tokens(4, 16)
    x, y = idx[:, :-1], idx[:, 1:]
    losses = []
    for _ in range(30):
        loss = model(x, y).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("kw", [dict(TINY, qk_norm=True), dict(TINY_MOE, qk_norm=True)], ids=["dense", "moe"])
def test_every_parameter_gets_a_gradient(kw):
    model = build_model(ModelConfig(**kw))
    idx = _tokens(8, 32)  # 256 tokens, top-2 of 4 experts: every expert is routed to
    model(idx, idx).loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        assert param.grad.abs().sum() > 0, name
        assert torch.isfinite(param.grad).all(), name
    if kw.get("n_experts"):
        # Every expert got tokens, so every expert's slice of the 3D weights has a gradient.
        grad = model.model.layers[0].mlp.experts.gate_up_proj.grad
        assert (grad.flatten(1).abs().sum(1) > 0).all()


# --- attention ----------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [TINY, dict(TINY_MOE, n_kv_heads=1)], ids=["dense", "moe-gqa"])
def test_causal_masking(kw):
    model = build_model(ModelConfig(**kw)).eval()
    idx = _tokens(2, 16)
    changed = idx.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 64
    with torch.no_grad():
        a, b = model(idx).logits, model(changed).logits
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=0)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_gqa_equals_mha_with_shared_key_value_heads():
    """n_kv_heads=2 of 4 heads == MHA whose query heads 2i, 2i+1 see the same K/V head i."""
    gqa = build_model(ModelConfig(**TINY, n_kv_heads=2)).eval()
    mha = build_model(ModelConfig(**TINY)).eval()
    state = gqa.state_dict()
    head_dim = 32 // 4
    for i in range(2):
        for proj in ("k_proj", "v_proj"):
            w = state[f"model.layers.{i}.self_attn.{proj}.weight"]  # (KV*D, C)
            state[f"model.layers.{i}.self_attn.{proj}.weight"] = (
                w.view(2, head_dim, 32).repeat_interleave(2, dim=0).reshape(4 * head_dim, 32))
    mha.load_state_dict(state)
    idx = _tokens(2, 12)
    with torch.no_grad():
        torch.testing.assert_close(gqa(idx).logits, mha(idx).logits)
    assert gqa.num_parameters() < mha.num_parameters()


def test_dropout_only_in_training():
    model = build_model(ModelConfig(**TINY, dropout=0.5))
    idx = _tokens(2, 8)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(idx).logits, model(idx).logits, rtol=0, atol=0)
        model.train()
        assert not torch.allclose(model(idx).logits, model(idx).logits)


# --- MoE ----------------------------------------------------------------------------------

def _experts(E=4, C=16, F_=8, seed=0):
    torch.manual_seed(seed)
    experts = Experts(E, C, F_)
    torch.nn.init.normal_(experts.gate_up_proj, std=0.3)
    torch.nn.init.normal_(experts.down_proj, std=0.3)
    return experts


def test_experts_match_a_per_token_reference_loop():
    experts = _experts()
    N, k = 20, 2
    x = torch.randn(N, 16)
    index = torch.stack([torch.randperm(4)[:k] for _ in range(N)])  # (N, k) distinct experts
    weights = torch.rand(N, k)
    expected = torch.zeros(N, 16)
    for n in range(N):
        for j in range(k):
            e = index[n, j].item()
            gate, up = (experts.gate_up_proj[e] @ x[n]).chunk(2)
            expected[n] += weights[n, j] * (experts.down_proj[e] @ (F.silu(gate) * up))
    torch.testing.assert_close(experts(x, index, weights), expected)


def test_experts_skip_dropped_slots():
    """An index equal to num_experts marks a dropped slot (Hugging Face's convention)."""
    experts = _experts()
    x = torch.randn(6, 16)
    index = torch.tensor([[0, 1], [2, 4], [4, 4], [3, 0], [1, 4], [2, 3]])
    weights = torch.rand(6, 2)
    kept = index != 4
    out = experts(x, torch.where(kept, index, 0), weights * kept)
    torch.testing.assert_close(experts(x, index, weights), out)


def test_expert_linear_is_the_only_gemm():
    """A subclass that overrides _expert_linear sees every expert GEMM (QuantExperts' hook)."""
    calls = []

    class Recording(Experts):
        def _expert_linear(self, x, weight, expert_idx):
            calls.append((weight.shape, expert_idx))
            return 2 * super()._expert_linear(x, weight, expert_idx)

    base = _experts()
    recording = Recording(4, 16, 8)
    recording.load_state_dict(base.state_dict())
    x, weights = torch.randn(5, 16), torch.rand(5, 2)
    index = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2], [1, 0]])
    out = recording(x, index, weights)
    assert sorted(e for _, e in calls) == [0, 0, 1, 1, 2, 2]  # expert 3 gets no tokens
    assert out.shape == (5, 16) and not torch.allclose(out, base(x, index, weights))


def test_load_balancing_loss_matches_a_hand_computation():
    N, E, k = 12, 4, 2
    logits = torch.randn(N, E)
    index = torch.topk(logits, k, dim=-1).indices
    probs = [[math.exp(v) / sum(math.exp(u) for u in row) for v in row] for row in logits.tolist()]
    f = [sum(1 for row in index.tolist() for e in row if e == expert) / (N * k) for expert in range(E)]
    P = [sum(probs[n][expert] for n in range(N)) / N for expert in range(E)]
    expected = E * sum(f[e] * P[e] for e in range(E))
    assert load_balancing_loss(logits, index).item() == pytest.approx(expected, rel=1e-5)
    # Uniform routing gives 1 (the minimum); routing everything to one expert gives E.
    uniform = torch.zeros(N, E)
    assert load_balancing_loss(uniform, torch.arange(N * k).view(N, k) % E).item() == pytest.approx(1.0)
    collapsed = torch.tensor([[20.0, 0, 0, 0]]).expand(N, E)
    to_first = torch.zeros(N, 1, dtype=torch.long)
    assert load_balancing_loss(collapsed, to_first).item() == pytest.approx(E, rel=1e-6)


def test_aux_loss_trains_the_router():
    block = SparseMoeBlock(4, 16, 8, top_k=2)
    torch.nn.init.normal_(block.gate.weight, std=0.1)
    torch.nn.init.normal_(block.experts.gate_up_proj, std=0.1)
    torch.nn.init.normal_(block.experts.down_proj, std=0.1)
    out, aux = block(torch.randn(2, 8, 16))
    assert out.shape == (2, 8, 16)
    (grad,) = torch.autograd.grad(aux, block.gate.weight)
    assert grad.abs().sum() > 0


# --- sizes and init -----------------------------------------------------------------------

PRESET_RANGES = {"tiny": (0.8e6, 1.5e6), "small": (8e6, 13e6), "100m": (80e6, 130e6), "1b": (0.85e9, 1.3e9)}


def test_presets_are_in_their_stated_ranges():
    assert set(PRESETS) == set(PRESET_RANGES) | {"moe-120m"}
    moe = ModelConfig.preset("moe-120m")              # the MoE benchmark shape
    assert moe.is_moe and 115e6 <= moe.num_parameters(active=True) <= 125e6
    assert 600e6 <= moe.num_parameters() <= 700e6
    for name, (low, high) in PRESET_RANGES.items():
        cfg = ModelConfig.preset(name)
        assert low <= cfg.num_parameters() <= high, (name, cfg.num_parameters())
        moe = ModelConfig.preset(name, n_experts=8)
        # Top-2 of 8 experts, each half the dense MLP: active compute ~ the dense model's.
        assert moe.num_parameters(active=True) == pytest.approx(cfg.num_parameters(), rel=0.02)
        assert moe.num_parameters() > 1.5 * cfg.num_parameters()
    with pytest.raises(ValueError, match="unknown model preset 'huge'; known presets: tiny, small"):
        ModelConfig.preset("huge")


@pytest.mark.parametrize("kw", [dict(), dict(tie_embeddings=True),
                                dict(n_experts=4, qk_norm=True, n_kv_heads=1)])
def test_num_parameters_counts_the_built_model(kw):
    cfg = ModelConfig.preset("tiny", **kw)
    assert build_model(cfg).num_parameters() == cfg.num_parameters()


def test_from_size_follows_llama_conventions():
    cfg = ModelConfig.from_size(4, 512)
    assert (cfg.n_heads, cfg.head_dim, cfg.n_kv_heads, cfg.ffn_dim) == (8, 64, 8, 1408)  # 8/3*512 -> 1408
    assert ModelConfig.from_size(4, 512, n_experts=8).moe_ffn_dim == 704


def test_init_scales_residual_projections():
    cfg = ModelConfig(vocab_size=64, dim=256, n_layers=8, n_heads=4, ffn_dim=512,
                      n_experts=2, experts_per_token=1, moe_ffn_dim=512)
    model = build_model(cfg)
    layer = model.model.layers[0]
    residual_std = 0.02 / math.sqrt(16)
    assert layer.self_attn.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert layer.self_attn.o_proj.weight.std().item() == pytest.approx(residual_std, rel=0.05)
    assert layer.mlp.experts.down_proj.std().item() == pytest.approx(residual_std, rel=0.05)
    assert layer.mlp.experts.gate_up_proj.std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.equal(layer.input_layernorm.weight, torch.ones(256))


def test_meta_device_build_then_init_weights():
    cfg = ModelConfig(**TINY)
    with torch.device("meta"):
        model = build_model(cfg)
    model.to_empty(device="cpu")
    model.init_weights()
    reference = build_model(cfg)
    torch.testing.assert_close(model.model.rotary_emb.cos, reference.model.rotary_emb.cos)
    out = model(_tokens(1, 8), _tokens(1, 8))
    assert torch.isfinite(out.loss)


# --- config validation --------------------------------------------------------------------

@pytest.mark.parametrize("kw, message", [
    (dict(dim=0), "dim must be a positive integer"),
    (dict(vocab_size=-1), "vocab_size must be a positive integer"),
    (dict(dim=100, n_heads=3), r"dim \(100\) must be divisible by n_heads \(3\)"),
    (dict(dim=36, n_heads=4), "head_dim = dim / n_heads = 9 must be even"),
    (dict(n_heads=4, n_kv_heads=3), r"n_kv_heads \(3\) must be a positive divisor of n_heads \(4\)"),
    (dict(n_experts=4, experts_per_token=5),
     r"experts_per_token \(5\) must be between 1 and n_experts \(4\)"),
    (dict(n_experts=-1), "n_experts must be an integer >= 0"),
    (dict(n_experts=4, moe_ffn_dim=0), "moe_ffn_dim must be a positive integer"),
    (dict(ffn_dim=0), "ffn_dim must be a positive integer"),
    (dict(dropout=1.0), r"dropout must be in \[0, 1\)"),
    (dict(init_std=0.0), "init_std must be > 0"),
    (dict(moe_aux_loss_coef=-0.1), "moe_aux_loss_coef must be >= 0"),
])
def test_config_validation(kw, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**kw)


# --- Hugging Face parity ------------------------------------------------------------------

def _hf_configs():
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-5,
                  tie_word_embeddings=False, attn_implementation="eager",
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    ours = dict(vocab_size=97, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, norm_eps=1e-5)
    return {
        "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig(intermediate_size=96, **common),
                  ModelConfig(ffn_dim=96, **ours)),
        "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config(intermediate_size=96, **common),
                  ModelConfig(ffn_dim=96, qk_norm=True, **ours)),
        "qwen3-moe": (transformers.Qwen3MoeForCausalLM,
                      transformers.Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=32,
                                                  num_experts=4, num_experts_per_tok=2,
                                                  norm_topk_prob=True, **common),
                      ModelConfig(qk_norm=True, n_experts=4, experts_per_token=2, moe_ffn_dim=32, **ours)),
    }


@pytest.mark.parametrize("name", ["llama", "qwen3", "qwen3-moe"])
def test_hugging_face_checkpoint_loads_and_gives_the_same_logits(name):
    hf_class, hf_config, config = _hf_configs()[name]
    torch.manual_seed(0)
    hf = hf_class(hf_config).eval()
    ours = build_model(config).eval()
    hf_state = hf.state_dict()
    assert set(hf_state) == set(ours.state_dict())
    ours.load_state_dict(hf_state)  # strict: same names, same shapes
    idx = _tokens(2, 20, V=97)
    with torch.no_grad():
        torch.testing.assert_close(ours(idx).logits, hf(idx).logits, rtol=1e-5, atol=1e-5)


def test_experts_mirror_hugging_face_qwen3_moe_experts():
    qwen3_moe = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")
    Qwen3MoeExperts, Qwen3MoeSparseMoeBlock = qwen3_moe.Qwen3MoeExperts, qwen3_moe.Qwen3MoeSparseMoeBlock

    hf_config = _hf_configs()["qwen3-moe"][1]
    hf_config._experts_implementation = "eager"  # the reference loop, not a fused kernel
    hf = Qwen3MoeExperts(hf_config)
    ours = Experts(hf_config.num_experts, hf_config.hidden_size, hf_config.moe_intermediate_size)
    shapes = {name: tensor.shape for name, tensor in hf.state_dict().items()}
    assert shapes == {name: tensor.shape for name, tensor in ours.state_dict().items()}
    assert list(inspect.signature(hf.forward).parameters) == list(inspect.signature(ours.forward).parameters)
    torch.nn.init.normal_(hf.gate_up_proj, std=0.2)
    torch.nn.init.normal_(hf.down_proj, std=0.2)
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(24, 64)
    index = torch.stack([torch.randperm(4)[:2] for _ in range(24)])
    weights = torch.rand(24, 2)
    with torch.no_grad():
        torch.testing.assert_close(ours(x, index, weights), hf(x, index, weights))

    # The whole block, router included, on the same weights.
    hf_block = Qwen3MoeSparseMoeBlock(hf_config)
    torch.nn.init.normal_(hf_block.gate.weight, std=0.2)
    hf_block.experts.load_state_dict(hf.state_dict())
    our_block = SparseMoeBlock(4, 64, 32, top_k=2)
    our_block.load_state_dict(hf_block.state_dict())
    h = torch.randn(2, 12, 64)
    with torch.no_grad():
        out, _ = our_block(h)
        torch.testing.assert_close(out, hf_block(h))


def test_aux_loss_is_hugging_face_divided_by_top_k():
    qwen3_moe = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")
    load_balancing_loss_func = qwen3_moe.load_balancing_loss_func

    logits = torch.randn(30, 8)
    for k in (1, 2, 3):
        ours = load_balancing_loss(logits, torch.topk(logits, k, dim=-1).indices)
        hf = load_balancing_loss_func((logits,), num_experts=8, top_k=k)
        torch.testing.assert_close(k * ours, hf)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_hugging_faces_bit_for_bit(dtype):
    # lowbit's RMSNorm (F.rms_norm in float32, scaled in the input dtype) against transformers'
    # LlamaRMSNorm, forward and the input's and weight's gradients, on a non-contiguous view too
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from lowbit.models.transformer import RMSNorm
    torch.manual_seed(0)
    ours, theirs = RMSNorm(48, 1e-6), LlamaRMSNorm(48, eps=1e-6)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(48))
        theirs.weight.copy_(ours.weight)
    base = (torch.randn(5, 96) * 3).to(dtype)
    for x in (base[:, :48], base[:, ::2]):
        grads = []
        for norm in (ours, theirs):
            xi = x.detach().clone().requires_grad_()
            norm.weight.grad = None
            y = norm(xi)
            y.backward(torch.linspace(-1, 1, y.numel()).view_as(y).to(y.dtype))
            grads.append((y.detach(), xi.grad, norm.weight.grad))
        for a, b in zip(*grads):
            assert a.dtype == b.dtype and torch.equal(a, b)


def test_compiled_layers_are_one_graph_for_every_layer_and_length():
    # Transformer.compile_layers: each decoder layer compiled in place, the layers sharing one
    # graph (their weights its inputs), dynamic=True one graph for every sequence length; the
    # loss and gradients those of the eager model, the state dict's keys unchanged
    from torch._dynamo.utils import counters

    torch._dynamo.reset()   # the graphs counted are this test's, whatever compiled before it

    cfg = ModelConfig(**dict(TINY, n_layers=3, qk_norm=True, n_kv_heads=2))
    torch.manual_seed(0)
    eager = build_model(cfg)
    compiled = build_model(cfg)
    compiled.load_state_dict(eager.state_dict())
    keys = list(compiled.state_dict())
    compiled.compile_layers(dynamic=True)
    assert list(compiled.state_dict()) == keys
    graphs = counters["stats"]["unique_graphs"]
    for T in (9, 14, 21):
        losses = []
        for model in (eager, compiled):
            model.zero_grad()
            loss = model(_tokens(2, T), targets=_tokens(2, T, seed=1)).loss
            loss.backward()
            losses.append((loss.detach(), [p.grad for p in model.parameters()]))
        (a, grads_a), (b, grads_b) = losses
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
        for ga, gb in zip(grads_a, grads_b):
            torch.testing.assert_close(gb, ga, rtol=1e-4, atol=1e-6)
    assert counters["stats"]["unique_graphs"] - graphs == 1
    # shared prompts (RL's --share-prompts): one more graph, for every prompt and completion length
    for P, Tc in ((5, 4), (9, 6), (3, 2)):
        prompts, lengths = _tokens(2, P), torch.tensor([P, max(1, P - 2)])
        completions = _tokens(6, Tc, seed=P)
        a, b = (model(completions, prompts=(prompts, lengths)).logits for model in (eager, compiled))
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] - graphs == 2


def _prompt_rows(prompts, prompt_lengths, completions):
    # each completion's row: its group's prompt (prompt_lengths[g] tokens) + the completion
    G = completions.shape[0] // prompts.shape[0]
    rows = [torch.cat((prompts[b // G, :prompt_lengths[b // G]], c)) for b, c in enumerate(completions)]
    ids = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.int64)
    for b, row in enumerate(rows):
        ids[b, :len(row)] = row
    lengths = prompt_lengths.repeat_interleave(G)
    positions = lengths[:, None] - 1 + torch.arange(completions.shape[1])   # predicting each token
    return ids, positions


@pytest.mark.parametrize("kw", [dict(TINY, n_kv_heads=2, qk_norm=True), TINY, TINY_MOE],
                         ids=["gqa-qknorm", "mha", "moe"])
def test_shared_prompts_give_each_rows_logits_and_gradients(kw):
    # Transformer(completions, prompts=(prompt_ids, lengths)): each prompt run once for its group
    # of completions (SharedPrompts); the logits predicting every completion token and the
    # gradients are those of the rows of prompt + completion, prompts of unequal lengths
    torch.manual_seed(0)
    model = build_model(ModelConfig(**kw))
    prompt_lengths = torch.tensor([3, 9, 1])
    prompts = _tokens(3, 9, seed=1)
    completions = _tokens(12, 5, seed=2)
    ids, positions = _prompt_rows(prompts, prompt_lengths, completions)
    weights = torch.randn(12, 5, 64)
    results = []
    for run in (lambda: model(ids, logits_at=positions), lambda: model(completions, prompts=(prompts, prompt_lengths))):
        model.zero_grad()
        logits = run().logits
        (logits * weights).sum().backward()
        results.append((logits.detach(), [p.grad.clone() for p in model.parameters()]))
    (rows, grads_rows), (shared, grads_shared) = results
    assert shared.shape == (12, 5, 64)
    torch.testing.assert_close(shared, rows, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads_shared, grads_rows):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    # a prompt's padding is never read: other tokens there change nothing
    padded = prompts.clone()
    padded[0, 3:], padded[2, 1:] = 7, 11
    torch.testing.assert_close(model(completions, prompts=(padded, prompt_lengths)).logits, shared)


def test_shared_prompts_refuse_what_they_cannot_run():
    model = build_model(ModelConfig(**TINY))
    prompts, lengths = _tokens(2, 4), torch.tensor([4, 2])
    for completions, prompt_lengths, message in ((_tokens(5, 3), lengths, "same number of completions"),
                                                 (_tokens(4, 3), lengths[:1], "same number of completions"),
                                                 (_tokens(4, 30), lengths, "exceed max_seq_len=32")):
        with pytest.raises(ValueError, match=message):
            model(completions, prompts=(prompts, prompt_lengths))
    with pytest.raises(ValueError, match="not with targets or logits_at"):
        model(_tokens(4, 3), targets=_tokens(4, 3), prompts=(prompts, lengths))
