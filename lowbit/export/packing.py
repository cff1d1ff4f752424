"""Integer weights in compressed-tensors' "pack-quantized" layout, from and to lowbit QTensors.

pack-quantized stores signed K-bit codes (K = 4 or 8) offset to unsigned, u = q + 2^(K-1), and
packs them densely into int32 words along the row: element i of a row takes bits
[K*i, K*(i+1)) of the row's bit string, word j holding bits [32j, 32j + 32), least significant
first (compressed_tensors.compressors.pack_quantized.helpers.pack_to_int32); a row is padded
with zeros to whole words. Zero points (asymmetric schemes) are packed the same way along the
output rows instead (packed_dim=0). The value is (q - zero_point) * scale.

lowbit's symmetric intK codes q are in -(2^(K-1)-1)..2^(K-1)-1 (two's complement in K bits),
so u = q + 2^(K-1); its asymmetric codes are already unsigned, 0..2^K-1, with an unsigned
zero point z, so u = q and the stored zero point is z (compressed-tensors' signed q - 2^(K-1)
and z - 2^(K-1) differ by the same offset, so q - z is unchanged). Scales are float32, as
lowbit holds them: (q - z) * s in float32 is lowbit's dequantize bit for bit.
"""

from __future__ import annotations

import torch

from lowbit.formats import QTensor, QuantSpec
from lowbit.formats.elements import decode, encode, pack_codes

__all__ = ["pack_int32", "unpack_int32", "int_tensors", "int_qtensor"]


def pack_int32(u: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes (..., R, C) in [0, 2^bits) as int32 words (..., R, ceil(C * bits / 32))."""
    if bits not in (4, 8):
        raise ValueError(f"pack-quantized takes 4- or 8-bit codes here (got {bits})")
    per_word = 32 // bits
    cols = u.shape[-1]
    words = -(-cols // per_word)
    padded = torch.zeros((*u.shape[:-1], words * per_word), dtype=torch.int64, device=u.device)
    padded[..., :cols] = u.to(torch.int64)
    shifts = torch.arange(per_word, device=u.device, dtype=torch.int64) * bits
    packed = (padded.view(*u.shape[:-1], words, per_word) << shifts).sum(-1)   # < 2^32, exact
    return torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)


def unpack_int32(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """The inverse of pack_int32: unsigned codes (..., R, cols) as int64."""
    per_word = 32 // bits
    words = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(per_word, device=packed.device, dtype=torch.int64) * bits
    u = (words[..., None] >> shifts) & ((1 << bits) - 1)
    return u.flatten(-2)[..., :cols]


def int_tensors(q: QTensor) -> dict[str, torch.Tensor]:
    """A 2D intK QTensor (K = 4, 8; symmetric, or asymmetric with zero points) as the
    pack-quantized tensors of its module: weight_packed, weight_scale, weight_shape and, for
    the asymmetric formats, weight_zero_point."""
    element = q.spec.info.element
    bits = int(q.format.removeprefix("int").split("_")[0])
    offset = 0 if q.zeros is not None else 1 << (bits - 1)
    values = decode(q.unpacked_codes(), element).to(torch.int64)        # q (signed) or u
    out = {"weight_packed": pack_int32(values + offset, bits),
           "weight_scale": q.scales.float().contiguous(),
           "weight_shape": torch.tensor(tuple(q.shape), dtype=torch.int64)}
    if q.zeros is not None:
        out["weight_zero_point"] = pack_int32(q.zeros.to(torch.int64).mT, bits).mT.contiguous()
    return out


def int_qtensor(tensors: dict[str, torch.Tensor], bits: int, asym: bool,
                dtype: torch.dtype = torch.bfloat16) -> QTensor:
    """A module's pack-quantized tensors (what int_tensors writes) as a lowbit QTensor."""
    rows, cols = (int(n) for n in tensors["weight_shape"].tolist())
    scales = tensors["weight_scale"].float()
    group = cols // scales.shape[-1]
    spec = QuantSpec.make(f"int{bits}" + ("_asym" if asym else ""), block=(1, group))
    element = spec.info.element
    u = unpack_int32(tensors["weight_packed"], bits, cols)
    zeros = None
    if asym:
        zeros = unpack_int32(tensors["weight_zero_point"].mT, bits, rows).mT.to(torch.uint8).contiguous()
        values = u
    else:
        values = u - (1 << (bits - 1))
    codes = pack_codes(encode(values.float(), element), element.code_bits)
    return QTensor(codes, scales.contiguous(), None, spec, (rows, cols), dtype, zeros=zeros)
