"""lowbit.kernels.decode_attention (decode attention over each row's own cache length, split
and combined as in flash-decoding) against plain PyTorch: q/k norm, RoPE at each row's position,
the cache write, attention over columns 0..p_b. Runs the kernels on the GPU where there is one,
else in Triton's interpreter on the CPU."""

import math

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from lowbit.kernels import decode_attention as da  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# float32 agrees to accumulation order; bf16 / fp16 to a rounding or two of the output (and the
# interpreter rounds float32 -> bfloat16 by truncation)
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
       torch.float16: dict(atol=4e-3, rtol=4e-3)}
L = 80
POSITIONS = [0, 5, 27, 54, 79]   # empty, short, on the chunk edges of 3 splits (27 columns), full


def _rope_tables(n, D):
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    emb = torch.cat([torch.outer(torch.arange(n).float(), inv)] * 2, -1)
    sign = torch.cat([-torch.ones(D // 2), torch.ones(D // 2)])
    return emb.cos(), emb.sin() * sign


def _reference(qkv, k_cache, v_cache, positions, cos, sin, H, KV, qk_norm, eps=1e-6):
    """Norm, rotate, write column p_b, attend over columns 0..p_b, row by row (plain torch, the
    softmax in float32, with the engine's roundings of q and k)."""
    B, D = qkv.shape[0], k_cache.shape[-1]
    dt = qkv.dtype
    heads = qkv.view(B, H + 2 * KV, D)
    qk = heads[:, :H + KV]
    if qk_norm is not None:
        qk = qk_norm * F.rms_norm(qk, (D,), eps=eps)
    c, s = cos[positions][:, None].float(), sin[positions][:, None].float()
    rolled = torch.cat([qk[..., D // 2:], qk[..., :D // 2]], -1)
    qk = ((qk.float() * c).to(dt).float() + (rolled.float() * s).to(dt).float()).to(dt)   # as in dt
    q, k, v = qk[:, :H], qk[:, H:], heads[:, H + KV:]
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    out = torch.empty(B, H, D, dtype=dt, device=qkv.device)
    for b, p in enumerate(positions.tolist()):
        k_cache[b, :, p], v_cache[b, :, p] = k[b], v[b]
        keys = k_cache[b, :, :p + 1].float().repeat_interleave(H // KV, 0)       # (H, p + 1, D)
        values = v_cache[b, :, :p + 1].float().repeat_interleave(H // KV, 0)
        scores = torch.einsum("hd,htd->ht", q[b].float(), keys) / math.sqrt(D)
        out[b] = torch.einsum("ht,htd->hd", scores.softmax(-1), values).to(dt)
    return out.reshape(B, H * D), k_cache, v_cache


def _operands(H, KV, D, dtype, seed, positions=POSITIONS, qk_norm=False, rows=1):
    """q|k|v for len(positions) rows; caches with `rows` rows more than the batch."""
    g = torch.Generator().manual_seed(seed)
    B = len(positions)
    qkv = torch.randn(B, (H + 2 * KV) * D, generator=g).to(DEV, dtype)
    k_cache = torch.randn(B + rows, KV, L, D, generator=g).to(DEV, dtype)
    v_cache = torch.randn(B + rows, KV, L, D, generator=g).to(DEV, dtype)
    cos, sin = (t.to(DEV, dtype) for t in _rope_tables(L, D))
    norm = (1 + 0.2 * torch.randn(H + KV, D, generator=g)).to(DEV, dtype) if qk_norm else None
    return qkv, k_cache, v_cache, torch.tensor(positions, device=DEV), cos, sin, norm


def _written(k_cache, positions):
    """The cache entries the step writes: column p_b of row b, every kv head."""
    mask = torch.zeros(k_cache.shape[:3], dtype=torch.bool, device=k_cache.device)
    for b, p in enumerate(positions.tolist()):
        mask[b, :, p] = True
    return mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("H,KV,D,qk_norm", [(2, 2, 16, True), (4, 2, 24, False), (8, 2, 16, True)])
def test_decode_attention_matches_the_reference(dtype, H, KV, D, qk_norm):
    # G = 1, 2, 4 query heads per kv head; D = 24 pads to a 32-wide tile
    qkv, k_cache, v_cache, positions, cos, sin, norm = _operands(H, KV, D, dtype, seed=H + D,
                                                                 qk_norm=qk_norm)
    ref, k_ref, v_ref = _reference(qkv, k_cache, v_cache, positions, cos, sin, H, KV, norm)
    written = _written(k_cache, positions)
    outs = []
    for splits in (1, 3):
        k, v = k_cache.clone(), v_cache.clone()
        out = da.decode_attention(qkv, k, v, positions, cos, sin, H, KV, norm, splits=splits)
        assert out.dtype == dtype and out.shape == (len(POSITIONS), H * D)
        torch.testing.assert_close(out, ref, **TOL[dtype])
        assert torch.equal(v, v_ref)                       # column p_b written, the rest untouched
        assert torch.equal(k[~written], k_cache[~written])
        # the rotated k to rounding: the interpreter truncates to bf16, the norm sums its
        # squares in another order; at
        # position 0 (cos 1, sin 0) it is the new k itself, bit for bit
        torch.testing.assert_close(k[written], k_ref[written], **TOL[dtype])
        if not qk_norm:
            assert torch.equal(k[0, :, 0], qkv[0].view(H + 2 * KV, D)[H:H + KV])
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], **TOL[dtype])


def test_many_short_chunks_merge_as_one():
    # 20 chunks of 4 columns: shorter than a tile, most of them empty, merged 16 at a time
    H, KV, D = 4, 2, 16
    qkv, k_cache, v_cache, positions, cos, sin, norm = _operands(H, KV, D, torch.float32, seed=11,
                                                                 qk_norm=True)
    ref = _reference(qkv, k_cache, v_cache, positions, cos, sin, H, KV, norm)[0]
    out = da.decode_attention(qkv, k_cache, v_cache, positions, cos, sin, H, KV, norm, splits=20)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


@pytest.mark.parametrize("splits", [1, 3])
def test_a_row_alone_equals_the_row_in_a_batch(splits):
    H, KV, D, dtype = 4, 2, 16, torch.bfloat16
    qkv, k_cache, v_cache, positions, cos, sin, norm = _operands(H, KV, D, dtype, seed=7,
                                                                 positions=[3, 79, 40, 0], qk_norm=True)
    positions = positions.int()
    k, v = k_cache.clone(), v_cache.clone()
    batch = da.decode_attention(qkv, k, v, positions, cos, sin, H, KV, norm, splits=splits)
    for b in range(len(positions)):
        k_one, v_one = k_cache[b:b + 1].clone(), v_cache[b:b + 1].clone()
        one = da.decode_attention(qkv[b:b + 1], k_one, v_one, positions[b:b + 1], cos, sin, H, KV,
                                  norm, splits=splits)
        assert torch.equal(one[0], batch[b])
        assert torch.equal(k_one[0], k[b]) and torch.equal(v_one[0], v[b])
    assert torch.equal(k[-1], k_cache[-1]) and torch.equal(v[-1], v_cache[-1])   # the spare row


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_shared_prompt_read_from_its_row_equals_the_prompt_copied_into_every_row(splits, dtype):
    # GRPO's completions of one prompt: rows 1 and 2 read the prompt's 30 columns from row 0
    # (their own prompt columns hold other data, which must not be read), row 3 its own 12
    # from row 4, row 4 itself; prefixes across chunk edges (3 splits of 27 columns), a row
    # at the prefix's end; the same bits as the prompt copied into each row, and each row
    # writes only its own row; both index dtypes; the PyTorch reference the same
    from lowbit.dispatch import inference
    H, KV, D = 4, 2, 16
    qkv, k_cache, v_cache, positions, cos, sin, norm = _operands(H, KV, D, dtype, seed=21, qk_norm=True,
                                                                 positions=[30, 45, 79, 12, 60])
    rows = torch.tensor([0, 0, 0, 4, 4], device=DEV)
    lens = torch.tensor([30, 30, 30, 12, 12], device=DEV)
    copied_k, copied_v = k_cache.clone(), v_cache.clone()
    for b, (r, n) in enumerate(zip(rows.tolist(), lens.tolist())):
        copied_k[b, :, :n], copied_v[b, :, :n] = k_cache[r, :, :n], v_cache[r, :, :n]
    want = da.decode_attention(qkv, copied_k, copied_v, positions, cos, sin, H, KV, norm, splits=splits)
    for index in (torch.int64, torch.int32):
        k, v = k_cache.clone(), v_cache.clone()
        got = da.decode_attention(qkv, k, v, positions, cos, sin, H, KV, norm, splits=splits,
                                  prefix_rows=rows.to(index), prefix_lens=lens.to(index))
        assert torch.equal(got, want)
        written = _written(k_cache, positions)
        assert torch.equal(k[written], copied_k[written]) and torch.equal(k[~written], k_cache[~written])
        assert torch.equal(v[~written], v_cache[~written])
    k, v = k_cache.clone(), v_cache.clone()
    ref = inference.decode_attention(qkv, k, v, positions, cos, sin, H, KV, norm, use_kernels=False,
                                     prefix_rows=rows, prefix_lens=lens)
    k, v = copied_k.clone(), copied_v.clone()
    ref_copied = inference.decode_attention(qkv, k, v, positions, cos, sin, H, KV, norm, use_kernels=False)
    assert torch.equal(ref, ref_copied)
    torch.testing.assert_close(ref, want, **TOL[dtype])
    with pytest.raises(ValueError, match="both or neither"):
        da.decode_attention(qkv, k_cache.clone(), v_cache.clone(), positions, cos, sin, H, KV, norm,
                            prefix_rows=rows)
    with pytest.raises(ValueError, match=r"expected \(5,\) int32 or int64"):
        da.decode_attention(qkv, k_cache.clone(), v_cache.clone(), positions, cos, sin, H, KV, norm,
                            prefix_rows=rows.float(), prefix_lens=lens)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")   # numpy's, under the interpreter
@pytest.mark.parametrize("splits", [1, 3])
def test_nan_stays_in_its_head_and_row(splits):
    H, KV, D = 4, 2, 16                                    # heads 0, 1 read kv head 0
    qkv, k_cache, v_cache, positions, cos, sin, _ = _operands(H, KV, D, torch.float32, seed=3,
                                                              positions=[0, 30, 60, 10])
    qkv[0, 1 * D + 2] = float("nan")                       # row 0 (position 0), head 1's query
    qkv[1, 2 * D + 5] = float("nan")                       # row 1, head 2's query
    k_cache[2, 0, 7, 3] = float("nan")                     # row 2, kv head 0, a written column
    v_cache[3, 1, 50, 0] = float("nan")                    # row 3, a column past its position
    k_cache[3, 0, 11:, :] = float("nan")                   # ... and every column past it
    out = da.decode_attention(qkv, k_cache, v_cache, positions, cos, sin, H, KV,
                              splits=splits).view(4, H, D)
    nan = torch.zeros(4, H, dtype=torch.bool, device=DEV)
    nan[0, 1] = nan[1, 2] = nan[2, 0] = nan[2, 1] = True
    assert torch.equal(out.isnan().all(-1), nan) and torch.equal(out.isnan().any(-1), nan)


def test_default_splits_and_pdl_off_the_gpu():
    assert da.default_splits(1, 1, 1 << 15, "cpu") == 1
    qkv, k_cache, v_cache, positions, cos, sin, _ = _operands(4, 2, 16, torch.float32, seed=1,
                                                              positions=[9, 2])
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    # where it does not apply, pdl=True is a launch hint that changes nothing
    a, b = (da.decode_attention(qkv, k, v, positions, cos, sin, 4, 2, pdl=pdl)
            for (k, v), pdl in zip(caches, (False, True)))
    assert torch.equal(a, b) and torch.equal(caches[0][0], caches[1][0])


def test_decode_attention_refuses_bad_input():
    H, KV, D = 4, 2, 16
    qkv, k_cache, v_cache, positions, cos, sin, _ = _operands(H, KV, D, torch.float32, seed=2,
                                                              positions=[1, 2])
    args = (k_cache, v_cache, positions, cos, sin)
    strided = torch.zeros(3, KV, D, L, device=DEV).transpose(2, 3)   # (3, KV, L, D), D not unit
    bad = [((qkv[:, :-1], *args, H, KV), {}, "expected \\(B, \\(H \\+ 2 KV\\) \\* D\\)"),
           ((qkv, *args, 3, KV), {}, "H a multiple of KV"),
           ((qkv.double(), *args, H, KV), {}, "float32, bfloat16 or float16"),
           ((qkv, k_cache.half(), v_cache.half(), *args[2:], H, KV), {}, "qkv's dtype"),
           ((qkv, k_cache, v_cache[:, :1], *args[2:], H, KV), {}, "expected both"),
           ((qkv, k_cache[..., :15], v_cache[..., :15], *args[2:], H, KV), {}, "expected"),
           ((qkv, strided, strided, *args[2:], H, KV), {}, "unit stride"),
           ((qkv, k_cache, v_cache, positions[:1], cos, sin, H, KV), {}, "positions"),
           ((qkv, k_cache, v_cache, positions.float(), cos, sin, H, KV), {}, "int32 or int64"),
           ((qkv, k_cache, v_cache, positions, cos[:, :8], sin, H, KV), {}, "max_pos"),
           ((qkv, *args, H, KV, torch.ones(H, D, device=DEV)), {}, "qk_norm"),
           ((qkv, *args, H, KV), {"splits": 0}, "positive int")]
    for a, kw, match in bad:
        with pytest.raises(ValueError, match=match):
            da.decode_attention(*a, **kw)


@pytest.mark.gpu
def test_cuda_graph_replays_with_new_positions_equal_eager():
    """One graph, captured once, serves every step: replayed with other positions (and with
    PDL where it applies) it gives eager launches' bits. The default split count depends on
    shapes only: small batches on a long cache split, a large one does not."""
    torch.manual_seed(0)
    H, KV, D, n, dtype = 32, 8, 128, 4096, torch.bfloat16
    sms = torch.cuda.get_device_properties("cuda").multi_processor_count
    assert da.default_splits(2, KV, n, "cuda") == min(math.ceil(2 * sms / (2 * KV)), n // 64) > 1
    assert da.default_splits(2, KV, 128, "cuda") == 2 and da.default_splits(256, KV, n, "cuda") == 1
    B = 3
    qkv = torch.randn(B, (H + 2 * KV) * D, device="cuda", dtype=dtype)
    k0, v0 = (torch.randn(B, KV, n, D, device="cuda", dtype=dtype) for _ in range(2))
    cos, sin = (t.to("cuda", dtype) for t in _rope_tables(n, D))
    norm = (1 + 0.2 * torch.randn(H + KV, D, device="cuda")).to(dtype)
    steps = [torch.tensor(p, device="cuda") for p in ([0, 100, 4095], [4000, 1, 64], [77, 2048, 3])]
    for splits in (None, 1):
        eager = []
        for p in steps:
            k, v = k0.clone(), v0.clone()
            out = da.decode_attention(qkv, k, v, p, cos, sin, H, KV, norm, splits=splits)
            torch.testing.assert_close(out, _reference(qkv, k0, v0, p, cos, sin, H, KV, norm)[0],
                                       **TOL[dtype])
            eager.append((out, k, v))
        k, v, positions = k0.clone(), v0.clone(), steps[0].clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):     # compile and warm up outside the capture
            da.decode_attention(qkv, k, v, positions, cos, sin, H, KV, norm, splits=splits, pdl=True)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = da.decode_attention(qkv, k, v, positions, cos, sin, H, KV, norm, splits=splits,
                                      pdl=True)
        for p, (out_e, k_e, v_e) in zip(steps, eager):
            k.copy_(k0), v.copy_(v0), positions.copy_(p)
            graph.replay()
            assert torch.equal(out, out_e) and torch.equal(k, k_e) and torch.equal(v, v_e)
