"""`lowbit inspect`: what each format does to a model's weights, before training anything.

Format arguments are weight formats in lowbit.formats' grammar (lowbit.formats.weight_format),
e.g. `nvfp4`, `nvfp4:16x16` (2D tiles), `nvfp4:single` (no tensor scale), `mxfp4:rceil`,
`mxfp4:rceil:32x32`, `int4:g64` (or `int4:1x64`), `int4:row:asym`, `mxfp4:sr` (stochastic
rounding, seeded).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterator

import torch

from lowbit.diagnostics.quant_error import QuantError, quantization_error
from lowbit.dispatch import quantize_with_spec
from lowbit.formats.weight_format import WeightFormat, parse_weight_format

__all__ = ["InspectError", "parse_format", "parse_shape", "iter_safetensors", "inspect_tensors",
           "format_table"]


MAX_RANDOM_VALUES = 16384 * 8192


class InspectError(ValueError):
    """Bad input to `lowbit inspect`; the message says what to do."""


@dataclass
class Row:
    tensor: str
    shape: tuple[int, ...]
    format: str
    error: QuantError | None  # None: the format does not apply to this tensor (reason in note)
    note: str = ""


def parse_format(text: str) -> tuple[str, WeightFormat]:
    """'mxfp4:rceil:32x32' -> (label, WeightFormat), in lowbit.formats' grammar: every format
    and option, `row` included (one scale per row of each tensor)."""
    try:
        fmt = parse_weight_format(text, where=" in --formats")
    except ValueError as e:
        raise InspectError(str(e)) from None
    if fmt.name == "bf16":
        raise InspectError("bf16 is no quantization; --formats takes quantized formats, e.g. "
                           "nvfp4,mxfp4,int4")
    return text.strip(), fmt


def parse_shape(text: str) -> tuple[int, ...]:
    if not re.fullmatch(r"\d+(x\d+)*", text.strip()):
        raise InspectError(f"malformed shape {text!r} for --random; write it like 4096x4096")
    shape = tuple(int(v) for v in text.strip().split("x"))
    if any(v == 0 for v in shape):
        raise InspectError(f"shape {text!r} has a zero-sized dim; every dim must be >= 1")
    numel = 1
    for v in shape:
        numel *= v
    if numel > MAX_RANDOM_VALUES:
        raise InspectError(f"shape {text!r} has {numel:,} values, more than --random inspects in "
                           f"memory ({MAX_RANDOM_VALUES:,}); try e.g. 16384x8192")
    return shape


_SAFETENSORS_FLOAT = ("F32", "BF16", "F16", "F64", "F8_E4M3", "F8_E5M2")
_WIDENED = (torch.float64, torch.float8_e4m3fn, torch.float8_e5m2)  # inspected as float32


def iter_safetensors(path: str | Path, skip_non_float: bool = False,
                     name_filter: str | None = None) -> tuple[int, Iterator[tuple[str, torch.Tensor]]]:
    """(count, iterator of (name, tensor)) over a safetensors file, or over every
    *.safetensors file in a folder (a sharded Hugging Face checkpoint). Headers are read and
    checked first; tensors are then loaded one at a time, so a large checkpoint never sits in
    memory whole."""
    from safetensors import safe_open

    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise InspectError(f"{path} holds no *.safetensors files")
    elif path.is_file():
        files = [path]
    else:
        raise InspectError(f"no such file or folder: {path}")
    try:
        pattern = re.compile(name_filter) if name_filter else None
    except re.error as e:
        raise InspectError(f"--filter {name_filter!r} is not a valid regular expression ({e}); "
                           f"e.g. --filter 'layers\\.0\\.'") from None
    index = []
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                names = [(n, f.get_slice(n).get_dtype()) for n in f.keys()]
        except Exception as e:  # safetensors raises its own error types for bad headers
            raise InspectError(f"{file} is not a readable safetensors file ({e})") from None
        for name, dtype in names:
            if pattern and not pattern.search(name):
                continue
            if dtype not in _SAFETENSORS_FLOAT:
                if skip_non_float:
                    continue
                raise InspectError(f"tensor {name!r} in {file} is {dtype}, not a floating-point "
                                   "tensor; pass --skip-non-float to leave such tensors out")
            index.append((file, name))

    def load():
        for file, name in index:
            with safe_open(str(file), framework="pt") as f:
                yield (f"{file.name}:{name}" if len(files) > 1 else name), f.get_tensor(name)

    return len(index), load()


def inspect_tensors(tensors: list[tuple[str, torch.Tensor]] | Iterator,
                    formats: list[tuple[str, WeightFormat]], total: int | None = None,
                    progress: bool = True, seed: int = 0) -> list[Row]:
    from tqdm import tqdm

    rows = []
    bar = tqdm(tensors, total=total, desc="inspect", unit="tensor",
               disable=not progress or (total is not None and total < 8), leave=False)
    for name, tensor in bar:
        x = tensor.float() if tensor.dtype in _WIDENED else tensor
        if x.numel() == 0:   # nothing to quantize or score (a checkpoint may hold one)
            rows += [Row(name, tuple(x.shape), label, None, "empty tensor (no values): skipped")
                     for label, _ in formats]
            continue
        for label, fmt in formats:
            spec = fmt.spec(x.shape[-1] if x.dim() else 1)
            if spec.is_2d and x.dim() < 2:
                rows.append(Row(name, tuple(x.shape), label, None, "1-D tensor: no 2D tiles"))
                continue
            generator = (torch.Generator(device=x.device).manual_seed(seed)
                         if spec.rounding.value == "stochastic" else None)
            q = quantize_with_spec(x, spec, generator=generator)
            error = quantization_error(x, q)
            rows.append(Row(name, tuple(x.shape), label, error, error.note()))
    return rows


def format_table(rows: list[Row]) -> str:
    header = ["tensor", "shape", "format", "SQNR dB", "rel err", "clipped", "flushed",
              "non-finite", "bytes", "vs bf16", "note"]
    lines = [header]
    for r in rows:
        shape = "x".join(map(str, r.shape))
        if r.error is None:
            lines.append([r.tensor, shape, r.format, "-", "-", "-", "-", "-", "-", "-", r.note])
            continue
        e = r.error
        measured = e.measured > 0
        lines.append([r.tensor, shape, r.format, f"{e.sqnr_db:.2f}" if measured else "-",
                      f"{e.rel_error:.4f}" if measured else "-",
                      f"{100 * e.clipped:.3f}%" if measured else "-",
                      f"{100 * e.flushed:.3f}%" if measured else "-",
                      f"{e.nonfinite + e.made_nonfinite:,}", _human(e.nbytes),
                      f"{e.nbytes / e.bf16_nbytes:.3f}x", r.note])
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    numeric = set(range(3, len(header) - 1))
    out = []
    for k, line in enumerate(lines):
        cells = [c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths))]
        out.append("  ".join(cells).rstrip())
        if k == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def rows_to_json(rows: list[Row]) -> str:
    """Strict JSON: NaN and Inf are written as the strings "nan", "inf", "-inf" (as in a run's
    metrics.jsonl)."""
    def plain(value):
        return str(value) if isinstance(value, float) and not math.isfinite(value) else value

    return json.dumps([{"tensor": r.tensor, "shape": list(r.shape), "format": r.format,
                        **{k: plain(v) for k, v in (r.error.as_dict() if r.error else {}).items()},
                        "note": r.note} for r in rows], indent=2)


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)
