"""The rollout engine against the trainer's model: log-probs, KV cache, precision modes, RAC,
sampling, weight sync and asymmetric QAT's weights."""

import math

import pytest
import torch
import torch.nn.functional as F

from bits import same_bits
from kernel_paths import interpreted_kernels
from lowbit import dispatch
from lowbit.export import calibrate_input_amax
from lowbit.models import ModelConfig, build_model
from lowbit.ops import operand
from lowbit.rl.engine import RolloutEngine
from lowbit.formats.activations import per_token_nvfp4, rac_residual
from lowbit.rl.engine.weights import EngineLinear, EngineWeights
from lowbit.rl.precision import Precision, quantize_activation, rac_linear, weight_spec
from lowbit.rl.sampling import SamplingParams, truncated_logprobs
from lowbit.rl.trainer_side import apply_asymmetric_qat

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11], [3]]


# LLaMA 3.1's RoPE rescaling, shrunk so that it changes some of a 16-wide head's frequencies
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}


def _model(moe: bool, seed: int = 0, rope_scaling: dict | None = None):
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=48,
                      qk_norm=True, n_experts=4 if moe else 0, rope_scaling=rope_scaling)
    return cfg, build_model(cfg).eval()


def _engine(cfg, model, **kw):
    engine = RolloutEngine(cfg, max_batch_size=8, **kw)
    static = kw.get("activation_scale") == "static"
    # static scales calibrated on one short prompt: later tokens go past its range, and saturate
    engine.load_state_dict(model.state_dict(), input_amax=calibrate_input_amax(
        model, [torch.tensor(PROMPTS[1:2])]) if static else None)
    return engine


def _teacher_forced(model, prompt, completion, temperature=1.0):
    seq = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(seq).logits[0].float()
    logp = torch.log_softmax(logits / temperature, -1)[len(prompt) - 1:-1]
    return logp.gather(-1, torch.tensor(completion)[:, None])[:, 0]


@pytest.mark.parametrize("moe,rope_scaling", [(False, None), (True, None), (False, LLAMA3_ROPE)])
def test_bf16_engine_logprobs_equal_the_trainers_in_float32(moe, rope_scaling):
    cfg, model = _model(moe, rope_scaling=rope_scaling)
    if rope_scaling:   # the scaling changes the model's tables, and the engine's with them
        assert not torch.equal(model.model.rotary_emb.cos, _model(moe)[1].model.rotary_emb.cos)
    engine = _engine(cfg, model)
    rollout = engine.generate(PROMPTS, SamplingParams(temperature=0.8, max_new_tokens=9, seed=3))
    assert rollout.completion_mask.all()        # no stop ids: every row runs to the end
    for b, (prompt, completion) in enumerate(zip(PROMPTS, rollout.completion_lists())):
        expected = _teacher_forced(model, prompt, completion, temperature=0.8)
        torch.testing.assert_close(rollout.logprobs[b], expected, atol=2e-5, rtol=0)
    if moe:  # the recorded experts are the model's own routing of the same sequence
        seq = PROMPTS[1] + rollout.completion_lists()[1]
        x = model.model.embed_tokens(torch.tensor([seq]))
        layer = model.model.layers[0]
        from lowbit.models.transformer import DecoderLayer  # noqa: F401  (shape of the model)
        h = x + layer.self_attn(layer.input_layernorm(x), model.model.rotary_emb.cos[:len(seq)],
                                model.model.rotary_emb.sin[:len(seq)])
        _, _, index = layer.mlp.gate(layer.post_attention_layernorm(h)[0])
        routed = rollout.routed_experts[1, :len(seq) - 1, 0]
        assert torch.equal(routed.sort(-1).values, index[:-1].sort(-1).values)
        assert (rollout.routed_experts[1, len(seq) - 1:] == -1).all()


@pytest.mark.parametrize("precision,scale", [("bf16", "per-token"), ("nvfp4", "per-token"),
                                             ("nvfp4", "static")])
def test_kv_cache_decode_equals_full_recompute(precision, scale):
    cfg, model = _model(False)
    engine = _engine(cfg, model, precision=precision, activation_scale=scale)
    rollout = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, seed=1))
    sequences = [p + c for p, c in zip(PROMPTS, rollout.completion_lists())]
    scored = engine.score(sequences)
    for b, prompt in enumerate(PROMPTS):
        # nvfp4 quantizes each token on its own, so prefill and decode agree there too
        torch.testing.assert_close(scored[b][len(prompt) - 1:], rollout.logprobs[b], atol=2e-5, rtol=0)


@pytest.mark.parametrize("moe", [False, True])
def test_the_cache_grows_to_what_a_generate_needs(moe):
    """A default engine holds KVCache.GROWTH columns, not the model's whole context, and grows
    (at least doubling) for a longer prompt; its log-probs and routing equal an engine that
    holds the whole context from the start, before and after the growth."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=1024,
                      n_experts=4 if moe else 0)
    model = build_model(cfg).eval()
    grown, whole = _engine(cfg, model), _engine(cfg, model, max_seq_len=1024)
    assert grown.cache.capacity == 256 and whole.cache.capacity == 1024
    long = [torch.randint(0, 64, (300,)).tolist(), [5, 6]]
    params = SamplingParams(max_new_tokens=6, seed=2)
    for prompts, capacity in [(PROMPTS, 256), (long, 512), (PROMPTS, 512)]:
        a, b = grown.generate(prompts, params), whole.generate(prompts, params)
        assert grown.cache.capacity == capacity
        assert torch.equal(a.completions, b.completions)
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-6, rtol=0)
        if moe:
            assert grown.cache.routed.shape[2] == capacity
            assert torch.equal(a.routed_experts, b.routed_experts)
    with pytest.raises(ValueError, match="max_seq_len=1024"):
        grown.generate([[1] * 1020], params)
    assert grown.cache.capacity == 512      # a refused call allocates nothing


@pytest.mark.gpu
def test_racs_second_gemm_on_a_bf16_copy_sums_in_float32_and_rounds_once():
    # the dequantized-copy path with RAC's x2 on CUDA (a dense weight, more than one row: the
    # cuBLAS path): the exact sum of both products rounded once, up to accumulation order, and
    # no copy of the weight made on the way
    from lowbit.dispatch import inference
    from lowbit.formats.linear_weight import LinearWeight
    g = torch.Generator(device="cuda").manual_seed(0)
    x, x2 = (torch.randn(33, 4096, device="cuda", generator=g).bfloat16() for _ in range(2))
    w = torch.randn(4096, 4096, device="cuda", generator=g).bfloat16()
    exact = (x.double() @ w.double().T + x2.double() @ w.double().T)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    got = inference.linear(x, LinearWeight.dense(w), x2=x2)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before < w.nbytes // 2
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), exact.bfloat16().double(), rtol=2 ** -7, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("precision,compile_decode", [("bf16", False), ("nvfp4", False),
                                                    ("bf16", True)])
def test_cuda_graph_decode_equals_eager_decode(precision, compile_decode):
    cfg, model = _model(False)
    graphed = RolloutEngine(cfg, precision=precision, device="cuda", max_batch_size=8,
                            compile_decode=compile_decode)
    eager = RolloutEngine(cfg, precision=precision, device="cuda", max_batch_size=8, cuda_graph=False)
    for engine in (graphed, eager):
        engine.load_state_dict(model.state_dict())
    params = SamplingParams(max_new_tokens=12, seed=3)
    a, b = graphed.generate(PROMPTS, params), eager.generate(PROMPTS, params)
    assert graphed.cuda_graph and graphed.graph_note is None and 4 in graphed._graphs
    assert graphed.compile_decode == compile_decode
    assert torch.equal(a.completions, b.completions)
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-2, rtol=0)   # bf16 kernels may differ
    # a second call replays the same graph from a refilled cache
    again = graphed.generate(PROMPTS, params)
    assert torch.equal(again.completions, a.completions)


def test_precision_modes_order_the_logprob_gap():
    cfg = ModelConfig(vocab_size=64, dim=128, n_layers=2, n_heads=2, max_seq_len=48)
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    seqs = [[int(t) for t in torch.randint(0, 64, (24,))] for _ in range(8)]
    reference = torch.cat(_engine(cfg, model).score(seqs))
    gaps = {}
    for name, kw in {"fp8": {}, "nvfp4-w4a16": {}, "nvfp4": {},
                     "rac": dict(precision="nvfp4", rac_ratio=1.0)}.items():
        engine = _engine(cfg, model, precision=kw.pop("precision", name), **kw)
        gaps[name] = (torch.cat(engine.score(seqs)) - reference).abs().mean().item()
    assert 0 < gaps["fp8"] < gaps["nvfp4-w4a16"] < gaps["nvfp4"]
    assert gaps["rac"] < gaps["nvfp4"]


def test_rac_math_and_monotone_activation_error():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, 80, generator=g) * torch.rand(80, generator=g) * 4   # K not a multiple of 16
    x[3, 7] = 40.0                                                         # an outlier channel
    w = dispatch.quantize_dequantize(torch.randn(32, 80, generator=g), weight_spec())
    xq = quantize_activation(x, Precision.NVFP4)
    assert torch.equal(rac_linear(x, w, 0.0), F.linear(xq, w))            # ratio 0 is naive W4A4
    # per token, the paper's form: that token's residual channels appended along K, one GEMM
    ratio = 0.3
    residual = x - xq
    out = rac_linear(x, w, ratio)
    for n in (0, 3, 17):
        score = [(float(residual[n, c].abs()), -c) for c in range(80)]
        chosen = sorted(-c for _, c in sorted(score, reverse=True)[:math.ceil(ratio * 80)])
        x_aug = torch.cat([xq[n], quantize_activation(residual[n, chosen][None], Precision.NVFP4)[0]])
        w_aug = torch.cat([w, w[:, chosen]], dim=1)
        torch.testing.assert_close(out[n], w_aug @ x_aug, atol=1e-5, rtol=1e-5)
    # a token's output is what it is alone: RAC chooses its channels from the token itself (the
    # quantized residual bit for bit; the GEMM up to its accumulation order, which depends on M)
    assert torch.equal(rac_residual(x[5:9], xq[5:9], ratio), rac_residual(x, xq, ratio)[5:9])
    torch.testing.assert_close(rac_linear(x[3:4], w, ratio), out[3:4], atol=1e-5, rtol=1e-6)
    # more channels, less activation error, on this fixed input
    exact = F.linear(x, w)
    errors = [(rac_linear(x, w, r) - exact).norm().item() for r in (0, 0.125, 0.25, 0.5, 1.0)]
    assert all(a > b for a, b in zip(errors, errors[1:])), errors


def test_per_token_nvfp4_activations():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 40, generator=g)
    q = quantize_activation(x, Precision.NVFP4)
    # each token alone, and scaled by a power of two, quantizes the same
    assert torch.equal(quantize_activation(x[2:3], Precision.NVFP4), q[2:3])
    assert torch.equal(quantize_activation(x * 2.0 ** -20, Precision.NVFP4), q * 2.0 ** -20)
    # as accurate as two-level NVFP4 with the token's own tensor scale (within a few %)
    for row in x:
        two_level = dispatch.quantize_dequantize(row[None], weight_spec())[0]
        mine = quantize_activation(row[None], Precision.NVFP4)[0]
        assert (mine - row).norm() < 1.15 * (two_level - row).norm()
    special = torch.zeros(3, 32)
    special[1, 3] = float("nan")
    special[2, 20] = float("inf")
    out = quantize_activation(special, Precision.NVFP4)
    assert torch.equal(out[0], special[0])                                 # zeros stay zeros
    assert out[1, :16].isnan().all() and torch.isfinite(out[1, 16:]).all()  # NaN: its block
    assert out[2, 16:].isnan().all() and (out[2, :16] == 0).all()
    assert quantize_activation(x.bfloat16(), Precision.NVFP4).dtype == torch.bfloat16


E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _served_nvfp4(x, amax):
    """A served NVFP4 checkpoint's activation quantization, written out here: the FP32 input
    scale s = amax / 2688, per 1x16 block c = E4M3((amax_block / 6) / s) in [2^-6, 448], codes
    the nearest E2M1 of x * ((1 / s) / c) saturated at 6 (ties to the even code), value
    code * (s * c); a block with NaN or Inf is NaN."""
    s = torch.tensor(amax, dtype=torch.float32) / 2688.0
    out = torch.empty_like(x)
    grid = torch.tensor(E2M1)
    for n in range(x.shape[0]):
        for start in range(0, x.shape[1], 16):
            block = x[n, start:start + 16]
            if not torch.isfinite(block).all():
                out[n, start:start + 16] = float("nan")
                continue
            c = ((block.abs().max() / 6.0) / s).clamp(2.0 ** -6, 448.0).to(torch.float8_e4m3fn).float()
            v = (block * ((1.0 / s) / c)).abs().clamp(max=6.0)
            dist = (v[:, None] - grid[None, :]).abs()
            best = dist.min(dim=1, keepdim=True).values
            # the nearest grid point; of two equally near, the even code (index)
            index = torch.where(dist == best, torch.arange(8).remainder(2) * 10 + torch.arange(8), 99).argmin(1)
            out[n, start:start + 16] = torch.sign(block) * grid[index] * (s * c)
    return out


def test_static_activation_scales_are_a_served_checkpoints():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 40, generator=g) * 2.0            # K not a multiple of 16: a short block
    x[1, 5] = 50.0                                        # past the calibrated range
    # s = 2^-10 and block scale 256: x * 4 on the grid, here every midpoint (a tie) and 6
    x[2] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] * 5) / 4 * x[2].sign()
    x[3, 20], x[4, 33] = float("nan"), float("-inf")
    x[5] = 0.0
    amax = torch.tensor([2.625])
    q = quantize_activation(x, Precision.NVFP4, input_amax=amax)
    assert same_bits(q, _served_nvfp4(x, 2.625))
    assert torch.equal(q[2, :8].abs() * 4, torch.tensor([6.0, 0, 1, 1, 2, 2, 4, 4]))   # to even
    # saturation: nothing past the calibrated amax (6 * 448 * s), the outlier at it
    s = amax / 2688.0
    assert q[1, 5] == 6.0 * (s * 448.0) and q.nan_to_num(0).abs().max() <= 6.0 * (s * 448.0)
    # NaN / Inf: their blocks are NaN, the rest finite; zeros stay zeros
    assert q[3, 16:32].isnan().all() and q[4, 32:].isnan().all()
    assert torch.isfinite(q[3, :16]).all() and torch.isfinite(q[4, :32]).all() and (q[5] == 0).all()
    # a row is quantized alone (the scale is fixed before the batch); the dtype is x's
    assert same_bits(quantize_activation(x[1:3], Precision.NVFP4, input_amax=amax), q[1:3])
    assert quantize_activation(x.bfloat16(), Precision.NVFP4, input_amax=amax).dtype == torch.bfloat16
    # per-token is the default and unchanged: the per-token quantizer, not the static one
    assert same_bits(quantize_activation(x, Precision.NVFP4), per_token_nvfp4(x))
    with pytest.raises(ValueError, match="static activation scale is nvfp4's"):
        quantize_activation(x, Precision.FP8, input_amax=amax)


def test_static_activation_scales_are_calibrated_and_checked():
    cfg, model = _model(True)
    amax = calibrate_input_amax(model, [torch.tensor(PROMPTS[:1])])
    engine = _engine(cfg, model, precision="nvfp4", activation_scale="static")
    layer = engine.weights.layers[0]
    names = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    engine.load_state_dict(model.state_dict(), input_amax=amax)
    assert layer.qkv_proj.input_amax.item() == max(amax[n] for n in names)   # fused: the largest
    assert layer.o_proj.input_amax.item() == amax["model.layers.0.self_attn.o_proj"]
    experts = [v for k, v in amax.items() if k.startswith("model.layers.0.mlp.experts.")
               and k.endswith("down_proj")]
    assert layer.experts.down_amax.item() == max(experts)                  # one for all experts
    with pytest.raises(ValueError, match="needs each linear's calibrated input amax"):
        engine.load_state_dict(model.state_dict())
    with pytest.raises(ValueError, match="no calibrated amax for 'model.layers.1.self_attn.o_proj'"):
        engine.load_state_dict(model.state_dict(), input_amax={
            k: v for k, v in amax.items() if k != "model.layers.1.self_attn.o_proj"})
    with pytest.raises(ValueError, match="finite amax"):
        engine.load_state_dict(model.state_dict(), input_amax={**amax, names[1]: float("nan")})
    with pytest.raises(ValueError, match="activation_scale='static'"):
        _engine(cfg, model, precision="nvfp4").load_state_dict(model.state_dict(), input_amax=amax)
    for precision in ("fp8", "nvfp4-w4a16"):
        with pytest.raises(ValueError, match="use precision nvfp4"):
            RolloutEngine(cfg, precision, activation_scale="static")
    with pytest.raises(ValueError, match="unknown activation scale 'dynamic'"):
        RolloutEngine(cfg, "nvfp4", activation_scale="dynamic")


def test_sampling_is_seeded_and_truncates():
    cfg, model = _model(False)
    engine = _engine(cfg, model)
    params = SamplingParams(max_new_tokens=10, seed=5)
    a, b = engine.generate(PROMPTS, params), engine.generate(PROMPTS, params)
    assert torch.equal(a.completions, b.completions) and torch.equal(a.logprobs, b.logprobs)
    c = engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, seed=6))
    assert not torch.equal(a.completions[:, :4], c.completions)
    greedy = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=10))
    for p in (SamplingParams(top_k=1, max_new_tokens=10, seed=9),
              SamplingParams(top_p=1e-6, max_new_tokens=10, seed=9)):
        assert torch.equal(engine.generate(PROMPTS, p).completions, greedy.completions)
    # a stop token ends a row (and is part of it); the rest of the row is masked
    stop = int(a.completions[0, 3])
    s = engine.generate(PROMPTS, SamplingParams(max_new_tokens=10, seed=5, stop_token_ids=(stop,)))
    first = (a.completions[0] == stop).nonzero()[0].item()
    assert s.lengths[0] == first + 1 and s.stopped[0]
    assert torch.equal(s.completions[0, :first + 1], a.completions[0, :first + 1])
    # every row ends at once: the completions are that long, though a dense engine reads the
    # end one step late (the step after is sampled, then trimmed)
    done = engine.generate(PROMPTS, SamplingParams(max_new_tokens=10, seed=5,
                                                   stop_token_ids=tuple(range(cfg.vocab_size))))
    assert done.completions.shape == (4, 1) and done.stopped.all() and (done.lengths == 1).all()
    assert torch.equal(done.completions[:, 0], a.completions[:, 0])
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=100))


@pytest.mark.parametrize("top_k,top_p", [(0, 0.9), (5, 1.0), (5, 0.6), (40, 0.3), (2, 0.55)])
def test_top_k_and_top_p_keep_what_transformers_keeps(top_k, top_p):
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(64, 100, generator=torch.Generator().manual_seed(top_k)) * 3
    logits[0, :3] = torch.tensor([8.0, 7.3, 7.3 - math.log(0.5)])   # a case top-p decides after top-k
    params = SamplingParams(temperature=0.7, top_k=top_k, top_p=top_p)
    ours = truncated_logprobs(torch.log_softmax(logits / 0.7, -1), params)
    theirs = logits / 0.7
    if top_k:
        theirs = TopKLogitsWarper(top_k)(None, theirs)
    if top_p < 1:
        theirs = TopPLogitsWarper(top_p)(None, theirs)
    assert torch.equal(ours.isfinite(), theirs.isfinite())


def test_weight_sync_copies_and_changes_outputs():
    cfg, model = _model(True)
    engine = _engine(cfg, model, precision="nvfp4")
    before = engine.score([[1, 2, 3, 4, 5, 6]])[0]
    ptrs = {p.data_ptr() for p in model.parameters()}
    weights = engine.weights
    held = [weights.embed, weights.lm_head, weights.layers[0].qkv_proj.weight.data,
            weights.layers[0].experts.down.data, weights.layers[0].router]
    assert not ptrs & {t.data_ptr() for t in held}
    with torch.no_grad():                                 # the trainer's step, after the sync
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    assert torch.equal(engine.score([[1, 2, 3, 4, 5, 6]])[0], before)
    # fresh weights know their saturation flags before anything reads them (one read from the
    # device for all, at load; a sync reads them again, once for all, after writing)
    fresh = EngineWeights.load(model.state_dict(), cfg, Precision.NVFP4, 0.0, torch.device("cpu"),
                               torch.float32)
    layer = fresh.layers[0]
    assert all(w.settled for w in (layer.qkv_proj.weight, layer.o_proj.weight, layer.experts.gate_up,
                                   layer.experts.down))
    engine.load_state_dict(model.state_dict())            # the next sync
    assert not torch.equal(engine.score([[1, 2, 3, 4, 5, 6]])[0], before)
    with pytest.raises(ValueError, match="no 'model.norm.weight'"):
        engine.load_state_dict({k: v for k, v in model.state_dict().items() if k != "model.norm.weight"})


SYNC_MODES = {"bf16": dict(precision="bf16"), "fp8": dict(precision="fp8"),
              "nvfp4-w4a16": dict(precision="nvfp4-w4a16"),
              "nvfp4-w4a16-packed": dict(precision="nvfp4-w4a16", packed_gemm=True),
              "nvfp4": dict(precision="nvfp4"), "nvfp4-packed": dict(precision="nvfp4", packed_gemm=True),
              "rac": dict(precision="nvfp4", rac_ratio=0.25, rac_group=16),
              "static": dict(precision="nvfp4", activation_scale="static", packed_gemm=True),
              # the GEMMs on the kernels (Triton's interpreter on a CPU): tiles made by the kernel
              "nvfp4-packed-kernels": dict(precision="nvfp4", packed_gemm=True, decode_kernels=True)}
SEQS = [[1, 2, 3, 4, 5, 6], [7, 8, 9]]


def _stored(weights: EngineWeights) -> list[torch.Tensor]:
    """Every tensor the engine's weights hold, and what is made from them on first use (an
    NVFP4 weight's tiles, the values a reference GEMM multiplies), in a fixed order."""
    from lowbit.formats.linear_weight import WeightStorage
    out = []
    for part in weights._parts():
        if isinstance(part, torch.Tensor):
            out.append(part)
            continue
        out += [t for t in (part.data, part.block_scales, part.row_scales, part.reference_values())
                if t is not None]
        if part.format is WeightStorage.NVFP4:
            tiles = part.tiles()
            out += [tiles.words, tiles.scales, tiles.row_scales]
    return out


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def _perturbed(model) -> None:
    with torch.no_grad():                                   # a trainer step
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)


def _amax(model, kw):
    return (calibrate_input_amax(model, [torch.tensor(PROMPTS[1:2])])
            if kw.get("activation_scale") == "static" else None)


@pytest.mark.parametrize("mode", list(SYNC_MODES))
@pytest.mark.parametrize("moe", [False, True])
def test_a_sync_writes_a_fresh_loads_bits_into_the_tensors_it_holds(mode, moe):
    # the sync builds each part as load does and copies it into the live one: every stored
    # tensor, tile and reference value is a fresh load's bit for bit, in the same storage (the
    # CUDA graphs captured on it stay valid), and so are the outputs
    if SYNC_MODES[mode].get("decode_kernels"):
        interpreted_kernels()     # a CPU engine on the kernels
    kw = dict(SYNC_MODES[mode], dtype=torch.bfloat16)
    cfg, model = _model(moe)
    engine = _engine(cfg, model, **kw)
    weights, decoder = engine.weights, engine.decoder
    before = engine.score(SEQS)
    pointers = [t.data_ptr() for t in _stored(weights)]    # tiles and values made: refreshed
    _perturbed(model)
    engine.sync(model.state_dict(), input_amax=_amax(model, kw))
    fresh = _engine(cfg, model, **kw)                       # EngineWeights.load of the same dict
    assert engine.weights is weights and engine.decoder is decoder
    synced = _stored(engine.weights)
    assert [t.data_ptr() for t in synced] == pointers
    assert all(_same_bytes(a, b) for a, b in zip(synced, _stored(fresh.weights), strict=True))
    assert [w.may_saturate for w in engine.weights._linear_weights()] == \
        [w.may_saturate for w in fresh.weights._linear_weights()]
    after = engine.score(SEQS)
    assert all(torch.equal(a, b) for a, b in zip(after, fresh.score(SEQS)))
    assert not torch.equal(after[0], before[0])            # the sync changed the weights


@pytest.mark.parametrize("moe", [False, True])
def test_a_load_quantizes_fused_parts_and_experts_in_one_pass_each_with_their_own_bits(moe, monkeypatch):
    # NVFP4 weights quantized on the kernels (CPU tensors under Triton's interpreter, patched
    # in): q|k|v, gate|up and an MoE layer's expert stacks each one pass (quantize_rows), every
    # stored tensor the bits of the reference's part-by-part quantization
    from lowbit import kernels

    if not kernels.interpret_mode():
        pytest.skip("runs the kernels on CPU tensors: Triton's interpreter only")
    cfg, model = _model(moe)
    ref = _engine(cfg, model, precision="nvfp4", dtype=torch.bfloat16, packed_gemm=True)
    calls, real = [], kernels.quantize_rows_triton
    monkeypatch.setattr("lowbit.kernels.quantize_rows_triton", lambda *a: (calls.append(list(a[2])), real(*a))[1])
    monkeypatch.setattr("lowbit.dispatch._quantizers.use_kernels",
                        lambda x, spec, codes=True: spec.format == "nvfp4")
    got = _engine(cfg, model, precision="nvfp4", dtype=torch.bfloat16, packed_gemm=True)
    assert all(_same_bytes(a, b) for a, b in zip(_stored(got.weights), _stored(ref.weights), strict=True))
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    mlp = ([[2 * cfg.moe_ffn_dim] * cfg.n_experts, [cfg.dim] * cfg.n_experts] if moe
           else [[cfg.ffn_dim, cfg.ffn_dim]])
    assert calls == [[q, kv, kv], *mlp] * cfg.n_layers


@pytest.mark.parametrize("moe", [False, True])
def test_a_sync_holds_one_new_part_at_a_time(moe, monkeypatch):
    # each part built from the state dict is freed once copied, before the next is built: the
    # engine's weights are never held twice
    import weakref
    from lowbit.rl.engine.weights import EngineExperts
    cfg, model = _model(moe)
    engine = _engine(cfg, model, precision="nvfp4", dtype=torch.bfloat16)
    built = []

    def counted(cls):
        real = cls.copy_

        def copy_(self, other):
            assert all(ref() is None for ref in built)      # every earlier part freed
            built.append(weakref.ref(other))
            real(self, other)
        monkeypatch.setattr(cls, "copy_", copy_)
    counted(EngineLinear), counted(EngineExperts)
    _perturbed(model)
    engine.sync(model.state_dict())
    assert len(built) == cfg.n_layers * (3 if moe else 4)   # q|k|v, o, gate|up, down or experts


@pytest.mark.parametrize("moe", [False, True])
def test_a_refused_sync_says_why_in_one_line_and_writes_nothing(moe):
    # every check runs before the first write: the last layer's weight of a wrong shape, a key
    # missing or unknown, a packed weight of another format, a packed embedding
    cfg, model = _model(moe)
    engine = _engine(cfg, model, precision="nvfp4", dtype=torch.bfloat16)
    scores = engine.score(SEQS)
    before = [t.clone() for t in _stored(engine.weights)]
    _perturbed(model)
    sd = model.state_dict()
    last = "model.layers.1.mlp.experts.down_proj" if moe else "model.layers.1.mlp.down_proj.weight"
    o_proj = "model.layers.1.self_attn.o_proj.weight"
    fp8 = RolloutEngine(cfg, precision="fp8", dtype=torch.bfloat16).pack_state_dict(sd)
    nvfp4 = RolloutEngine(cfg, precision="nvfp4", dtype=torch.bfloat16).pack_state_dict(sd)
    for bad, message in (({**sd, last: sd[last][..., :-1]}, f"state dict's '{last}' has shape"),
                         ({k: v for k, v in sd.items() if k != "model.norm.weight"},
                          "state dict has no 'model.norm.weight'"),
                         ({**sd, "model.layers.1.mlp.extra": sd["model.norm.weight"]},
                          "keys the engine's model does not: model.layers.1.mlp.extra"),
                         ({**sd, o_proj: fp8[o_proj]}, "a packed weight must be what this engine stores"),
                         ({**sd, "model.embed_tokens.weight": nvfp4[o_proj]}, "must be a tensor")):
        with pytest.raises(ValueError, match=message) as refused:
            engine.sync(bad)
        assert "\n" not in str(refused.value)
        assert engine.loaded
        assert all(_same_bytes(a, b) for a, b in zip(_stored(engine.weights), before, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(engine.score(SEQS), scores))


def test_a_sync_stopped_while_writing_leaves_the_engine_unloaded_until_the_next(monkeypatch):
    # an error after the checks (out of memory building a part) leaves the weights part old,
    # part new: the engine refuses to generate on them, and the next sync writes them whole
    # (and asks for the kernels to be captured again: the flags they took are not known)
    cfg, model = _model(False)
    engine = _engine(cfg, model, precision="nvfp4", dtype=torch.bfloat16)
    _perturbed(model)
    real, calls = EngineLinear.copy_, []

    def fails_third(self, other):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("out of memory")
        real(self, other)
    monkeypatch.setattr(EngineLinear, "copy_", fails_third)
    with pytest.raises(RuntimeError, match="out of memory"):
        engine.sync(model.state_dict())
    assert not engine.loaded
    with pytest.raises(ValueError, match="stopped while writing"):
        engine.score(SEQS)
    monkeypatch.undo()
    assert engine.weights.load_(model.state_dict()) is False
    assert engine.loaded and engine.weights.load_(model.state_dict()) is True
    fresh = _engine(cfg, model, precision="nvfp4", dtype=torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(engine.score(SEQS), fresh.score(SEQS)))


def test_a_sync_that_changes_a_saturation_flag_says_so():
    # a weight that reaches bf16's largest value saturates where it is dequantized: a kernel
    # captured on the weight took the flag as a constant, so the sync asks for a new capture
    cfg, model = _model(False)
    sd, name = model.state_dict(), "model.layers.0.self_attn.o_proj.weight"
    huge = sd[name].clone()
    huge[3, 5] = torch.finfo(torch.bfloat16).max
    args = (cfg, Precision.NVFP4, 0.0, torch.device("cpu"), torch.bfloat16)
    weights = EngineWeights.load(sd, *args)
    o_proj = weights.layers[0].o_proj.weight
    assert not o_proj.may_saturate
    assert weights.load_({**sd, name: huge}) is False and o_proj.may_saturate
    assert weights.load_({**sd, name: huge}) is True
    fresh = EngineWeights.load({**sd, name: huge}, *args)
    assert all(_same_bytes(a, b) for a, b in zip(_stored(weights), _stored(fresh), strict=True))
    assert weights.load_(sd) is False and not o_proj.may_saturate
    with pytest.raises(ValueError, match="loaded without static activation scales"):
        weights.load_(sd, input_amax={})


@pytest.mark.parametrize("precision", ["fp8", "nvfp4-w4a16", "nvfp4"])
@pytest.mark.parametrize("moe", [False, True])
def test_a_packed_sync_stores_the_same_bits_and_moves_fewer_bytes(precision, moe):
    # pack_state_dict quantizes where the state dict is (here a float32 trainer's weights for a
    # bfloat16 engine: cast first, as load does) and load takes the QTensors as they are
    from lowbit.formats import QTensor
    cfg, model = _model(moe)
    kw = dict(precision=precision, dtype=torch.bfloat16)
    direct, packed_engine = _engine(cfg, model, **kw), _engine(cfg, model, **kw)
    packed = packed_engine.pack_state_dict(model.state_dict())
    packed_engine.load_state_dict(packed)
    for a, b in zip(direct.weights._parts(), packed_engine.weights._parts()):
        for x, y in ((a, b),) if isinstance(a, torch.Tensor) else (
                (a.data, b.data), (a.block_scales, b.block_scales), (a.row_scales, b.row_scales)):
            assert (x is None and y is None) or torch.equal(x, y)
    seqs = [[1, 2, 3, 4, 5, 6], [7, 8, 9]]
    assert all(torch.equal(a, b) for a, b in zip(direct.score(seqs), packed_engine.score(seqs)))
    # what moves: the linear weights as codes and scales, the rest as given
    linear = [v for k, v in packed.items() if "proj" in k]
    parts = [q for v in linear for q in (v if isinstance(v, list) else [v])]
    assert parts and all(isinstance(q, QTensor) for q in parts)
    dense_bytes = sum(v.numel() * 2 for k, v in model.state_dict().items() if "proj" in k)
    ratio = sum(q.nbytes for q in parts) / dense_bytes
    assert ratio < (0.55 if precision == "fp8" else 0.3), ratio
    # a packed weight this engine does not store, and one made from other values, are refused
    name = "model.layers.0.self_attn.o_proj.weight"
    other = _engine(cfg, model, precision="fp8" if precision != "fp8" else "nvfp4",
                    dtype=torch.bfloat16).pack_state_dict(model.state_dict())
    with pytest.raises(ValueError, match="a packed weight must be what this engine stores"):
        packed_engine.load_state_dict({**packed, name: other[name]})
    f32 = _engine(cfg, model, precision=precision).pack_state_dict(model.state_dict())
    with pytest.raises(ValueError, match="torch.bfloat16 values"):
        packed_engine.load_state_dict({**packed, name: f32[name]})
    with pytest.raises(ValueError, match="a bf16 engine stores dense weights"):
        _engine(cfg, model).load_state_dict(packed)


def test_a_packed_sync_takes_per_expert_checkpoints_biases_and_an_untied_head():
    # older Qwen3-MoE files keep experts one by one (fused before packing), Qwen2 has q/k/v
    # biases (never packed), an untied lm_head stays dense; a CPU source is not packed by sync
    torch.manual_seed(3)
    cfg = ModelConfig(vocab_size=64, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=48,
                      n_experts=4, qkv_bias=True, tie_embeddings=False)
    model = build_model(cfg).eval()
    sd, p = dict(model.state_dict()), "model.layers.0.mlp.experts."
    gate_up, down = sd.pop(p + "gate_up_proj"), sd.pop(p + "down_proj")
    F = gate_up.shape[1] // 2
    for e in range(cfg.n_experts):
        sd[f"{p}{e}.gate_proj.weight"], sd[f"{p}{e}.up_proj.weight"] = gate_up[e, :F], gate_up[e, F:]
        sd[f"{p}{e}.down_proj.weight"] = down[e]
    direct = _engine(cfg, model, precision="nvfp4", dtype=torch.bfloat16)
    packed = RolloutEngine(cfg, precision="nvfp4", dtype=torch.bfloat16, max_batch_size=8)
    packed.load_state_dict(packed.pack_state_dict(sd))
    synced = RolloutEngine(cfg, precision="nvfp4", dtype=torch.bfloat16, max_batch_size=8)
    synced.sync(sd)
    seqs = [[1, 2, 3, 4, 5, 6], [7, 8, 9]]
    want = direct.score(seqs)
    for engine in (packed, synced):
        assert all(torch.equal(a, b) for a, b in zip(want, engine.score(seqs)))


@pytest.mark.gpu
def test_an_engine_on_cuda_syncs_weights_on_its_own_card_without_packing_them_first(monkeypatch):
    # device "cuda" names the card the trainer's tensors say "cuda:0" of: the same device, so
    # sync quantizes on arrival instead of packing the whole model at the source
    cfg = ModelConfig(vocab_size=64, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=48)
    model = build_model(cfg).cuda().eval()
    engine = RolloutEngine(cfg, precision="nvfp4", device="cuda", max_batch_size=8)
    assert engine.device == next(model.parameters()).device
    monkeypatch.setattr(engine, "pack_state_dict", lambda sd: pytest.fail("packed on one card"))
    engine.sync(model.state_dict())
    assert engine.loaded


def _captured_sync_matches_fresh_loads(cfg, model, kw, steps: int):
    """Syncs from the model's own parameters, stepped in place between them, on a CUDA engine:
    each leaves a fresh eager load's bits and flags; returns the engine."""
    engine = RolloutEngine(cfg, max_batch_size=8, device="cuda", **kw)
    for i in range(steps):
        engine.sync(model.state_dict())
        assert engine.weights.captured_sync == (i >= 1), i   # the second is captured, then replayed
        fresh = RolloutEngine(cfg, max_batch_size=8, device="cuda", cuda_graph=False, **kw)
        fresh.load_state_dict(model.state_dict())
        assert all(_same_bytes(a, b) for a, b in zip(_stored(engine.weights), _stored(fresh.weights),
                                                     strict=True)), i
        assert [w.may_saturate for w in engine.weights._linear_weights()] == \
            [w.may_saturate for w in fresh.weights._linear_weights()]
        assert all(torch.equal(a, b) for a, b in zip(engine.score(SEQS), fresh.score(SEQS)))
        _perturbed(model)
    assert engine.weights.sync_graph_off is None and engine.weights.replayed_syncs == steps - 2
    return engine


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["bf16", "fp8", "nvfp4-w4a16", "nvfp4-packed-kernels", "rac-fold"])
@pytest.mark.parametrize("moe", [False, True])
def test_a_captured_sync_replays_a_fresh_loads_bits(mode, moe):
    # a trainer's sync hands the same tensors each step: the first sync after the load is
    # captured in a CUDA graph and later ones replay it, each the bits and saturation flags of
    # a fresh load (_stored makes each weight's reference values and tiles at the load, before
    # the capture: a form made after it is the test below's)
    kw = dict(dtype=torch.bfloat16, **({"rac-fold": dict(precision="nvfp4", rac_ratio=0.25, rac_group=64,
                                                        rac_fold=True, packed_gemm=True)}.get(mode)
                                        or SYNC_MODES[mode]))
    cfg, model = _model(moe)
    engine = _captured_sync_matches_fresh_loads(cfg, model.cuda(), kw, steps=4)
    # other tensors (a copy of the dict): eager, the same bits; the graph is dropped
    copy = {k: v.clone() for k, v in model.state_dict().items()}
    engine.sync(copy)
    assert not engine.weights.captured_sync
    fresh = RolloutEngine(cfg, max_batch_size=8, device="cuda", cuda_graph=False, **kw)
    fresh.load_state_dict(copy)
    assert all(_same_bytes(a, b) for a, b in zip(_stored(engine.weights), _stored(fresh.weights), strict=True))


@pytest.mark.gpu
def test_a_replayed_sync_that_changes_a_saturation_flag_says_so():
    # the flags come from the maxima the graph leaves on the device: a weight made to reach
    # bf16's largest value after the capture is seen, and the engine's decode graphs dropped
    cfg, model = _model(False)
    model = model.cuda()
    engine = RolloutEngine(cfg, precision="nvfp4", packed_gemm=True, device="cuda", max_batch_size=8,
                           dtype=torch.bfloat16)
    engine.sync(model.state_dict())
    engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, seed=1))    # tiles made, graphs captured
    engine.sync(model.state_dict())
    assert engine.weights.captured_sync and engine._graphs
    o_proj = engine.weights.layers[0].o_proj.weight
    assert not o_proj.may_saturate
    with torch.no_grad():
        model.model.layers[0].self_attn.o_proj.weight[3, 5] = torch.finfo(torch.bfloat16).max
    engine.sync(model.state_dict())                                       # replayed
    assert engine.weights.replayed_syncs == 1 and o_proj.may_saturate and not engine._graphs


@pytest.mark.gpu
def test_a_form_made_after_the_capture_makes_the_next_sync_eager_and_captured_anew():
    # the graph refreshes the forms a weight had when it was captured: one made after (here
    # the reference values, at a first use) would go stale, so that sync runs eagerly (and
    # captures itself again), and the one after replays the new graph
    cfg, model = _model(False)
    model = model.cuda()
    kw = dict(precision="nvfp4", packed_gemm=True, dtype=torch.bfloat16)
    engine = RolloutEngine(cfg, max_batch_size=8, device="cuda", **kw)
    engine.sync(model.state_dict())
    engine.sync(model.state_dict())                                       # captured
    assert engine.weights.captured_sync and engine.weights.replayed_syncs == 0
    lin = engine.weights.layers[0].o_proj.weight
    assert lin.made_forms[1] is False
    lin.reference_values()                                                # made after the capture
    _perturbed(model)
    engine.sync(model.state_dict())
    assert engine.weights.replayed_syncs == 0 and engine.weights.captured_sync   # eager, captured anew
    fresh = RolloutEngine(cfg, max_batch_size=8, device="cuda", cuda_graph=False, **kw)
    fresh.load_state_dict(model.state_dict())
    torch.testing.assert_close(lin.reference_values(), fresh.weights.layers[0].o_proj.weight.reference_values(),
                               rtol=0, atol=0)
    _perturbed(model)
    engine.sync(model.state_dict())
    assert engine.weights.replayed_syncs == 1
    fresh.load_state_dict(model.state_dict())
    assert all(_same_bytes(a, b) for a, b in zip(_stored(engine.weights), _stored(fresh.weights), strict=True))


@pytest.mark.gpu
def test_a_sync_with_static_scales_on_cuda_is_never_captured():
    # static scales' amax are the host's numbers, baked into a graph: such syncs run eagerly
    cfg, model = _model(False)
    amax = _amax(model, SYNC_MODES["static"])                             # calibrated on the CPU
    model = model.cuda()
    engine = RolloutEngine(cfg, max_batch_size=8, device="cuda", **SYNC_MODES["static"])
    for _ in range(3):
        engine.sync(model.state_dict(), input_amax=amax)
        assert not engine.weights.captured_sync and engine.weights.sync_graph_off is None


@pytest.mark.parametrize("moe", [False, True])
def test_a_sync_on_the_cpu_is_never_captured(moe):
    # graphs need CUDA: asked for one, a CPU engine's sync runs eagerly
    cfg, model = _model(moe)
    engine = _engine(cfg, model, precision="nvfp4", packed_gemm=True)
    for _ in range(3):
        assert engine.weights.load_(model.state_dict(), graph=True) is True
        assert not engine.weights.captured_sync and engine.weights.sync_graph_off is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_asymmetric_qat_weights_are_the_engines_bit_for_bit(dtype):
    # every projection of every layer, dense and MoE (each expert's gate|up and down)
    for moe in (False, True):
        cfg, model = _model(moe)
        engine = _engine(cfg, model, precision="nvfp4", dtype=dtype)
        apply_asymmetric_qat(model)
        for i, layer in enumerate(model.model.layers):
            # what the trainer's forward GEMM multiplies (weights in the compute dtype, as autocast casts)
            def trainer(module):
                return operand(module.weight.to(dtype), module.linear_recipe.fprop_w, reduce_dim=1)
            names = ["q_proj", "k_proj", "v_proj", "o_proj"] + ([] if moe else ["gate_proj", "up_proj", "down_proj"])
            for name in names:
                module = getattr(layer.self_attn if name[0] in "qkvo" else layer.mlp, name)
                assert torch.equal(trainer(module), engine.linear_values(i, name)), (i, name)
                assert module.linear_recipe.fprop_x is None and module.linear_recipe.dgrad_dy is None
            if moe:
                experts = layer.mlp.experts
                for e in range(cfg.n_experts):
                    engine_experts = engine.weights.layers[i].experts
                    for fused, engine_side in ((experts.gate_up_proj, engine_experts.gate_up),
                                               (experts.down_proj, engine_experts.down)):
                        expected = operand(fused[e].to(dtype), experts.linear_recipe.fprop_w, reduce_dim=1)
                        assert torch.equal(expected, engine_side.expert(e).dequantize()), (i, e)
        assert not hasattr(model.lm_head, "linear_recipe")        # the head is kept, as in the engine


def test_bf16_engine_decode_matches_the_trainer_in_bf16():
    # the engine's fused GEMMs, F.rms_norm, rolled rotary and grouped-query decode attention
    # round as the trainer's bf16 forward does, up to accumulation order
    cfg, model = _model(False)
    model = model.to(torch.bfloat16)
    engine = _engine(cfg, model, dtype=torch.bfloat16)
    rollout = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=10))
    for b, (prompt, completion) in enumerate(zip(PROMPTS, rollout.completion_lists())):
        seq = torch.tensor([prompt + completion])
        with torch.no_grad():
            logits = model(seq).logits[0].float()[len(prompt) - 1:-1]
        assert torch.equal(logits.argmax(-1), torch.tensor(completion))      # greedy is the argmax
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
        torch.testing.assert_close(rollout.logprobs[b], expected, atol=3e-2, rtol=0)


def test_fused_projections_are_the_separate_ones():
    g = torch.Generator().manual_seed(2)
    weights = [torch.randn(n, 48, generator=g) * s for n, s in ((32, 1.0), (16, 30.0), (16, 1e-3))]
    x = torch.randn(5, 48, generator=g)
    for precision, rac in (("bf16", 0.0), ("fp8", 0.0), ("nvfp4-w4a16", 0.0), ("nvfp4", 0.5)):
        args = (Precision(precision), rac, torch.device("cpu"), torch.float32)
        fused = EngineLinear.fused(weights, *args)
        parts = [EngineLinear(w, *args) for w in weights]
        for i, part in enumerate(parts):   # each part quantized on its own (its own tensor scale)
            assert torch.equal(fused.part(i), part.values)
        torch.testing.assert_close(fused(x), torch.cat([p(x) for p in parts], -1), atol=1e-5, rtol=1e-5)
        assert fused.nbytes == sum(p.nbytes for p in parts)


def test_racs_channel_group_reaches_the_linear_and_the_experts():
    # rac_group G: each linear's RAC term is the grouped choice's residual (rac_residual's
    # definition), not the row-wide one's; MoE experts take the same setting
    from lowbit.dispatch import inference
    from lowbit.formats.linear_weight import LinearWeight
    g = torch.Generator().manual_seed(4)
    w = torch.randn(24, 80, generator=g)                  # K = 80: groups of 16, the last full
    x = torch.randn(6, 80, generator=g) * torch.rand(80, generator=g) * 4
    args = (Precision.NVFP4, 0.25, torch.device("cpu"), torch.float32)
    grouped, rowwide = EngineLinear(w, *args, rac_group=16), EngineLinear(w, *args)
    xq = quantize_activation(x, Precision.NVFP4)
    expected = inference.linear(xq, LinearWeight.dense(grouped.values), use_kernels=False,
                                x2=rac_residual(x, xq, 0.25, 16))
    torch.testing.assert_close(grouped(x, use_kernels=False), expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(grouped(x, use_kernels=False), rowwide(x, use_kernels=False), atol=1e-4)
    # the experts: both GEMMs' activations quantized with the group, and other outputs for it
    from lowbit.rl.engine.weights import EngineExperts
    gate_up, down = torch.randn(4, 64, 80, generator=g), torch.randn(4, 80, 32, generator=g)
    tokens = torch.randn(5, 80, generator=g) * torch.rand(80, generator=g) * 4
    index = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 3], [2, 0]])
    route = torch.rand(5, 2, generator=g)
    experts = {G: EngineExperts(gate_up, down, *args, rac_group=G) for G in (0, 16)}
    seen = []
    real = inference.quantize_activations

    def spy(*a, **kw):
        seen.append(kw.get("rac_group"))
        return real(*a, **kw)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(inference, "quantize_activations", spy)
        grouped_out = experts[16](tokens, index, route, use_kernels=False)
    assert seen == [16, 16]
    assert not torch.allclose(grouped_out, experts[0](tokens, index, route, use_kernels=False), atol=1e-4)
    # and through the engine, dense and MoE layers alike
    cfg = ModelConfig(vocab_size=64, dim=64, n_layers=1, n_heads=4, max_seq_len=24, n_experts=4)
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    engine = _engine(cfg, model, precision="nvfp4", rac_ratio=0.25, rac_group=16)
    assert engine.rac_group == 16 and engine.weights.layers[0].experts.rac_group == 16
    assert engine.weights.layers[0].qkv_proj.rac_group == 16
    # a group needs RAC, and is a power of two from 16
    for kw, message in ((dict(precision="nvfp4", rac_group=64), "groups RAC's channels"),
                        (dict(precision="nvfp4", rac_ratio=0.25, rac_group=48), "power of two"),
                        (dict(precision="nvfp4", rac_ratio=0.25, rac_group=True), "power of two")):
        with pytest.raises(ValueError, match=message):
            RolloutEngine(cfg, **kw)


def test_compiled_decode_equals_eager_and_survives_weight_sync():
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=24,
                      qk_norm=True)
    model = build_model(cfg).eval()
    compiled, eager = _engine(cfg, model, compile_decode=True), _engine(cfg, model)
    params = SamplingParams(max_new_tokens=6, seed=3)
    graphs = counters["stats"]["unique_graphs"]
    for sync in range(2):
        a, b = compiled.generate(PROMPTS, params), eager.generate(PROMPTS, params)
        assert torch.equal(a.completions, b.completions)
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=2e-5, rtol=0)
        with torch.no_grad():                               # a trainer step, then the sync
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        compiled.load_state_dict(model.state_dict())
        eager.load_state_dict(model.state_dict())
    assert counters["stats"]["unique_graphs"] == graphs + 1   # compiled once, for batch 4
    with pytest.raises(ValueError, match="compile_decode needs a dense model"):
        RolloutEngine(_model(True)[0], compile_decode=True)
    with pytest.raises(ValueError, match="captures its own CUDA graphs"):
        RolloutEngine(cfg, compile_decode="reduce-overhead")
