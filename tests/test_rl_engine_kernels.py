"""The rollout engine on its inference kernels (lowbit.dispatch.inference: the packed-weight GEMM,
decode attention, activation quantizers) against the same engine on plain PyTorch, in every
precision mode, dense and MoE; and the invariances every mode keeps: a row alone equals the row
in a batch, and decode log-probs equal a re-score. The kernels run on the GPU where there is one,
else in Triton's interpreter on the CPU (slow: tiny models, few tokens)."""

import functools

import pytest
import torch

pytest.importorskip("triton")

from lowbit.export import calibrate_input_amax  # noqa: E402
from lowbit.models import ModelConfig, build_model  # noqa: E402
from lowbit.rl.engine import RolloutEngine, batch_bucket  # noqa: E402
from lowbit.rl.sampling import SamplingParams  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# "nvfp4+static": NVFP4 activations under static scales calibrated on the model (a served W4A4)
MODES = [("bf16", 0.0), ("fp8", 0.0), ("nvfp4-w4a16", 0.0), ("nvfp4", 0.0), ("nvfp4", 0.25),
         ("nvfp4+static", 0.25)]
PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11], [3]]
# the kernel-against-reference cases run in Triton's interpreter on the CPU, where every
# prefill row (batch x longest prompt) and decode row costs RAC's channel select: two rows of
# two lengths (one right-padded, their positions apart) keep them short
KERNEL_PROMPTS = [[1, 2], [7]]


def _model(moe: bool, seed: int = 0, **kw):
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=64, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=32,
                      qk_norm=True, n_experts=4 if moe else 0, **kw)
    return cfg, build_model(cfg).eval()


def _engine(cfg, model, precision, rac, device=DEV, **kw):
    static = precision.endswith("+static")
    engine = RolloutEngine(cfg, precision.removesuffix("+static"), rac, device=device,
                           max_batch_size=8, activation_scale="static" if static else "per-token", **kw)
    # calibrated on one short prompt: later tokens go past its range, and saturate
    engine.load_state_dict(model.state_dict(), input_amax=calibrate_input_amax(
        model, [torch.tensor(PROMPTS[1:2])]) if static else None)
    return engine


KERNEL_CASES = [(p, r, False) for p, r in MODES if "static" not in p] + [
    ("nvfp4-w4a16", 0.0, True), ("nvfp4", 0.25, True)]


GREEDY = SamplingParams(temperature=0, max_new_tokens=3)     # greedy: the same tokens


@functools.cache
def kernel_rollout(precision: str, rac: float, packed: bool, moe: bool, cuda_graph: bool):
    """The greedy rollout of KERNEL_PROMPTS by the engine on the kernels, float32, _model(moe):
    generated once (the interpreter is slow) for the tests that compare against it, which only
    read it. Off the GPU the compiled-step test's eager engine is this same engine."""
    cfg, model = _model(moe)
    engine = _engine(cfg, model, precision, rac, decode_kernels=True, dtype=torch.float32,
                     cuda_graph=cuda_graph, packed_gemm=packed)
    return engine.generate(KERNEL_PROMPTS, GREEDY)


@pytest.mark.parametrize("moe", [False, True])
@pytest.mark.parametrize("precision,rac,packed", KERNEL_CASES)
def test_the_kernels_decode_what_the_reference_decodes(precision, rac, packed, moe):
    # float32 on both sides (on the GPU too), so that the kernels agree with the reference to
    # accumulation order and greedy decoding picks the same tokens
    cfg, model = _model(moe)
    reference = _engine(cfg, model, precision, rac, decode_kernels=False, dtype=torch.float32,
                        cuda_graph=False, packed_gemm=packed)
    a = kernel_rollout(precision, rac, packed, moe, cuda_graph=False)
    b = reference.generate(KERNEL_PROMPTS, GREEDY)
    assert torch.equal(a.completions, b.completions)
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=0)
    if moe:
        assert torch.equal(a.routed_experts, b.routed_experts)


def test_static_activation_scales_on_the_kernels_score_what_the_reference_scores():
    # one forward (the interpreter is slow): the static quantizer's own kernel-vs-reference
    # bits are tests/test_activation_quant.py's; here the engine hands it each layer's amax
    cfg, model = _model(False)
    kw = dict(dtype=torch.float32, cuda_graph=False, packed_gemm=True)
    kernels = _engine(cfg, model, "nvfp4+static", 0.25, decode_kernels=True, **kw)
    reference = _engine(cfg, model, "nvfp4+static", 0.25, decode_kernels=False, **kw)
    sequence = [[1, 2, 3, 4, 5, 6, 7, 8]]
    torch.testing.assert_close(kernels.score(sequence)[0], reference.score(sequence)[0],
                               atol=1e-4, rtol=0)


def _sampled_row_is_its_own(engine) -> tuple[list, list]:
    """Sample PROMPTS, then check a row scored alone equals it scored in the batch and decode's
    log-probs equal a re-score; the sequences and their scores."""
    batch = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=6, seed=2))
    sequences = [p + c for p, c in zip(PROMPTS, batch.completion_lists())]
    together = engine.score(sequences)
    torch.testing.assert_close(engine.score(sequences[2:3])[0], together[2], atol=2e-5, rtol=0)
    for b, prompt in enumerate(PROMPTS):
        torch.testing.assert_close(together[b][len(prompt) - 1:], batch.logprobs[b], atol=2e-5, rtol=0)
    return sequences, together


def test_racs_channel_groups_on_the_kernels_equal_the_reference_and_keep_a_row_its_own():
    # rac_group 16 on an engine linear (K = 80: five groups a token): the kernels compute what
    # the reference computes; on the reference engine a row alone equals the row in a batch
    from lowbit.rl.engine.weights import EngineLinear
    from lowbit.rl.precision import Precision
    g = torch.Generator().manual_seed(4)
    w, x = torch.randn(24, 80, generator=g), torch.randn(6, 80, generator=g) * 3
    linear = EngineLinear(w, Precision.NVFP4, 0.25, torch.device(DEV), torch.float32,
                          packed_gemm=True, rac_group=16)
    x = x.to(DEV)
    torch.testing.assert_close(linear(x), linear(x, use_kernels=False), atol=1e-4, rtol=1e-5)
    cfg, model = _model(True, seed=1)
    engine = _engine(cfg, model, "nvfp4", 0.25, device="cpu", rac_group=16)
    _sampled_row_is_its_own(engine)


def test_racs_residual_folded_on_the_kernels_equals_the_reference_and_keeps_a_row_its_own():
    # rac_fold: the linear multiplies rac_folded(x_hat, r_hat), one operand, on the kernels as on
    # the reference (groups of 16 and row-wide); on the reference engine (MoE, groups of 16)
    # a row alone equals the row in a batch and decode equals a re-score
    from lowbit.dispatch import inference
    from lowbit.formats.activations import rac_folded, rac_residual
    from lowbit.formats.linear_weight import LinearWeight
    from lowbit.rl.engine.weights import EngineLinear
    from lowbit.rl.precision import Precision, quantize_activation
    g = torch.Generator().manual_seed(4)
    w, x = torch.randn(24, 80, generator=g), torch.randn(6, 80, generator=g) * 3
    for group in (16, 0):
        folded = EngineLinear(w, Precision.NVFP4, 0.25, torch.device(DEV), torch.float32,
                              packed_gemm=True, rac_group=group, rac_fold=True)
        xd = x.to(DEV)
        torch.testing.assert_close(folded(xd), folded(xd, use_kernels=False), atol=1e-4, rtol=1e-5)
        xq = quantize_activation(x, Precision.NVFP4)
        want = inference.linear(rac_folded(xq, rac_residual(x, xq, 0.25, group)),
                                LinearWeight.dense(folded.values), use_kernels=False)
        torch.testing.assert_close(folded(x.to(DEV), use_kernels=False).cpu(), want, atol=1e-5, rtol=1e-5)
    cfg, model = _model(True, seed=1)
    engine = _engine(cfg, model, "nvfp4", 0.25, device="cpu", rac_group=16, rac_fold=True)
    assert engine.weights.layers[0].experts.rac_fold and engine.weights.layers[0].qkv_proj.rac_fold
    sequences, together = _sampled_row_is_its_own(engine)
    # in bfloat16 the fold rounds the compensated activation, so its scores are not the
    # second operand's (in float32 the two sums agree to a last place)
    bf16 = [_engine(cfg, model, "nvfp4", 0.25, device="cpu", rac_group=16, rac_fold=fold,
                    dtype=torch.bfloat16).score(sequences[:1])[0] for fold in (False, True)]
    assert not torch.equal(*bf16)
    torch.testing.assert_close(bf16[0], bf16[1], atol=0.01, rtol=0)
    with pytest.raises(ValueError, match="rac_fold adds RAC's residual"):
        RolloutEngine(cfg, "nvfp4", 0.0, rac_fold=True)


@pytest.mark.parametrize("moe", [False, True])
@pytest.mark.parametrize("precision,rac", MODES)
def test_a_row_alone_equals_the_row_in_a_batch_and_decode_equals_a_rescore(precision, rac, moe):
    # on the plain-PyTorch path (the definition): float32, so differences are accumulation order
    cfg, model = _model(moe, seed=1)
    engine = _engine(cfg, model, precision, rac, device="cpu")
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=2)
    batch = engine.generate(PROMPTS, params)
    sequences = [p + c for p, c in zip(PROMPTS, batch.completion_lists())]
    alone = engine.score(sequences[1:2])[0]
    together = engine.score(sequences)
    torch.testing.assert_close(alone, together[1], atol=2e-5, rtol=0)
    for b, prompt in enumerate(PROMPTS):   # decode with the KV cache against the full forward
        torch.testing.assert_close(together[b][len(prompt) - 1:], batch.logprobs[b], atol=2e-5, rtol=0)


@pytest.mark.parametrize("moe", [False, True])
@pytest.mark.parametrize("precision,rac,kernels", [("bf16", 0.0, False), ("nvfp4", 0.25, False),
                                                   ("bf16", 0.0, True)])
def test_repeated_prompts_are_prefilled_once_with_the_same_rollout(precision, rac, kernels, moe, monkeypatch):
    # GRPO's num_generations copies of a prompt: one prefill row each distinct prompt, in the
    # first row that samples it, whose columns the repeats read in decode (their own prompt
    # columns hold another prompt's here), the MoE routing record copied to them; the same
    # log-probs as prefilling every row up to accumulation order (here the same tokens and
    # routing, and, at this size, equal bits), and decode still equals a re-score; on the
    # PyTorch reference and on the decode kernels
    cfg, model = _model(moe, seed=6)
    # the kernels on DEV (the GPU where there is one, else the interpreter), in float32
    engine = (_engine(cfg, model, precision, rac, decode_kernels=True, dtype=torch.float32) if kernels
              else _engine(cfg, model, precision, rac, device="cpu"))
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[0], PROMPTS[2], PROMPTS[1]]
    params = SamplingParams(temperature=1.0, max_new_tokens=5, seed=3)
    rows = []
    real = engine.decoder.prefill
    monkeypatch.setattr(engine.decoder, "prefill", lambda t, n, **k: rows.append(t.shape[0]) or real(t, n, **k))
    deduplicated = engine.generate(prompts, params)
    monkeypatch.setattr(engine, "_prefill_distinct", lambda p, t, n: real(t, n))
    every_row = engine.generate(prompts, params)
    assert rows == [3]
    assert torch.equal(deduplicated.completions, every_row.completions)
    torch.testing.assert_close(deduplicated.logprobs, every_row.logprobs, atol=2e-5, rtol=0)
    if moe:
        assert torch.equal(deduplicated.routed_experts, every_row.routed_experts)
        assert (deduplicated.routed_experts[:, :4] >= 0).all()   # the prompts' positions
    sequences = [p + c for p, c in zip(prompts, deduplicated.completion_lists())]
    for b, (prompt, scored) in enumerate(zip(prompts, engine.score(sequences))):
        torch.testing.assert_close(scored[len(prompt) - 1:], deduplicated.logprobs[b], atol=2e-5, rtol=0)


@pytest.mark.parametrize("precision,rac", [("bf16", 0.0), ("nvfp4", 0.25), ("nvfp4+static", 0.25)])
def test_a_weight_sync_lands_in_place_and_equals_a_fresh_engine(precision, rac):
    cfg, model = _model(True, seed=4)
    engine = _engine(cfg, model, precision, rac, device="cpu")
    held = engine.weights.layers[0].experts.gate_up.data
    engine.score([[1, 2, 3]])                               # keeps the dequantized reference values
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    amax = engine.weights.layers[0].experts.gate_up_amax
    static = precision.endswith("+static")
    engine.load_state_dict(model.state_dict(), input_amax=calibrate_input_amax(
        model, [torch.tensor(PROMPTS[1:2])]) if static else None)
    assert engine.weights.layers[0].experts.gate_up.data is held     # the same tensors
    assert engine.weights.layers[0].experts.gate_up_amax is amax     # recalibrated in place
    fresh = _engine(cfg, model, precision, rac, device="cpu")
    assert torch.equal(engine.score([[1, 2, 3, 4]])[0], fresh.score([[1, 2, 3, 4]])[0])


@pytest.mark.gpu
def test_cuda_graphs_survive_a_weight_sync():
    cfg, model = _model(False, seed=5)
    engine = _engine(cfg, model, "nvfp4", 0.25)
    params = SamplingParams(max_new_tokens=8, seed=1)
    engine.generate(PROMPTS, params)
    graphs = dict(engine._graphs)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    engine.load_state_dict(model.state_dict())
    assert engine._graphs == graphs                          # kept: the weights changed in place
    fresh = _engine(cfg, model, "nvfp4", 0.25)
    a, b = engine.generate(PROMPTS, params), fresh.generate(PROMPTS, params)
    assert torch.equal(a.completions, b.completions) and torch.equal(a.logprobs, b.logprobs)


def test_batch_buckets():
    assert [batch_bucket(b, 256) for b in (1, 2, 3, 5, 8, 9, 16, 17, 100, 256)] == \
        [1, 2, 4, 8, 8, 16, 16, 32, 112, 256]
    assert batch_bucket(100, 100) == 100                 # never above max_batch_size


@pytest.mark.gpu
@pytest.mark.parametrize("moe", [False, True])
@pytest.mark.parametrize("precision,rac", MODES)
def test_cuda_graph_decode_equals_eager_decode_on_the_kernels(precision, rac, moe):
    cfg, model = _model(moe, seed=3)
    graphed = _engine(cfg, model, precision, rac)
    eager = _engine(cfg, model, precision, rac, cuda_graph=False)
    assert graphed.decode_kernels and graphed.cuda_graph
    params = SamplingParams(max_new_tokens=12, seed=3)
    for prompts in (PROMPTS, PROMPTS[:3]):                # bucket 4, the last row padding
        a, b = graphed.generate(prompts, params), eager.generate(prompts, params)
        assert graphed.graph_note is None
        assert torch.equal(a.completions, b.completions)
        assert torch.equal(a.logprobs, b.logprobs)         # the same kernels, replayed
    again = graphed.generate(PROMPTS, params)             # a refilled cache, the same graph
    assert torch.equal(again.completions, graphed.generate(PROMPTS, params).completions)


@pytest.mark.parametrize("precision,rac,packed", [("bf16", 0.0, False), ("nvfp4", 0.25, True)])
def test_a_compiled_step_on_the_kernels_decodes_what_the_eager_step_decodes(precision, rac, packed):
    # compile_decode on the kernels: each kernel call one operator of the compiled graph
    # (lowbit.kernels.engine_ops), Inductor fusing what lies between; float32 (on the GPU too),
    # so the two differ by accumulation order at most and greedy decoding picks the same tokens
    cfg, model = _model(False)
    compiled = _engine(cfg, model, precision, rac, compile_decode=True, dtype=torch.float32,
                       decode_kernels=True, packed_gemm=packed)
    # the eager step in CUDA graphs where the compiled one has them (the engine's default)
    b = kernel_rollout(precision, rac, packed, False, cuda_graph=compiled.cuda_graph)
    a = compiled.generate(KERNEL_PROMPTS, GREEDY)
    assert compiled.compile_decode and compiled.graph_note is None    # compiled, not fallen back
    assert torch.equal(a.completions, b.completions)
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("precision,rac,packed", [("bf16", 0.0, False), ("nvfp4", 0.25, True)])
def test_a_compiled_step_on_the_kernels_keeps_a_row_its_own(precision, rac, packed):
    # in CUDA graphs, float32: the compiled step against the eager one, sampled; and a row alone
    # (batch bucket 1: the one-row GEMMs) against the row in a batch of four (the tiled GEMMs
    # and, for bf16, cuBLAS), greedy
    cfg, model = _model(False, seed=3)
    kw = dict(dtype=torch.float32, packed_gemm=packed)
    compiled = _engine(cfg, model, precision, rac, compile_decode=True, **kw)
    eager = _engine(cfg, model, precision, rac, **kw)
    params = SamplingParams(max_new_tokens=12, seed=3)
    a, b = compiled.generate(PROMPTS, params), eager.generate(PROMPTS, params)
    assert compiled.decode_kernels and compiled.cuda_graph
    assert compiled.compile_decode and compiled.graph_note is None
    assert torch.equal(a.completions, b.completions)
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=0)
    greedy = SamplingParams(temperature=0, max_new_tokens=12)
    batch, alone = compiled.generate(PROMPTS, greedy), compiled.generate(PROMPTS[1:2], greedy)
    assert compiled.graph_note is None and {1, 4} <= set(compiled._graphs)
    assert torch.equal(alone.completions[0], batch.completions[1][:alone.completions.shape[1]])
    torch.testing.assert_close(alone.logprobs[0], batch.logprobs[1][:alone.logprobs.shape[1]],
                               atol=1e-4, rtol=0)


@pytest.mark.gpu
def test_engine_decode_with_pdl_equals_without():
    cfg, model = _model(False)
    engines = []
    for pdl in (True, False):
        engine = _engine(cfg, model, "nvfp4-w4a16", 0.0, packed_gemm=True)
        engine.decode_pdl = engine.decoder.pdl = pdl and engine.decode_pdl
        engines.append(engine)
    params = SamplingParams(max_new_tokens=12, seed=3)
    for prompts in ([[1, 2, 3, 4, 5]], PROMPTS):
        a, b = (e.generate(prompts, params) for e in engines)
        assert torch.equal(a.completions, b.completions) and torch.equal(a.logprobs, b.logprobs)


def test_engine_refuses_kernels_where_they_do_not_apply():
    cfg = ModelConfig(vocab_size=64, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=16)
    both = RolloutEngine(cfg, decode_kernels=True, compile_decode=True, device=DEV)
    assert both.decode_kernels and both.compile_decode        # a compiled step on the kernels
    with pytest.raises(ValueError, match="compile_decode needs a dense model"):
        RolloutEngine(_model(True)[0], decode_kernels=True, compile_decode=True, device=DEV)
