"""The rollout engine's packed-NVFP4 GEMM: y = x @ W^T on NVFP4 weights re-laid at sync as tiles
(lowbit.formats.nvfp4_tiles), any number of rows, experts grouped in one launch; called through
lowbit.kernels.engine_linear's `linear` and `grouped_linear`.

It computes y^T = W x^T on the tensor cores with the weight as the register operand (swap-AB:
the few rows of a decode step are the MMA's narrow side), so at any row count the weight is
decoded once a tile. Per 16 weights a thread spends two byte permutes, about a dozen shifts and
masks and 8 packed bf16 multiplies (inline PTX on the GPU; the same values from plain ops
under the interpreter): each weight becomes e2m1 * e4m3 * 2^-7 exactly in bf16, the float32
accumulator is multiplied by the row's tensor scale (times 2^7) at the end, and rounded once
to the compute dtype. That is the exact NVFP4 weight with float32 sums, as FP4 tensor cores
compute, not LinearWeight.dequantize()'s weight rounded to the compute dtype. RAC's residual
is a second activation operand of the same decoded tile (`x2`). Few output tiles (a narrow N
at a few rows) split K over more programs; their float32 partial sums meet in a workspace and
the last program of a tile (a counter) finishes it, leaving the workspace zeroed for the next
call (no memset: it fits in a CUDA graph). Compute dtypes other than bf16 multiply in float32
(exact products all the same, not fast).

At one row a tile may instead run on the CUDA cores (USE_DOT False, BLOCK_M 1, chosen by the
caller's tile): the same decoded planes, each times its 16 columns of the row in float32,
summed elementwise and once at the end, so no MMA lane is spent on the 15 rows an MMA tile
pads (`python benchmarks/tune.py engine-gemm --rows 1` times it beside the MMA tiles).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit.kernels import interpret_mode
from lowbit.kernels.gemm_common import row_tile, store_output
from lowbit.kernels.launch import cdiv
from lowbit.kernels.nvfp4_tiles import nvfp4_tiles_triton

__all__ = ["nvfp4_linear", "nvfp4_tile", "nvfp4_linear_kernel", "split_k_workspace",
           "WORKSPACES", "RETIRED_WORKSPACES"]

_SMS = 132
"""Streaming multiprocessors the split over K aims to fill (an H200's; more do no harm)."""


def nvfp4_tile(rows: int, N: int, tiles_k: int, row_tiles: int | None = None) -> dict:
    """The NVFP4 kernel's tile for `rows` rows of output width N and K of tiles_k 128-column
    tiles: BLOCK_M rows (the MMA's narrow side), BLOCK_N weight rows, and SPLIT_K programs over
    K where the output tiles alone would leave SMs idle. row_tiles: the grid's row tiles when
    not ceil(rows / BLOCK_M) (grouped experts). From a sweep of the decode shapes of
    TinyLlama-1.1B, Qwen3-0.6B and Llama-3-8B at 1-128 rows on an H200
    (docs/results/rollout.md): 128 weight rows for wide outputs with long K, 4 splits of K
    from 16 tiles up, while the tiles fill under 4 waves; above 32 rows, no split once the
    tiles fill one wave."""
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    block_n = 128 if (N >= 2560 and tiles_k >= 16) or N >= 8192 else 64
    tiles = (row_tiles or -(-rows // block_m)) * -(-N // block_n)
    if block_m == 64 and tiles >= _SMS:
        # many rows whose tiles fill a wave: unsplit, 3 stages (TinyLlama's gate|up at 128 and
        # 256 rows: 28.4 and 41.5 us against 38.7 and 65.6 split 4 ways)
        return {"BLOCK_M": block_m, "BLOCK_N": block_n, "SPLIT_K": 1, "num_warps": 4,
                "num_stages": 3}
    split = 4 if tiles_k >= 16 and tiles < 4 * _SMS else 1
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "SPLIT_K": split, "num_warps": 4,
            "num_stages": 4}


@triton.jit
def _e2m1(code):
    """E2M1 codes (int32, 0..15) -> float32 values, exactly: the code placed in an fp16 bit
    pattern, (code & 7) << 9 with the sign at bit 15, is the value times 2^-14 (its 0.5 an fp16
    subnormal, so nothing flushes); fp16 -> fp32 is exact."""
    bits = ((code & 7) << 9) | ((code & 8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@triton.jit
def _planes_asm(words, s0, s1, s2, s3, s4, s5, s6, s7):
    """The 8 planes of a tile's words (lowbit.formats.nvfp4_tiles), each times its block scale:
    bf16 e2m1 * e4m3 * 2^-7, exact. Two words a time (pack=2: a pair of bf16 results a
    register): prmt gathers the two words' low lanes (planes 0, 2, 4, 6) and high lanes (1, 3,
    5, 7) side by side; a slot's code is a shift and a mask away from its bf16 bits, times 2^-126
    (slot 3 takes three); mul.rn.bf16x2 by the scale pair makes it exact and in range."""
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 a, b, t, u;
        prmt.b32 a, $8, $9, 0x5410;
        prmt.b32 b, $8, $9, 0x7632;
        and.b32 t, a, 0x81C081C0;
        mul.rn.bf16x2 $0, t, $10;
        and.b32 t, b, 0x81C081C0;
        mul.rn.bf16x2 $1, t, $11;
        shl.b32 t, a, 3;
        and.b32 t, t, 0x81C081C0;
        mul.rn.bf16x2 $2, t, $12;
        shl.b32 t, b, 3;
        and.b32 t, t, 0x81C081C0;
        mul.rn.bf16x2 $3, t, $13;
        shl.b32 t, a, 6;
        and.b32 t, t, 0x81C081C0;
        mul.rn.bf16x2 $4, t, $14;
        shl.b32 t, b, 6;
        and.b32 t, t, 0x81C081C0;
        mul.rn.bf16x2 $5, t, $15;
        shl.b32 t, a, 1;
        and.b32 t, t, 0x80008000;
        shr.b32 u, a, 5;
        and.b32 u, u, 0x01000100;
        or.b32 t, t, u;
        shr.b32 u, a, 4;
        and.b32 u, u, 0x00C000C0;
        or.b32 t, t, u;
        mul.rn.bf16x2 $6, t, $16;
        shl.b32 t, b, 1;
        and.b32 t, t, 0x80008000;
        shr.b32 u, b, 5;
        and.b32 u, u, 0x01000100;
        or.b32 t, t, u;
        shr.b32 u, b, 4;
        and.b32 u, u, 0x00C000C0;
        or.b32 t, t, u;
        mul.rn.bf16x2 $7, t, $17;
        }
        """,
        constraints="=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r",
        args=[words, s0, s1, s2, s3, s4, s5, s6, s7], dtype=(tl.bfloat16,) * 8, is_pure=True,
        pack=2)


@triton.jit
def _plane_plain(words, s, J: tl.constexpr):
    """Plane J's values as _planes_asm makes them, from plain integer ops (the interpreter)."""
    lane = (words >> (16 * (J % 2))) & 0xFFFF
    SLOT: tl.constexpr = J // 2
    if SLOT == 0:
        code = ((lane >> 12) & 8) | ((lane >> 6) & 7)
    elif SLOT == 1:
        code = ((lane >> 9) & 8) | ((lane >> 3) & 7)
    elif SLOT == 2:
        code = ((lane >> 6) & 8) | (lane & 7)
    else:
        code = ((lane >> 11) & 8) | ((lane >> 11) & 4) | ((lane >> 10) & 3)
    # the asm's bf16 product: e2m1 * 2^-126 times e4m3 * 2^119, exact in float32 and in bf16
    return (_e2m1(code) * (s.to(tl.float32) * 1.1754943508222875e-38)).to(tl.bfloat16)  # 2^-126


@triton.jit
def _plane_dot(acc, w, x_ptrs, x2_ptrs, cols, row_ok, K, HAS_X2: tl.constexpr,
               F32_DOT: tl.constexpr):
    """acc + w @ x^T (+ w @ x2^T) over one plane's 16 columns: w (BLOCK_N, 16) bf16, the
    activations read transposed, (16, BLOCK_M), straight into the MMA's operand."""
    kk = cols[:, None]
    ok = row_ok & (kk < K)
    acc = _dot_t(w, tl.load(x_ptrs + kk, mask=ok, other=0.0), acc, F32_DOT)
    if HAS_X2:
        acc = _dot_t(w, tl.load(x2_ptrs + kk, mask=ok, other=0.0), acc, F32_DOT)
    return acc


@triton.jit
def _plane(acc, acc_v, w, x_ptrs, x2_ptrs, cols, row_ok, K, HAS_X2: tl.constexpr,
           F32_DOT: tl.constexpr, USE_DOT: tl.constexpr):
    """One decoded plane into the tensor-core accumulator (acc) or, USE_DOT False, the
    CUDA-core one (acc_v): (acc, acc_v)."""
    if USE_DOT:
        acc = _plane_dot(acc, w, x_ptrs, x2_ptrs, cols, row_ok, K, HAS_X2, F32_DOT)
    else:
        acc_v = _plane_fma(acc_v, w, x_ptrs, x2_ptrs, cols, row_ok, K, HAS_X2)
    return acc, acc_v


@triton.jit
def _plane_fma(acc, w, x_ptrs, x2_ptrs, cols, row_ok, K, HAS_X2: tl.constexpr):
    """acc + w * x (+ w * x2) elementwise over one plane's 16 columns of the one row: w
    (BLOCK_N, 16), the row's values (1, 16), float32 products (exact for bf16 / fp16 rows)."""
    kk = cols[None, :]
    ok = row_ok & (kk < K)
    wf = w.to(tl.float32)
    acc += wf * tl.load(x_ptrs + kk, mask=ok, other=0.0).to(tl.float32)
    if HAS_X2:
        acc += wf * tl.load(x2_ptrs + kk, mask=ok, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _dot_t(w, xv, acc, F32_DOT: tl.constexpr):
    """acc + w @ xv: w bf16 (N, k) times xv bf16 (k, M), or (F32_DOT) both in float32."""
    if F32_DOT:
        acc = tl.dot(w.to(tl.float32), xv.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(w, xv, acc)
    return acc


@triton.jit
def nvfp4_linear_kernel(x_ptr, x2_ptr, wq_ptr, ws_ptr, rs_ptr, bias_ptr, res_ptr, y_ptr,
                        part_ptr, count_ptr, tile_expert_ptr, row_ids_ptr, M, N, K, stride_xm,
                        stride_x2m, stride_wn, stride_we, stride_sn, stride_se, stride_rse,
                        stride_rm, stride_ym, tiles_k, tiles_per_split,
                        HAS_X2: tl.constexpr, HAS_BIAS: tl.constexpr,
                        HAS_RES: tl.constexpr, GROUPED: tl.constexpr, ROW_DIV: tl.constexpr,
                        ASM: tl.constexpr, F32_DOT: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, USE_DOT: tl.constexpr = True):
    """Grid (row tiles, column tiles, SPLIT_K): y^T tile (BLOCK_N, BLOCK_M) = W tile x^T over
    this program's share of K's tiles (see the module doc). USE_DOT False (one row, BLOCK_M 1):
    on the CUDA cores, each decoded plane times the row's 16 columns accumulated elementwise in
    float32, summed once at the end."""
    dt = y_ptr.dtype.element_ty
    tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    x_rows, out_rows, m_ok, expert, skip = row_tile(tile, M, tile_expert_ptr, row_ids_ptr,
                                                      GROUPED, ROW_DIV, BLOCK_M)
    if skip:
        return
    wq_ptr += expert * stride_we
    ws_ptr += expert * stride_se
    rs_ptr += expert * stride_rse
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_w = rn.to(tl.int64)                              # rows padded to ROW_PAD: no mask
    x_ptrs = x_ptr + x_rows[None, :] * stride_xm          # (1, BLOCK_M)
    x2_ptrs = x2_ptr + x_rows[None, :] * stride_x2m
    row_ok = m_ok[None, :]
    ri = tl.arange(0, 16)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    acc_v = tl.zeros([BLOCK_N, 16], tl.float32)           # USE_DOT False: products by column
    t0 = tl.program_id(2) * tiles_per_split
    for t in range(t0, tl.minimum(t0 + tiles_per_split, tiles_k)):
        words = tl.load(wq_ptr + rows_w[:, None] * stride_wn + t * 16 + ri[None, :])
        s_all = tl.load(ws_ptr + rows_w[:, None] * stride_sn + t * 8 + tl.arange(0, 8)[None, :])
        even, odd = tl.split(tl.reshape(s_all, (BLOCK_N, 4, 2)))        # planes 0 2 4 6 | 1 3 5 7
        e0, e1 = tl.split(tl.reshape(even, (BLOCK_N, 2, 2)))            # 0 4 | 2 6
        o0, o1 = tl.split(tl.reshape(odd, (BLOCK_N, 2, 2)))             # 1 5 | 3 7
        s0, s4 = tl.split(e0)
        s2, s6 = tl.split(e1)
        s1, s5 = tl.split(o0)
        s3, s7 = tl.split(o1)
        if ASM:
            z = tl.zeros([BLOCK_N, 16], tl.bfloat16)
            w0, w1, w2, w3, w4, w5, w6, w7 = _planes_asm(
                words, s0[:, None] + z, s1[:, None] + z, s2[:, None] + z, s3[:, None] + z,
                s4[:, None] + z, s5[:, None] + z, s6[:, None] + z, s7[:, None] + z)
        else:
            w0 = _plane_plain(words, s0[:, None], 0)
            w1 = _plane_plain(words, s1[:, None], 1)
            w2 = _plane_plain(words, s2[:, None], 2)
            w3 = _plane_plain(words, s3[:, None], 3)
            w4 = _plane_plain(words, s4[:, None], 4)
            w5 = _plane_plain(words, s5[:, None], 5)
            w6 = _plane_plain(words, s6[:, None], 6)
            w7 = _plane_plain(words, s7[:, None], 7)
        c = t * 128 + ri
        acc, acc_v = _plane(acc, acc_v, w0, x_ptrs, x2_ptrs, c, row_ok, K, HAS_X2, F32_DOT, USE_DOT)
        acc, acc_v = _plane(acc, acc_v, w1, x_ptrs, x2_ptrs, c + 16, row_ok, K, HAS_X2, F32_DOT, USE_DOT)
        acc, acc_v = _plane(acc, acc_v, w2, x_ptrs, x2_ptrs, c + 32, row_ok, K, HAS_X2, F32_DOT, USE_DOT)
        acc, acc_v = _plane(acc, acc_v, w3, x_ptrs, x2_ptrs, c + 48, row_ok, K, HAS_X2, F32_DOT, USE_DOT)
        acc, acc_v = _plane(acc, acc_v, w4, x_ptrs, x2_ptrs, c + 64, row_ok, K, HAS_X2, F32_DOT, USE_DOT)
        acc, acc_v = _plane(acc, acc_v, w5, x_ptrs, x2_ptrs, c + 80, row_ok, K, HAS_X2, F32_DOT, USE_DOT)
        acc, acc_v = _plane(acc, acc_v, w6, x_ptrs, x2_ptrs, c + 96, row_ok, K, HAS_X2, F32_DOT, USE_DOT)
        acc, acc_v = _plane(acc, acc_v, w7, x_ptrs, x2_ptrs, c + 112, row_ok, K, HAS_X2, F32_DOT, USE_DOT)
    if not USE_DOT:
        acc = tl.sum(acc_v, axis=1)[:, None]              # (BLOCK_N, 1)
    n_ok = rn < N
    acc = acc * tl.load(rs_ptr + rn, mask=n_ok, other=0.0)[:, None]
    ok = n_ok[:, None] & m_ok[None, :]
    rows, cols = out_rows[None, :], rn[:, None]
    if SPLIT_K == 1:
        store_output(acc.to(dt), y_ptr, bias_ptr, res_ptr, rows, cols, ok, stride_ym, stride_rm,
               HAS_BIAS, HAS_RES, dt)
    else:
        # partial sums meet in the workspace; the tile's last program takes them (leaving
        # zeros) and finishes the tile
        part = part_ptr + rows * N + cols
        tl.atomic_add(part, acc, mask=ok, sem="relaxed")
        counter = count_ptr + tile * tl.num_programs(1) + pid_n
        if tl.atomic_add(counter, 1, sem="acq_rel") == SPLIT_K - 1:
            total = tl.atomic_add(part, tl.zeros_like(acc), mask=ok, sem="relaxed")   # a read at L2
            tl.store(part, tl.zeros_like(acc), mask=ok)
            tl.store(counter, 0)
            store_output(total.to(dt), y_ptr, bias_ptr, res_ptr, rows, cols, ok, stride_ym, stride_rm,
                   HAS_BIAS, HAS_RES, dt)


# ---- launching ----------------------------------------------------------------------------------

WORKSPACES: dict = {}
"""Per device: (float32 partial sums, int32 counters) of the split-K NVFP4 tiles, kept zeroed
by the kernel (the last program of each tile takes its sums and resets its counter)."""
RETIRED_WORKSPACES: list = []
"""Workspaces outgrown by a larger call, kept: a CUDA graph captured before the growth still
reads and writes them (freeing one would hand its memory to another tensor under the graph).
Each is as large as the split call that outgrew it: rows x N float32, tens of megabytes at
most at decode's row counts."""


def split_k_workspace(device: torch.device, sums: int,
                      counters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The device's workspace, grown to hold `sums` partial sums and `counters` tile counters
    (an outgrown one goes to RETIRED_WORKSPACES, never freed)."""
    part, count = WORKSPACES.get(device, (None, None))
    if part is None or part.numel() < sums or count.numel() < counters:
        if part is not None:
            RETIRED_WORKSPACES.append((part, count))
        part = torch.zeros(max(sums, 1 << 16, 0 if part is None else part.numel()),
                           dtype=torch.float32, device=device)
        count = torch.zeros(max(counters, 1 << 12, 0 if count is None else count.numel()),
                            dtype=torch.int32, device=device)
        WORKSPACES[device] = (part, count)
    return part, count


def nvfp4_linear(x, x2, weight, y, bias, residual, rows, tile_expert, row_ids, row_div, tile,
                 block_m=None) -> None:
    """The NVFP4 kernel on weight's tiles (LinearWeight.tiles) for `rows` output rows; grouped
    where tile_expert is given (row tiles of block_m rows)."""
    tiles = weight.tiles(nvfp4_tiles_triton)
    N, K = tiles.out_features, tiles.in_features
    grouped = tile_expert is not None
    row_tiles = tile_expert.numel() if grouped else None
    if tile is None:
        tile = (_interpreter_nvfp4_tile(rows, tiles.tiles_k) if interpret_mode() else
                nvfp4_tile(rows, N, tiles.tiles_k, row_tiles))
    tile = dict(tile)
    if not tile.get("USE_DOT", True) and (grouped or rows != 1 or tile["BLOCK_M"] != 1):
        raise ValueError("the NVFP4 kernel's CUDA-core tile (USE_DOT False) takes one row, "
                         "BLOCK_M 1, not grouped")
    if grouped:
        tile["BLOCK_M"] = block_m
    split = tile["SPLIT_K"]
    grid = (row_tiles or cdiv(rows, tile["BLOCK_M"]), cdiv(N, tile["BLOCK_N"]), split)
    # only split tiles use the workspace: a prefill's many tiles never grow it
    part, count = split_k_workspace(x.device, rows * N if split > 1 else 0,
                             grid[0] * grid[1] if split > 1 else 0)
    wq, ws, rs = tiles.words, tiles.scales, tiles.row_scales
    nvfp4_linear_kernel[grid](
        x, x2 if x2 is not None else x, wq, ws, rs, bias if bias is not None else y,
        residual if residual is not None else y, y, part, count,
        tile_expert if grouped else count, row_ids if grouped else count, rows, N, K, x.stride(0),
        x2.stride(0) if x2 is not None else 0, wq.stride(-2), wq.stride(0) if grouped else 0,
        ws.stride(-2), ws.stride(0) if grouped else 0, rs.stride(0) if grouped else 0,
        residual.stride(0) if residual is not None else 0, y.stride(0), tiles.tiles_k,
        cdiv(tiles.tiles_k, split), HAS_X2=x2 is not None,
        HAS_BIAS=bias is not None, HAS_RES=residual is not None, GROUPED=grouped,
        ROW_DIV=row_div, ASM=x.is_cuda and not interpret_mode(),
        F32_DOT=x.dtype != torch.bfloat16 or interpret_mode(), **tile)


def _interpreter_nvfp4_tile(rows: int, tiles_k: int) -> dict:
    """Under the interpreter: the smallest tile, split over K where there are tiles to split
    (so the workspace's path runs too)."""
    return {"BLOCK_M": 16, "BLOCK_N": 64, "SPLIT_K": 2 if tiles_k >= 2 else 1, "num_warps": 4,
            "num_stages": 1}
