"""lowbit.kernels.decode (the rollout engine's fused decode kernels) against plain PyTorch: the
GEMV with its RMSNorm / SiLU·up prologues and bias / residual epilogues, and the decode attention
with its q/k norm, RoPE and cache write. Runs the kernels on the GPU where there is one, else in
Triton's interpreter on the CPU."""

import math

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from lowbit.kernels import decode as kd  # noqa: E402
from lowbit.models import ModelConfig, build_model  # noqa: E402
from lowbit.rl.engine import RolloutEngine  # noqa: E402
from lowbit.rl.sampling import SamplingParams  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# float32 agrees to accumulation order; bf16 / fp16 to a rounding or two of the output (and the
# interpreter rounds float32 -> bfloat16 by truncation)
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
       torch.float16: dict(atol=4e-3, rtol=4e-3)}


def _reference_linear(x, w, bias=None, norm=None, eps=1e-6, silu_mul=False, residual=None):
    """The engine's eager decoder, step by step: each op rounds to x's dtype."""
    if norm is not None:
        x = norm * F.rms_norm(x, (x.shape[-1],), eps=eps)
    if silu_mul:
        gate, up = x.chunk(2, dim=-1)
        x = F.silu(gate) * up
    y = F.linear(x.float(), w.float()).to(x.dtype)
    if bias is not None:
        y = y + bias
    return y if residual is None else residual + y


def _operands(M, N, K, dtype, seed, silu_mul=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, 2 * K if silu_mul else K, generator=g)
    return (x.to(DEV, dtype), (torch.randn(N, K, generator=g) / math.sqrt(K)).to(DEV, dtype),
            torch.randn(N, generator=g).to(DEV, dtype), (1 + 0.1 * torch.randn(K, generator=g)).to(DEV, dtype),
            torch.randn(M, N, generator=g).to(DEV, dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("prologue", ["none", "norm", "silu_mul"])
@pytest.mark.parametrize("M,use_dot", [(1, False), (1, True), (3, True), (16, True)])
def test_linear_matches_the_eager_ops(dtype, prologue, M, use_dot):
    # N and K are not multiples of any tile: the last tile of each is masked
    N, K = 37, 70
    x, w, bias, norm, res = _operands(M, N, K, dtype, seed=M, silu_mul=prologue == "silu_mul")
    kw = dict(norm=norm if prologue == "norm" else None, silu_mul=prologue == "silu_mul", eps=1e-5)
    tile = {"BLOCK_N": 16, "BLOCK_K": 32, "USE_DOT": use_dot}
    for b, r in ((None, None), (bias, None), (bias, res), (None, res)):
        got = kd.linear(x, w, b, residual=r, tile=tile, **kw)
        assert got.dtype == dtype and got.shape == (M, N)
        torch.testing.assert_close(got, _reference_linear(x, w, b, residual=r, **kw), **TOL[dtype])


def test_linear_edge_rows_and_layouts():
    # an all-zero row, a NaN, an Inf, huge and tiny rows; x and the weight as strided views
    N, K = 24, 40
    g = torch.Generator().manual_seed(5)
    wide = torch.randn(6, 2 * K, generator=g).to(DEV)
    x = wide[:, ::2]                                        # non-contiguous rows
    x[0] = 0.0
    x[1, 3] = float("nan")
    x[2, 7] = float("inf")
    x[3] *= 1e30
    x[4] *= 1e-30
    w = torch.randn(K, N, generator=g).to(DEV).t()          # a transposed weight
    out = kd.linear(x, w)
    ref = _reference_linear(x, w)
    assert torch.equal(out[0], torch.zeros(N, device=DEV))
    assert out[1].isnan().all() and out[2].isinf().any() and not out[2].isnan().all()
    # the huge and the tiny row, scaled back: sums in another order, cancelling at the edges
    torch.testing.assert_close(out[3] * 1e-30, ref[3] * 1e-30, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[4] * 1e30, ref[4] * 1e30, atol=1e-4, rtol=1e-4)
    normed = kd.linear(x, w, norm=torch.ones(K, device=DEV))
    torch.testing.assert_close(normed, _reference_linear(x, w, norm=torch.ones(K, device=DEV)),
                               atol=1e-5, rtol=1e-5, equal_nan=True)
    assert torch.equal(normed[0], torch.zeros(N, device=DEV))   # zero row: norm 0, output 0
    assert normed[1].isnan().all()                              # NaN is never made finite


def test_linear_refuses_what_it_cannot_do():
    x, w, *_ = _operands(2, 8, 16, torch.float32, seed=0)
    with pytest.raises(ValueError, match="1..16 rows"):
        kd.linear(torch.zeros(17, 16, device=DEV), w)
    with pytest.raises(ValueError, match="2K columns"):
        kd.linear(x, w, silu_mul=True)
    with pytest.raises(ValueError, match="one prologue"):
        kd.linear(x, w, norm=torch.ones(16, device=DEV), silu_mul=True)
    with pytest.raises(ValueError, match="dtype"):
        kd.linear(x, w.double())


def _rope_tables(L, D):
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    emb = torch.cat([torch.outer(torch.arange(L).float(), inv)] * 2, -1)
    sign = torch.cat([-torch.ones(D // 2), torch.ones(D // 2)])
    return emb.cos(), emb.sin() * sign


def _reference_attention(qkv, k_cache, v_cache, valid, positions, col, cos, sin, H, KV, qk_norm, eps):
    """Norm, rotate, write the column, attend over the valid columns up to it (plain torch, in
    float32, with the engine's roundings of q and k)."""
    B, D = qkv.shape[0], k_cache.shape[-1]
    dt = qkv.dtype
    heads = qkv.view(B, H + 2 * KV, D)
    qk = heads[:, :H + KV]
    if qk_norm is not None:
        qk = qk_norm * F.rms_norm(qk, (D,), eps=eps)
    c, s = cos[positions][:, None].float(), sin[positions][:, None].float()
    qk = (qk.float() * c + torch.cat([qk[..., D // 2:], qk[..., :D // 2]], -1).float() * s).to(dt)
    q, k, v = qk[:, :H], qk[:, H:], heads[:, H + KV:]
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    k_cache[:B, :, col] = k
    v_cache[:B, :, col] = v
    visible = valid[:B, :col + 1].clone()
    visible[:, col] = True
    keys = k_cache[:B, :, :col + 1].float().repeat_interleave(H // KV, 1)        # (B, H, T, D)
    values = v_cache[:B, :, :col + 1].float().repeat_interleave(H // KV, 1)
    scores = torch.einsum("bhd,bhtd->bht", q.float(), keys) / math.sqrt(D)
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    out = torch.einsum("bht,bhtd->bhd", scores.softmax(-1), values)
    return out.reshape(B, H * D).to(dt), k_cache, v_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("H,KV,D,qk_norm,col", [(4, 2, 16, True, 70), (6, 6, 24, False, 0),
                                                (4, 1, 8, False, 5)])
def test_attention_matches_the_reference(dtype, H, KV, D, qk_norm, col):
    B, Bmax, L = 3, 5, 80                                  # the caches hold more rows than B
    g = torch.Generator().manual_seed(col + D)
    qkv = torch.randn(B, (H + 2 * KV) * D, generator=g).to(DEV, dtype)
    k_cache = torch.randn(Bmax, KV, L, D, generator=g).to(DEV, dtype)
    v_cache = torch.randn(Bmax, KV, L, D, generator=g).to(DEV, dtype)
    valid = torch.rand(Bmax, L + 16, generator=g) < 0.7    # padding columns are masked out
    valid[:, col:] = False
    valid = valid.to(DEV)
    positions = torch.tensor([col, max(col - 3, 0), max(col - 1, 0)], device=DEV)
    cos, sin = (t.to(DEV, dtype) for t in _rope_tables(L, D))
    norm = (1 + 0.2 * torch.randn(H + KV, D, generator=g)).to(DEV, dtype) if qk_norm else None
    ref, k_ref, v_ref = _reference_attention(qkv, k_cache, v_cache, valid, positions, col, cos, sin,
                                             H, KV, norm, 1e-6)
    col_t = torch.tensor([col], device=DEV)
    out = kd.attention(qkv, k_cache, v_cache, valid, positions, col_t, cos, sin, H, KV, norm, 1e-6)
    torch.testing.assert_close(out, ref, **TOL[dtype])
    torch.testing.assert_close(k_cache, k_ref, **TOL[dtype])   # the new column, rotated
    assert torch.equal(v_cache, v_ref)                          # the rest untouched


def test_attention_propagates_nan_and_refuses_bad_shapes():
    H, KV, D, L = 2, 1, 8, 16
    qkv = torch.randn(1, (H + 2 * KV) * D, device=DEV)
    qkv[0, 0] = float("nan")                               # head 0's query
    caches = [torch.zeros(1, KV, L, D, device=DEV) for _ in range(2)]
    valid = torch.ones(1, L, dtype=torch.bool, device=DEV)
    cos, sin = (t.to(DEV) for t in _rope_tables(L, D))
    args = (caches[0], caches[1], valid, torch.tensor([4], device=DEV), torch.tensor([4], device=DEV), cos, sin)
    out = kd.attention(qkv, *args, H, KV)
    assert out[0, :D].isnan().all() and not out[0, D:].isnan().any()
    with pytest.raises(ValueError, match="expected"):
        kd.attention(qkv[:, :-1], *args, H, KV)


def _engines(precision="bf16", **cfg_kw):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=48, **cfg_kw)
    model = build_model(cfg).eval()
    fused = RolloutEngine(cfg, precision, max_batch_size=8, device=DEV, decode_kernels=True, cuda_graph=False)
    plain = RolloutEngine(cfg, precision, max_batch_size=8, device=DEV, decode_kernels=False, cuda_graph=False)
    for e in (fused, plain):
        e.load_state_dict(model.state_dict())
    return cfg, model, fused, plain


@pytest.mark.parametrize("precision,cfg_kw", [("bf16", dict(qk_norm=True)),
                                              ("bf16", dict(qkv_bias=True, tie_embeddings=True)),
                                              ("nvfp4-w4a16", dict())])
def test_engine_decode_on_the_kernels_equals_the_eager_decoder(precision, cfg_kw):
    # nvfp4-w4a16: the kernels multiply the dequantized NVFP4 weights, as the eager GEMMs do
    cfg, _, fused, plain = _engines(precision, **cfg_kw)
    prompts = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11]]
    # three decode steps on a growing cache (the interpreter runs each launch slowly)
    params = SamplingParams(temperature=0.9, max_new_tokens=4, seed=4)
    a, b = fused.generate(prompts, params), plain.generate(prompts, params)
    assert torch.equal(a.completions, b.completions)
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-2 if DEV == "cuda" else 2e-5, rtol=0)


def test_engine_refuses_decode_kernels_where_they_do_not_apply():
    cfg = ModelConfig(vocab_size=64, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=16)
    with pytest.raises(ValueError, match="bf16 or nvfp4-w4a16"):
        RolloutEngine(cfg, precision="nvfp4", decode_kernels=True, device=DEV)
    moe = ModelConfig(vocab_size=64, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=16,
                      n_experts=4)
    with pytest.raises(ValueError, match="dense model"):
        RolloutEngine(moe, decode_kernels=True, device=DEV)


@pytest.mark.gpu
def test_cuda_graph_decode_on_the_kernels_equals_eager_decode():
    cfg, model, _, plain = _engines(qk_norm=True)
    default = RolloutEngine(cfg, max_batch_size=8, device="cuda")      # kernels at batch 1 only
    assert default.uses_decode_kernels(1) and not default.uses_decode_kernels(2)
    graphed = RolloutEngine(cfg, max_batch_size=8, device="cuda", decode_kernels=True)
    graphed.load_state_dict(model.state_dict())
    assert graphed.uses_decode_kernels(4) and graphed.cuda_graph
    params = SamplingParams(max_new_tokens=12, seed=3)
    prompts = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11], [3]]
    a, b = graphed.generate(prompts, params), plain.generate(prompts, params)
    assert graphed.graph_note is None and 4 in graphed._graphs
    assert torch.equal(a.completions, b.completions)
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-2, rtol=0)
    assert torch.equal(graphed.generate(prompts, params).completions, a.completions)


def test_pdl_applies_only_to_compiled_kernels_on_hopper():
    assert not kd.pdl_supported("cpu")
    x, w, bias, norm, res = _operands(1, 37, 70, torch.float32, seed=5)
    tile = {"BLOCK_N": 16, "BLOCK_K": 32, "USE_DOT": False}
    # where it does not apply, pdl=True is a launch hint that changes nothing
    if not kd.pdl_supported(DEV):
        assert torch.equal(kd.linear(x, w, bias, norm=norm, residual=res, tile=tile, pdl=True),
                           kd.linear(x, w, bias, norm=norm, residual=res, tile=tile))


@pytest.mark.gpu
def test_pdl_chains_equal_plain_launches_in_a_cuda_graph():
    """A layer's chain of kernels (each reading what the one before wrote) launched with
    programmatic dependent launch, eagerly and replayed from a CUDA graph, gives the same bits
    as plain launches: no kernel reads its input before the one that writes it has finished."""
    # (before Hopper, pdl=True launches plainly and this compares plain launches)
    dtype, C, F_, M = torch.bfloat16, 2048, 5632, 1   # PDL applies to the one-row tile
    g = torch.Generator().manual_seed(M)
    w = {n: (torch.randn(*s, generator=g) / math.sqrt(s[1])).to("cuda", dtype)
         for n, s in {"qkv": (C, C), "o": (C, C), "gu": (2 * F_, C), "down": (C, F_)}.items()}
    ln = (1 + 0.1 * torch.randn(C, generator=g)).to("cuda", dtype)
    x0 = torch.randn(M, C, generator=g).to("cuda", dtype)

    def chain(pdl):
        x = x0
        for _ in range(4):
            y = kd.linear(x, w["qkv"], norm=ln, pdl=pdl)
            x = kd.linear(y, w["o"], residual=x, pdl=pdl)
            gu = kd.linear(x, w["gu"], norm=ln, pdl=pdl)
            x = kd.linear(gu, w["down"], silu_mul=True, residual=x, pdl=pdl)
        return x

    expected = chain(False)
    assert torch.equal(chain(True), expected)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain(True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(True)
    for _ in range(20):
        graph.replay()
        assert torch.equal(out, expected)


@pytest.mark.gpu
def test_engine_decode_with_pdl_equals_without():
    cfg, model, _, _ = _engines(qk_norm=True)
    engines = []
    for pdl in (True, False):
        engine = RolloutEngine(cfg, max_batch_size=8, device="cuda", decode_kernels=True)
        engine.load_state_dict(model.state_dict())
        assert engine.decode_pdl == kd.pdl_supported("cuda")
        engine.decode_pdl = pdl and engine.decode_pdl
        engines.append(engine)
    params = SamplingParams(max_new_tokens=12, seed=3)
    for prompts in ([[1, 2, 3, 4, 5]], [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11], [3]]):
        a, b = (e.generate(prompts, params) for e in engines)
        assert torch.equal(a.completions, b.completions) and torch.equal(a.logprobs, b.logprobs)
