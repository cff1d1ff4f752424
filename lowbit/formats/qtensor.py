"""QTensor: packed quantized storage -- codes, block scales, tensor scale -- and its safetensors form.

Layout (the convention of the NVFP4 checkpoints vLLM, SGLang and TensorRT-LLM load, so that
export is a renaming): codes are uint8, packed along the last (reduction) dim with the first
element in the low bits (FP4: two per byte, even element in the low nibble; int2/ternary four
per byte; binary eight); the last dim of the codes is padded to a whole number of blocks.
Scales are row-major and not swizzled: (..., R, C/b) for 1D blocks, (..., R/b, C/b) for
(b, b) tiles; float8_e4m3fn for NVFP4, biased E8M0 exponents (uint8, 255 = NaN) for MX,
float32 otherwise. The NVFP4 tensor scale is amax / (448 * 6) (ModelOpt's `weight_scale_2`).

A QTensor is storage, not a tensor subclass: the training math in lowbit.ops dequantizes it
(or feeds its codes to a kernel) explicitly.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from lowbit.files import write_safetensors
from lowbit.formats.elements import decode, e8m0_to_float, pack_codes, unpack_codes
from lowbit.formats.spec import QuantSpec, ScaleKind

__all__ = ["QTensor", "save_qtensors", "load_qtensors", "saturate_to"]


def saturate_to(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 `values` in `dtype`, saturating at the largest finite value of the narrower of
    the two (NaN stays NaN): a product that overflowed float32 comes back as float32's max,
    also in float64 (whose max a float32 clamp bound cannot hold)."""
    if not dtype.is_floating_point:
        raise TypeError(f"dequantize gives floating-point values; got dtype {dtype}")
    limit = min(torch.finfo(dtype).max, torch.finfo(values.dtype).max)
    return torch.clamp(values, -limit, limit).to(dtype)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_FORMAT_VERSION = "1"


class QTensor:
    """A quantized tensor: `codes` (packed uint8), `scales`, optional `tensor_scale`, its
    `spec`, the `shape` / `dtype` of the tensor it came from, and for the asymmetric intK
    formats `zeros`, a uint8 zero point per block (shaped as the scales): value = (code - z) * s."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor,
                 tensor_scale: torch.Tensor | None, spec: QuantSpec,
                 shape: tuple[int, ...], dtype: torch.dtype, zeros: torch.Tensor | None = None):
        if (zeros is not None) != (spec.info.scale_kind is ScaleKind.MINMAX):
            raise ValueError(f"{spec.format}: zero points go with the asymmetric formats only "
                             f"(got zeros={'a tensor' if zeros is not None else None})")
        self.zeros = zeros
        self.codes = codes
        self.scales = scales
        self.tensor_scale = tensor_scale
        self.spec = spec
        self.shape = torch.Size(shape)
        self.dtype = dtype

    @property
    def format(self) -> str:
        return self.spec.format

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def nbytes(self) -> int:
        """True storage size: packed codes + scales + tensor scale."""
        size = self.codes.numel() * self.codes.element_size()
        size += self.scales.numel() * self.scales.element_size()
        if self.tensor_scale is not None:
            size += self.tensor_scale.numel() * self.tensor_scale.element_size()
        if self.zeros is not None:
            size += self.zeros.numel() * self.zeros.element_size()
        return size

    def unpacked_codes(self) -> torch.Tensor:
        """One uint8 code per element, shape (..., R, C) (padding dropped)."""
        codes = unpack_codes(self.codes, self.spec.info.element.code_bits)
        return codes[..., : self.shape[-1]]

    def element_scales(self) -> torch.Tensor:
        """The float32 scale of every element, shape (..., R, C) (for 1-D tensors: (C,))."""
        kind = self.spec.info.scale_kind
        if kind is ScaleKind.E4M3:
            scale = self.scales.to(torch.float32)
            if self.tensor_scale is not None:
                # torchao's order: s_t * block scale first, then the element multiply.
                scale = self.tensor_scale * scale
        elif kind is ScaleKind.E8M0:
            scale = e8m0_to_float(self.scales)
        else:
            scale = self.scales
        return self._per_element(scale)

    def _per_element(self, per_block: torch.Tensor) -> torch.Tensor:
        br, bc = self.spec.block
        if br > 1:
            per_block = per_block.repeat_interleave(br, dim=-2)[..., : self.shape[-2], :]
        return per_block.repeat_interleave(bc, dim=-1)[..., : self.shape[-1]]

    def block_max(self) -> torch.Tensor:
        """Largest magnitude each element's block can represent, shape of the tensor (float32)."""
        return self.element_scales() * self.spec.info.element.max_value

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The represented values, in `dtype` (default: the input's dtype) and the input's shape.

        A product that overflows the output dtype saturates at its largest finite value
        (e.g. an RCEIL block rounded up past float16's 65504): a finite input never comes back
        as Inf. NaN blocks stay NaN.
        """
        dtype = self.dtype if dtype is None else dtype
        values = decode(self.unpacked_codes(), self.spec.info.element)
        if self.zeros is not None:
            values = values - self._per_element(self.zeros.to(torch.float32))
        values = values * self.element_scales()
        return saturate_to(values, dtype).reshape(self.shape)

    def t(self) -> QTensor:
        """The transpose of the last two dims, with the same bits (2D tiles only).

        For (b, b) tiles, quantize(x.mT) == quantize(x).t() bit for bit (with RNE), so one
        quantized copy of a weight serves both the forward (X W^T) and the data-gradient
        (dY W) GEMM. 1D blocks run along the last dim only; their transpose would need a new
        quantization with different scales, which lowbit never does implicitly.
        """
        if not self.spec.is_2d:
            raise ValueError(
                f"this QTensor has 1D blocks {self.spec.block}, which run along the last dim, so "
                "its transpose is a different quantization: quantize x.mT instead, or use square "
                f"2D tiles (block=({self.spec.block[1]}, {self.spec.block[1]})) for a free transpose")
        element = self.spec.info.element
        rows, cols = self.shape[-2], self.shape[-1]
        codes_t = self.unpacked_codes().transpose(-1, -2)          # (..., C, R)
        pad = (-rows) % self.spec.block[1]
        if pad:
            codes_t = torch.nn.functional.pad(codes_t, (0, pad))
        packed = pack_codes(codes_t.contiguous(), element.code_bits)
        shape = (*self.shape[:-2], cols, rows)
        zeros = None if self.zeros is None else self.zeros.transpose(-1, -2).contiguous()
        return QTensor(packed, self.scales.transpose(-1, -2).contiguous(), self.tensor_scale,
                       self.spec, shape, self.dtype, zeros=zeros)

    @property
    def mT(self) -> QTensor:
        return self.t()

    def to(self, device) -> QTensor:
        return QTensor(self.codes.to(device), self.scales.to(device),
                       None if self.tensor_scale is None else self.tensor_scale.to(device),
                       self.spec, tuple(self.shape), self.dtype,
                       zeros=None if self.zeros is None else self.zeros.to(device))

    def __repr__(self) -> str:
        return (f"QTensor({self.spec.format}, shape={tuple(self.shape)}, block={self.spec.block}, "
                f"scale_rule={self.spec.scale_rule.value if self.spec.scale_rule else None}, "
                f"rounding={self.spec.rounding.value}, nbytes={self.nbytes})")

    def _metadata(self) -> dict:
        return {"spec": self.spec.to_dict(), "shape": list(self.shape),
                "dtype": str(self.dtype).removeprefix("torch.")}


def save_qtensors(path: str | os.PathLike, tensors: dict[str, QTensor]) -> None:
    """Save QTensors to one safetensors file (`<name>.codes`, `<name>.scales`,
    `<name>.tensor_scale`, `<name>.zeros`, and each tensor's spec in the header's metadata),
    through lowbit.files.write_safetensors: a crash never leaves a half-written file."""
    flat: dict[str, torch.Tensor] = {}
    meta = {"lowbit.format_version": _FORMAT_VERSION}
    for name, q in tensors.items():
        if not isinstance(q, QTensor):
            raise TypeError(f"save_qtensors: {name!r} is a {type(q).__name__}, not a QTensor")
        flat[f"{name}.codes"] = q.codes.contiguous().cpu()
        flat[f"{name}.scales"] = q.scales.contiguous().cpu()
        if q.tensor_scale is not None:
            flat[f"{name}.tensor_scale"] = q.tensor_scale.reshape(1).cpu()
        if q.zeros is not None:
            flat[f"{name}.zeros"] = q.zeros.contiguous().cpu()
        meta[f"lowbit.{name}"] = json.dumps(q._metadata())
    write_safetensors(path, flat, meta)


def load_qtensors(path: str | os.PathLike, device: str | torch.device = "cpu") -> dict[str, QTensor]:
    """Load what save_qtensors wrote, bit for bit. A damaged or foreign file is a ValueError
    that names it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    try:
        return _load_qtensors(path, device)
    except (ValueError, FileNotFoundError) as e:
        if str(path) in str(e):
            raise
        raise ValueError(f"{path} is not a readable QTensor file ({e})") from None
    except Exception as e:  # noqa: BLE001 -- safetensors raises its own error types
        raise ValueError(f"{path} is damaged or not a QTensor file ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else 'unreadable'})") from None


def _load_qtensors(path: Path, device) -> dict[str, QTensor]:
    from safetensors import safe_open

    out: dict[str, QTensor] = {}
    with safe_open(str(path), framework="pt", device=str(device)) as f:
        meta = f.metadata() or {}
        if "lowbit.format_version" not in meta:
            raise ValueError(f"{path} is not a lowbit QTensor file (no lowbit metadata)")
        for key, value in meta.items():
            if not key.startswith("lowbit.") or key == "lowbit.format_version":
                continue
            name = key.removeprefix("lowbit.")
            info = json.loads(value)
            tensor_scale = (f.get_tensor(f"{name}.tensor_scale")
                            if f"{name}.tensor_scale" in f.keys() else None)
            zeros = f.get_tensor(f"{name}.zeros") if f"{name}.zeros" in f.keys() else None
            spec, shape = QuantSpec.from_dict(info["spec"]), tuple(info["shape"])
            codes, scales = f.get_tensor(f"{name}.codes"), f.get_tensor(f"{name}.scales")
            _check_stored(path, name, spec, shape, codes=codes, scales=scales,
                          tensor_scale=tensor_scale, zeros=zeros)
            if tensor_scale is not None:
                tensor_scale = tensor_scale.reshape(())
            out[name] = QTensor(codes, scales, tensor_scale, spec, shape, _DTYPES[info["dtype"]],
                                zeros=zeros)
    return out


def _check_stored(path: Path, name: str, spec: QuantSpec, shape: tuple[int, ...],
                  **stored: torch.Tensor | None) -> None:
    """Refuse stored tensors that are not what the metadata's spec and shape imply (a changed
    shape would dequantize scrambled, a relabelled format decode wrongly)."""
    if not shape or not all(isinstance(n, int) and n > 0 for n in shape):
        raise ValueError(f"{path}: {name} has shape {list(shape)} in its metadata, not a "
                         f"list of positive sizes")
    rows_per_block, cols_per_block = spec.block
    n_col_blocks = -(-shape[-1] // cols_per_block)
    code_bytes = n_col_blocks * cols_per_block * spec.info.element.code_bits // 8
    if len(shape) == 1:
        scale_shape = (n_col_blocks,)
    else:       # (b, b) tiles: one scale per tile; (1, b) blocks: one per row and block
        scale_shape = (*shape[:-2], -(-shape[-2] // rows_per_block), n_col_blocks)
    scale_dtype = {ScaleKind.E4M3: torch.float8_e4m3fn,
                   ScaleKind.E8M0: torch.uint8}.get(spec.info.scale_kind, torch.float32)
    expected = {"codes": ((*shape[:-1], code_bytes), torch.uint8),
                "scales": (scale_shape, scale_dtype),
                "tensor_scale": ((1,) if spec.tensor_scale else None, torch.float32),
                "zeros": (scale_shape if spec.info.scale_kind is ScaleKind.MINMAX else None,
                          torch.uint8)}
    for part, (want_shape, want_dtype) in expected.items():
        t = stored[part]
        if want_shape is None or t is None:
            if (want_shape is None) != (t is None):
                raise ValueError(f"{path}: {name}.{part} is {'missing' if t is None else 'stored'}"
                                 f", but its metadata says {spec.format} with "
                                 f"tensor_scale={spec.tensor_scale}; the file is inconsistent")
            continue
        if tuple(t.shape) != want_shape or t.dtype != want_dtype:
            raise ValueError(f"{path}: {name}.{part} is {str(t.dtype).removeprefix('torch.')} "
                             f"{list(t.shape)}, but its metadata ({spec.format}, blocks "
                             f"{spec.block[0]}x{spec.block[1]}, shape {list(shape)}) implies "
                             f"{str(want_dtype).removeprefix('torch.')} {list(want_shape)}; "
                             f"the file's metadata does not match its tensors")
