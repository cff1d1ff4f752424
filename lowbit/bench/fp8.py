"""`lowbit bench fp8`: the exact MXFP4 GEMM on FP8 tensor cores (lowbit.kernels.fp8_gemm) and the
fused quantize-and-fold that feeds it (lowbit.kernels.fp8_fold): bit-exact checks, error
against fp64, timings.

    lowbit bench fp8                           # CUDA (FP8: SM 8.9+), every section
    lowbit bench fp8 --sections checks,errors
    lowbit bench fp8 --smoke                   # small shapes on the CPU (Triton's interpreter)

Sections (--sections):
- checks, bit for bit: MXFP4 (floor / rceil; 1x32, 32x32, 16x16) quantized by the kernels,
  block exponents spread over +-6 and +-30 binades, and QTensors with random codes and
  exponents over all of E8M0 (NaN blocks too): fold_operand on the device gives the same E4M3
  bytes, factors and K-chunks as on the CPU and unfolds to dequantize() (and its transpose for
  2D tiles); the GEMM's NaN rows and columns are fp64's. Then quantize_fold_mxfp4 (and its
  transpose) equals fold_operand of the device's and the CPU reference's quantizer (RNE), or of
  quantize_triton with the same seed (stochastic), with spread, zero, -0, NaN, Inf, subnormal
  and huge blocks; and its one-K-chunk fold (no host sync, path="one_chunk") is that exact fold
  or counts exactly the values the reference fold's rules put outside the window.
- errors: C = A B^T against an fp64 GEMM of the dequantized operands, for a linear layer's
  fprop, dgrad and wgrad (stable-fp4's rceil 32x32 tiles, naive mxfp4's floor 1x32; random
  (+-6 binades) and K-chunked (+-30, 10% zero blocks) scales): fp4_gemm_fp8 through
  torch._scaled_mm (float32 and bf16 output, with and without fast accumulation) and its
  float32 emulation, beside torch.mm of the same values in bf16 and float32 (TF32 off).
  ||C - C64||_F / ||C64||_F and max|C - C64| / max|C64|.
- gemm: ms (do_bench median, L2 flushed) of bf16 torch.mm against the FP8 path on operands
  folded before (bare torch._scaled_mm, fp4_gemm_fp8, with fast accumulation), fold_operand
  of both operands, the FP8 path with quantization and folding, and the emulated path (fused
  fake quantization + bf16 mm); TFLOP/s and ratios to bf16.
- fold: ms of fold_operand on QTensors (eager_fold), quantize + fold_operand (eager), the fused
  quantize_fold_mxfp4 (kernel), each also with the transposed operand (_t), the GEMM on
  operands folded before (gemm) and with the fused fold (gemm+kernel); *_nosync: the fused fold
  in one K-chunk with a device counter (no host sync, as lowbit.train folds); GPU time alone
  (CUDA-graph replay) of bf16_mm, gemm and gemm+kernel_nosync.
- passes: GPU time alone of the one-chunk fold's pass 1 (fold_pass_one), both passes for x's
  operand (fold) and for x's and x^T's (fold_t), against a copy of x and stable-fp4's fused
  fake-quantize-with-transpose.
- grouped: an MoE layer's expert GEMMs, grouped, in bf16 against FP8
  (lowbit.bench.fp8_grouped).
Shapes: 4096^3, 8192^3, 16384x2048x8192 and the GEMMs of the 1b preset at 8192 tokens.
Measured results: docs/results/ (the FP8 GEMM's and the fold's files).
"""

from __future__ import annotations

import functools
import time
import traceback

import torch

from lowbit.bench.fp8_grouped import format_grouped_timings, grouped_timings
from lowbit.bench.timing import graph_time_ms, record_check, time_calls

__all__ = ["SECTIONS", "parse_sections", "bench_fp8", "fold_checks", "gemm_errors",
           "gemm_timings", "fold_timings", "pass_timings"]

SECTIONS = ("checks", "errors", "gemm", "fold", "passes", "grouped")

_D, _F, _KV, _T = 2048, 5504, 1024, 8192                         # 1b preset at 8192 tokens
GEMM_SHAPES = [("4096^3", 4096, 4096, 4096), ("8192^3", 8192, 8192, 8192),
               ("16384x2048x8192", 16384, 2048, 8192),
               ("1b q/o fprop", _T, _D, _D), ("1b k/v fprop", _T, _KV, _D),
               ("1b gate/up fprop", _T, _F, _D), ("1b down fprop", _T, _D, _F),
               ("1b gate/up dgrad", _T, _D, _F), ("1b gate/up wgrad", _F, _D, _T)]  # (M, N, K)
SIZES = {"cuda": {"check": (1024, 2048), "fold_check": (1000, 2080), "layer": (4096, 2048, 5504),
                  "gemm": GEMM_SHAPES, "fold": GEMM_SHAPES[:2] + GEMM_SHAPES[3:7],
                  "passes": [(8192, 2048), (8192, 5504), (5504, 2048)]},
         "cpu": {"check": (64, 256), "fold_check": (40, 130), "layer": (64, 128, 96),
                 "gemm": [("smoke", 64, 96, 128)], "fold": [("smoke", 40, 72, 96)],
                 "passes": [(40, 96)]}}


def parse_sections(text: str) -> list[str]:
    """--sections a,b -> ["a", "b"] in SECTIONS' order; an unknown one is refused in one line."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown or not names:
        raise ValueError(f"--sections takes {', '.join(SECTIONS)}; got {text!r}")
    return [s for s in SECTIONS if s in names]


def _mxfp4(block, rule, rounding="rne"):
    from lowbit.formats import QuantSpec
    return QuantSpec.make("mxfp4", block, rule, rounding)


def spread(rows, cols, binades, seed, device, tile=(1, 32), zero_frac=0.0):
    """float32 gaussians times 2^U{-binades..binades} per tile; a fraction of tiles all zero."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(rows, cols, generator=g, device=device)
    br, bc = tile
    shape = (-(-rows // br), -(-cols // bc))
    e = torch.randint(-binades, binades + 1, shape, generator=g, device=device).float()
    mag = torch.exp2(e) * (torch.rand(shape, generator=g, device=device) >= zero_frac)
    return x * mag.repeat_interleave(br, dim=0)[:rows].repeat_interleave(bc, dim=1)[:, :cols]


def with_special_blocks(x, block):
    """x (float32, >= 40 rows, >= 4 blocks along K) with an all-zero block column, a -0 block,
    NaN and +-Inf blocks, float32-subnormal blocks (scale clamped at 2^-127, some rounding to
    all-zero codes) and huge blocks."""
    br, bc = block
    rows = x.shape[0]
    x = x.clone()
    x[:, 0:bc] = 0.0
    x[0:br, bc:2 * bc] = -0.0
    x[5, 2 * bc + 3] = float("nan")
    x[rows // 2, 3 * bc + 1] = float("inf")
    x[rows // 2 + 1, 3 * bc + 2] = -float("inf")
    x[rows // 4:rows // 4 + br, 2 * bc:3 * bc] *= 2.0**-140
    x[rows - br:, 2 * bc:3 * bc] = 2.0**-149
    x[rows // 2 + 4:rows // 2 + 8, bc:2 * bc] = 3.0e38
    return x


def wild_qtensor(rows, cols, seed, low=-127, high=124):
    """An MXFP4 1x32 QTensor with random codes, block exponents uniform over low..high (124:
    no float32 overflow) and 5% NaN blocks."""
    from lowbit.formats import QTensor
    from lowbit.formats.elements import pack_codes

    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, cols), generator=g, dtype=torch.uint8)
    exps = torch.randint(low, high + 1, (rows, cols // 32), generator=g)
    exps[torch.rand(exps.shape, generator=g) < 0.05] = 128
    return QTensor(pack_codes(codes, 4), (exps + 127).to(torch.uint8), None,
                   _mxfp4((1, 32), "rceil"), (rows, cols), torch.float32)


def _assert_same_fold(a, b) -> None:
    assert a.bounds == b.bounds, (a.bounds, b.bounds)
    assert torch.equal(a.fp8.view(torch.uint8).cpu(), b.fp8.view(torch.uint8).cpu()), "fp8 bits"
    assert torch.equal(a.factors.view(torch.int32).cpu(), b.factors.view(torch.int32).cpu()), \
        "factors"
    assert torch.equal(a.nan_rows.cpu(), b.nan_rows.cpu()), "NaN rows"


def _values_outside_window(q, transpose: bool) -> int:
    """The nonzero values that one factor per row leaves in blocks below the window, by the
    reference fold's rules (what the one-chunk fold must count)."""
    from lowbit.formats.fold import SHIFT_MIN, BlockExponents

    blocks = BlockExponents(q, transpose)
    f = blocks.factor_exponents([0, blocks.n_blocks])
    over = blocks.live & (blocks.exps - f < SHIFT_MIN)
    return int((((blocks.codes & 0x7) != 0).sum(dim=-1) * over).sum())


# ---- checks ------------------------------------------------------------------------------------

def fold_checks(device: str, progress=print) -> list[dict]:
    """The checks of the module doc: one row {"check", "passed", "error" (failures)} each."""
    from lowbit import dispatch
    from lowbit.formats import quantize_with_spec as reference
    from lowbit.formats.fold import fold_operand
    from lowbit.kernels import quantize_triton
    from lowbit.kernels.fp8_fold import quantize_fold_mxfp4
    from lowbit.kernels.fp8_gemm import fp4_gemm_fp8

    rows: list[dict] = []

    def run(label, fn, *args):
        record_check(rows, label, fn, *args, progress=progress)

    def fold_on_device(q, transpose=False):
        got, cpu = fold_operand(q, transpose), fold_operand(q.to("cpu"), transpose)
        _assert_same_fold(got, cpu)
        deq = q.dequantize(torch.float32)
        deq = deq.T if transpose else deq
        nan = torch.isnan(deq)
        values = got.unfold()
        assert torch.equal(torch.isnan(values), nan), "NaN where dequantize() has none"
        assert torch.equal(values.view(torch.int32)[~nan], deq.view(torch.int32)[~nan]), \
            "fp8 * factor != dequantize()"

    def nan_gemm(a, b):
        out = fp4_gemm_fp8(a, b, out_dtype=torch.float32)
        ref = a.dequantize(torch.float32).double() @ b.dequantize(torch.float32).double().T
        assert torch.equal(torch.isnan(out).cpu(), torch.isnan(ref).cpu()), "NaN pattern"

    # on the CPU (a smoke run; tests/test_fp8_gemm.py and test_fp8_fold.py check every case
    # there) a few cases that take every path: 1D and 2D, floor and rceil, RNE and stochastic,
    # one K-chunk and several, special blocks
    full = device == "cuda"
    rows_n, cols_n = SIZES[device]["check"]
    fold_cases = [(_mxfp4(block, rule), binades) for rule in ("floor", "rceil")
                  for block in ((1, 32), (32, 32), (16, 16)) for binades in (6, 30)]
    for spec, binades in fold_cases if full else fold_cases[1::5]:
        name = f"mxfp4 {spec.scale_rule.value} {spec.block[0]}x{spec.block[1]} +-{binades}"
        x = spread(rows_n, cols_n, binades, binades, device, spec.block).bfloat16()
        q = dispatch.quantize_with_spec(x, spec)          # the Triton kernel on CUDA
        run(f"{name} fold_operand on {device} == on the CPU", fold_on_device, q)
        if spec.is_2d:
            run(f"{name} fold_operand transposed", fold_on_device, q, True)
    run("random codes, exponents over all of E8M0, NaN blocks: fold", fold_on_device,
        wild_qtensor(256, 1024, seed=1).to(device))
    # exponents within +-40: no product or float32 partial sum overflows, so every NaN of the
    # output comes from a NaN block (Inf - Inf would add NaNs of its own)
    run("NaN rows and columns of the GEMM (K-chunked)", nan_gemm,
        wild_qtensor(256, 1024, 3, -40, 40).to(device),
        wild_qtensor(64, 1024, 2, -40, 40).to(device))

    def fused(x, spec, transpose, seed):
        got = quantize_fold_mxfp4(x, spec, transpose=transpose, seed=seed)
        if seed is None:   # the device's quantizer (the kernel on CUDA) and the CPU reference
            qs = [dispatch.quantize_with_spec(x, spec), reference(x.cpu(), spec)]
        else:              # stochastic: the kernel quantizer with the same seed
            qs = [quantize_triton(x, spec, seed=seed)]
        refs = [fold_operand(q, transpose) for q in qs]
        for ref in refs:
            _assert_same_fold(got, ref)
        counter = torch.zeros(1, dtype=torch.int64, device=x.device)
        one = quantize_fold_mxfp4(x, spec, transpose=transpose, seed=seed, counter=counter,
                                  path="one_chunk")
        expected = _values_outside_window(qs[-1].to("cpu"), transpose)
        assert int(counter.item()) == expected, (f"one-chunk fold counted {int(counter.item())} "
                                                 f"inexact values, the reference {expected}")
        if expected == 0:
            _assert_same_fold(one, refs[0])

    rows_n, cols_n = SIZES[device]["fold_check"]
    fused_cases = [(rounding, rule, block, binades) for rounding in ("rne", "stochastic")
                   for rule in ("floor", "rceil") for block in ((1, 32), (32, 32), (16, 16))
                   for binades in (6, 30, "special")]
    for rounding, rule, block, binades in fused_cases if full else fused_cases[1::7]:
        spec = _mxfp4(block, rule, rounding)
        x = (with_special_blocks(spread(rows_n, cols_n, 6, 5, device, block), block)
             if binades == "special" else
             spread(rows_n, cols_n, binades, binades, device, block).bfloat16())
        seed = 1234 if rounding == "stochastic" else None
        for transpose in ((False, True) if spec.is_2d else (False,)):
            run(f"quantize_fold_mxfp4 {rounding} {rule} {block} +-{binades}"
                f"{' transposed' if transpose else ''}", fused, x, spec, transpose, seed)
    return rows


# ---- error against fp64 ------------------------------------------------------------------------

def _layer_operands(spec, binades, zero_frac, device):
    """(gemm, a, b) with C = a @ b^T for fprop X.W^T, dgrad dY.W, wgrad dY^T.X."""
    from lowbit import dispatch

    tokens, d_in, d_out = SIZES[device]["layer"]
    x = spread(tokens, d_in, binades, 0, device, spec.block, zero_frac).bfloat16()
    w = spread(d_out, d_in, binades, 1, device, spec.block, zero_frac).bfloat16()
    dy = spread(tokens, d_out, binades, 2, device, spec.block, zero_frac).bfloat16()

    def q(t):
        return dispatch.quantize_with_spec(t.contiguous(), spec)

    if spec.is_2d:
        qx, qw, qdy = q(x), q(w), q(dy)
        return [("fprop", qx, qw), ("dgrad", qdy, qw.t()), ("wgrad", qdy.t(), qx.t())]
    return [("fprop", q(x), q(w)), ("dgrad", q(dy), q(w.T)), ("wgrad", q(dy.T), q(x.T))]


def _errors(out, ref) -> dict:
    diff = out.double() - ref
    return {"rel_fro": (diff.norm() / ref.norm()).item(),
            "rel_max": (diff.abs().max() / ref.abs().max()).item()}


def _scaled_mm_or_emulated(fa, fb, dtype, fast: bool, device: str, row: dict):
    """fp4_gemm_fp8 through torch._scaled_mm; on the CPU, where a torch build has no row-wise
    scales there (a smoke run), the emulation instead, and the row says so ("backend")."""
    from lowbit.kernels.fp8_gemm import fp4_gemm_fp8

    if device == "cpu" and row.get("backend") == "emulated":
        return fp4_gemm_fp8(fa, fb, dtype, fast, backend="emulated")
    try:
        out = fp4_gemm_fp8(fa, fb, dtype, fast, backend="scaled_mm")
    except (RuntimeError, NotImplementedError):
        if device != "cpu":
            raise
        row["backend"] = "emulated"   # this torch's CPU _scaled_mm takes no row-wise scales
        return fp4_gemm_fp8(fa, fb, dtype, fast, backend="emulated")
    row.setdefault("backend", "scaled_mm")
    return out


def gemm_errors(device: str, progress=print) -> list[dict]:
    """One row per (spec, scales, GEMM): the errors of the module doc."""
    from lowbit.formats.fold import fold_operand, fold_report
    from lowbit.kernels.fp8_gemm import fp4_gemm_fp8, gemm_pieces

    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = []
    try:
        for spec in (_mxfp4((32, 32), "rceil"), _mxfp4((1, 32), "floor")):
            for scales, binades, zero_frac in (("random", 6, 0.0), ("chunked", 30, 0.1)):
                for gemm, a, b in _layer_operands(spec, binades, zero_frac, device):
                    a32, b32 = a.dequantize(torch.float32), b.dequantize(torch.float32)
                    ref = a32.double() @ b32.double().T
                    fa, fb = fold_operand(a), fold_operand(b)
                    row = {"spec": f"{spec.scale_rule.value} {spec.block[0]}x{spec.block[1]}",
                           "scales": scales, "gemm": gemm,
                           "shape": [a.shape[0], b.shape[0], a.shape[1]],
                           "chunks_a": len(fa.bounds) - 1, "chunks_b": len(fb.bounds) - 1,
                           "pieces": len(gemm_pieces(fa, fb)),
                           "rows_over_window": fold_report(a).rows_over_window}
                    for fast in (False, True):
                        tag = "fast" if fast else "acc"
                        for dtype, name in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
                            out = _scaled_mm_or_emulated(fa, fb, dtype, fast, device, row)
                            row[f"fp8_{tag}_{name}"] = _errors(out, ref)
                    row["emulated_f32"] = _errors(
                        fp4_gemm_fp8(fa, fb, torch.float32, backend="emulated"), ref)
                    row["mm_bf16"] = _errors(a32.bfloat16() @ b32.bfloat16().T, ref)
                    row["mm_f32"] = _errors(a32 @ b32.T, ref)
                    row["ref_in_bf16"] = _errors(ref.bfloat16(), ref)      # output rounding alone
                    rows.append(row)
                    progress(f"   {row['spec']} {scales:8s} {gemm}: pieces {row['pieces']}, fp8 "
                             f"f32 {row['fp8_acc_f32']['rel_fro']:.2e} (fast "
                             f"{row['fp8_fast_f32']['rel_fro']:.2e}), bf16 mm "
                             f"{row['mm_bf16']['rel_fro']:.2e}")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return rows


def format_errors(rows: list[dict]) -> str:
    cols = [("fp8_acc_f32", "fp8 f32"), ("fp8_fast_f32", "fp8 f32 fast"),
            ("fp8_acc_bf16", "fp8 bf16"), ("fp8_fast_bf16", "fp8 bf16 fast"),
            ("emulated_f32", "emulated f32"), ("mm_bf16", "bf16 mm"), ("mm_f32", "fp32 mm"),
            ("ref_in_bf16", "fp64->bf16")]
    lines = ["relative error ||C - C64||_F / ||C64||_F  [max|C - C64| / max|C64|]",
             f"{'spec':11s} {'scales':8s} {'gemm':5s} {'pieces':>6s} "
             + " ".join(f"{h:>19s}" for _, h in cols)]
    for r in rows:
        cells = " ".join(f"{r[k]['rel_fro']:8.2e} [{r[k]['rel_max']:8.2e}]" for k, _ in cols)
        lines.append(f"{r['spec']:11s} {r['scales']:8s} {r['gemm']:5s} {r['pieces']:6d} {cells}")
    return "\n".join(lines)


# ---- timings -----------------------------------------------------------------------------------

def gemm_timings(device: str, progress=print) -> list[dict]:
    """One row per shape (M, N, K): ms and TFLOP/s of each call of the module doc's gemm."""
    from lowbit import dispatch
    from lowbit.formats.fold import fold_operand
    from lowbit.kernels.fp8_gemm import fp4_gemm_fp8, gemm_pieces

    stable = _mxfp4((32, 32), "rceil")
    results = []
    for label, m, n, k in SIZES[device]["gemm"]:
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
        qx, qw = dispatch.quantize_with_spec(x, stable), dispatch.quantize_with_spec(w, stable)
        fx, fw = fold_operand(qx), fold_operand(qw)
        one_chunk = len(gemm_pieces(fx, fw)) == 1
        sx, sw = fx.factors[:, :1].contiguous(), fw.factors[:, 0][None, :].contiguous()
        calls = {
            "bf16_mm": lambda: torch.mm(x, w.t()),
            "fp8": lambda: fp4_gemm_fp8(fx, fw),
            "fp8_fast": lambda: fp4_gemm_fp8(fx, fw, use_fast_accum=True),
            "fold": lambda: (fold_operand(qx), fold_operand(qw)),
            "fp8_incl_quant": lambda: fp4_gemm_fp8(dispatch.quantize_with_spec(x, stable),
                                                   dispatch.quantize_with_spec(w, stable)),
            "emulated": lambda: torch.mm(dispatch.quantize_dequantize(x, stable),
                                         dispatch.quantize_dequantize(w, stable).t()),
        }
        row = {"shape": label, "M": m, "N": n, "K": k, "one_chunk": one_chunk}
        if one_chunk:   # the bare GEMM: one row-scaled torch._scaled_mm
            def bare():
                return torch._scaled_mm(fx.fp8, fw.fp8.t(), scale_a=sx, scale_b=sw,
                                        out_dtype=torch.bfloat16)
            try:
                bare()
                calls["scaled_mm"] = bare
            except (RuntimeError, NotImplementedError):
                if device != "cpu":
                    raise
                row["scaled_mm"] = "this torch's CPU _scaled_mm takes no row-wise scales"
        time_calls(calls, device, row, progress)
        for name in calls:
            if f"{name}_ms" in row and name != "fold":
                row[f"{name}_tflops"] = 2 * m * n * k / row[f"{name}_ms"] / 1e9
        results.append(row)
        progress(f"   {label}: " + ", ".join(f"{key} {v:.3f}" for key, v in row.items()
                                             if key.endswith("_ms")))
    return results


def format_gemm_timings(rows: list[dict]) -> str:
    cols = [("bf16_mm", "bf16 mm"), ("scaled_mm", "_scaled_mm"), ("fp8", "fp8"),
            ("fp8_fast", "fp8 fast"), ("fp8_incl_quant", "fp8+q+fold"), ("emulated", "emulated")]
    lines = ["TFLOP/s (ratio to bf16 torch.mm); fold = ms to fold both operands",
             f"{'shape':18s} {'M':>6s} {'N':>6s} {'K':>6s} "
             + " ".join(f"{h:>16s}" for _, h in cols) + f" {'fold ms':>8s}"]
    for r in rows:
        base = r.get("bf16_mm_tflops")
        cells = []
        for key, _ in cols:
            t = r.get(f"{key}_tflops")
            if t is None:
                cells.append(f"{'-':>16s}")
            elif key == "bf16_mm" or not base:
                cells.append(f"{t:16.0f}")
            else:
                cells.append(f"{t:9.0f} ({t / base:4.2f})")
        fold_ms = r.get("fold_ms")
        lines.append(f"{r['shape']:18s} {r['M']:6d} {r['N']:6d} {r['K']:6d} " + " ".join(cells)
                     + (f" {fold_ms:8.3f}" if fold_ms is not None else f" {'-':>8s}"))
    return "\n".join(lines)


FOLD_COLUMNS = ["bf16_mm", "gemm", "eager_fold", "eager", "kernel", "kernel_nosync", "eager_t",
                "kernel_t", "kernel_t_nosync", "gemm+kernel", "gemm+kernel_nosync"]


def fold_timings(device: str, progress=print) -> list[dict]:
    """One row per shape: ms of each call of the module doc's fold (both operands)."""
    from lowbit import dispatch
    from lowbit.formats.fold import fold_operand
    from lowbit.kernels.fp8_fold import quantize_fold_mxfp4, quantize_fold_mxfp4_with_transpose
    from lowbit.kernels.fp8_gemm import fp4_gemm_fp8

    stable = _mxfp4((32, 32), "rceil")
    counter = torch.zeros(1, dtype=torch.int64, device=device)   # the sync-free folds' count
    results = []
    for label, m, n, k in SIZES[device]["fold"]:
        a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        b = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
        qa, qb = dispatch.quantize_with_spec(a, stable), dispatch.quantize_with_spec(b, stable)
        fa, fb = fold_operand(qa), fold_operand(qb)

        def eager(t, transpose=False):
            q = dispatch.quantize_with_spec(t, stable)
            return (fold_operand(q), fold_operand(q, True)) if transpose else fold_operand(q)

        def kernel(t, transpose=False, nosync=False):
            c = counter if nosync else None
            return (quantize_fold_mxfp4_with_transpose(t, stable, counter=c) if transpose
                    else quantize_fold_mxfp4(t, stable, counter=c))

        calls = {
            "bf16_mm": lambda: torch.mm(a, b.t()),
            "gemm": lambda: fp4_gemm_fp8(fa, fb),
            "eager_fold": lambda: (fold_operand(qa), fold_operand(qb)),
            "eager": lambda: (eager(a), eager(b)),
            "eager_t": lambda: (eager(a, True), eager(b, True)),
        }
        for nosync in (False, True):
            tag = "_nosync" if nosync else ""
            calls["kernel" + tag] = functools.partial(
                lambda s: (kernel(a, nosync=s), kernel(b, nosync=s)), nosync)
            calls["kernel_t" + tag] = functools.partial(
                lambda s: (kernel(a, True, s), kernel(b, True, s)), nosync)
            calls["gemm+kernel" + tag] = functools.partial(
                lambda s: fp4_gemm_fp8(kernel(a, nosync=s), kernel(b, nosync=s)), nosync)
        row = {"shape": label, "M": m, "N": n, "K": k,
               "chunks": [len(fa.bounds) - 1, len(fb.bounds) - 1]}
        time_calls(calls, device, row, progress)
        for name in ("bf16_mm", "gemm", "gemm+kernel_nosync"):
            row[f"{name}_graph_ms"] = graph_time_ms(calls[name], device)
        if "kernel_ms" in row:   # 2 reads of bf16 + 1 byte written per element
            row["kernel_GBps"] = 5 * (m + n) * k / row["kernel_ms"] / 1e6
        results.append(row)
        progress(f"   {label}: " + ", ".join(f"{key} {v:.3f}" for key, v in row.items()
                                             if key.endswith("_ms") and v is not None))
    return results


def format_fold_timings(rows: list[dict]) -> str:
    lines = ["ms (median); kernel GB/s; eager/kernel = speedup of the fused fold",
             f"{'shape':18s} " + " ".join(f"{c:>11s}" for c in FOLD_COLUMNS)
             + f" {'GB/s':>7s} {'eager/kern':>10s} {'eager_t/k_t':>11s}"]
    for r in rows:
        cells = [f"{r[c + '_ms']:11.3f}" if c + "_ms" in r else f"{'-':>11s}" for c in FOLD_COLUMNS]

        def ratio(x, y):
            return (f"{r[x + '_ms'] / r[y + '_ms']:.2f}x" if x + "_ms" in r and y + "_ms" in r
                    else "-")
        gbps = f"{r['kernel_GBps']:7.0f}" if "kernel_GBps" in r else f"{'-':>7s}"
        lines.append(f"{r['shape']:18s} " + " ".join(cells) + f" {gbps} "
                     f"{ratio('eager', 'kernel'):>10s} {ratio('eager_t', 'kernel_t'):>11s}")
    graphed = [r for r in rows if r.get("bf16_mm_graph_ms")]
    if graphed:
        lines += ["", "GPU time alone (ms, CUDA-graph replay); speedup = bf16_mm / that",
                  f"{'shape':18s} {'bf16_mm':>9s} {'gemm':>9s} {'speedup':>8s} "
                  f"{'gemm+fold':>10s} {'speedup':>8s}"]
        for r in graphed:
            mm, g, q = (r.get(f"{c}_graph_ms") for c in ("bf16_mm", "gemm", "gemm+kernel_nosync"))
            cells = [f"{'-':>9s}" if v is None else f"{v:9.3f}" for v in (g, q)]
            lines.append(f"{r['shape']:18s} {mm:9.3f} {cells[0]} "
                         f"{'-' if g is None else f'{mm / g:.2f}x':>8s} {cells[1]:>10s} "
                         f"{'-' if q is None else f'{mm / q:.2f}x':>8s}")
    return "\n".join(lines)


def pass_timings(device: str, progress=print) -> list[dict]:
    """One row per x shape: GPU ms (CUDA-graph replay; None on the CPU) of the one-chunk fold's
    passes, a copy and the fused fake-quantize-with-transpose."""
    from lowbit.kernels import fake_quantize_triton_with_transpose
    from lowbit.kernels.fp8_fold import (fold_pass_one, quantize_fold_mxfp4,
                                         quantize_fold_mxfp4_with_transpose)

    stable = _mxfp4((32, 32), "rceil")
    counter = torch.zeros(1, dtype=torch.int64, device=device)
    rows = []
    for m, k in SIZES[device]["passes"]:
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        calls = {"copy": lambda: x.clone(),
                 "fakequant_t": lambda: fake_quantize_triton_with_transpose(x, stable),
                 "pass1": lambda: fold_pass_one(x, stable),
                 "fold": lambda: quantize_fold_mxfp4(x, stable, counter=counter,
                                                     path="one_chunk"),
                 "fold_t": lambda: quantize_fold_mxfp4_with_transpose(x, stable, counter=counter,
                                                                      path="one_chunk")}
        row = {"shape": f"{m}x{k}"}
        for name, fn in calls.items():
            fn()
            row[name] = graph_time_ms(fn, device)
        if row["fold_t"] is not None and row["pass1"] is not None:
            row["pass2_t"] = row["fold_t"] - row["pass1"]
        rows.append(row)
        progress("   " + ", ".join(f"{key} {v:.3f}" if isinstance(v, float) else f"{key} {v}"
                                   for key, v in row.items()))
    return rows


# ---- the command -------------------------------------------------------------------------------

def bench_fp8(sections=SECTIONS, *, device: str = "cuda", save=lambda report: None,
              progress=print) -> dict:
    """Run the sections in order on `device` ("cuda", or "cpu" under Triton's interpreter:
    small shapes), printing each one's table, and return {section: rows}; save(report) after
    every section, so a run cut short keeps what it measured. A section that raises is printed
    and recorded as {"error": ...}, the others still run, and SystemExit(1) ends the run."""
    runs = {"checks": (fold_checks, None), "errors": (gemm_errors, format_errors),
            "gemm": (gemm_timings, format_gemm_timings),
            "fold": (fold_timings, format_fold_timings), "passes": (pass_timings, None),
            "grouped": (grouped_timings, format_grouped_timings)}
    report: dict = {}
    failed = []
    t0 = time.time()
    for name in sections:
        progress(f"\n== {name}")
        run, show = runs[name]
        try:
            report[name] = run(device, progress)
        except Exception as e:  # noqa: BLE001 -- report it, run the next section
            traceback.print_exc()
            report[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
            failed.append(name)
            save(report)
            continue
        save(report)
        if name == "checks":
            bad = [r for r in report[name] if not r["passed"]]
            progress(f"checks: {len(report[name]) - len(bad)} passed, {len(bad)} failed")
        elif show is not None:
            progress(show(report[name]))
    progress(f"\ntotal {time.time() - t0:.0f} s")
    if failed:
        progress(f"sections that raised: {', '.join(failed)}")
        raise SystemExit(1)
    return report
