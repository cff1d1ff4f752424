"""Where the Triton kernels can run (`kernels_available`) and which specs they cover
(`supports`); importing this does not import triton."""

from __future__ import annotations

import functools
import os

import torch

from lowbit.formats.spec import QuantSpec, ScaleKind

__all__ = ["interpret_mode", "triton_importable", "kernels_available", "supports"]


def interpret_mode() -> bool:
    """TRITON_INTERPRET=1 is set: Triton runs its kernels in its CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


_TRITON_IMPORTABLE: bool | None = None


def triton_importable() -> bool:
    # cached by hand, not functools.cache: a compiled rollout step (lowbit.kernels.engine_ops)
    # traces this, and Dynamo warns at a cache wrapper it traces through
    global _TRITON_IMPORTABLE
    if _TRITON_IMPORTABLE is None:
        try:
            import triton  # noqa: F401
            import triton.language  # noqa: F401
            _TRITON_IMPORTABLE = True
        except Exception:
            _TRITON_IMPORTABLE = False
    return _TRITON_IMPORTABLE


def kernels_available(x: torch.Tensor) -> bool:
    """The kernels can run on x: a CUDA tensor with triton importable, or a CPU tensor under
    TRITON_INTERPRET=1 (Triton's interpreter; slow, for tests)."""
    if not triton_importable():
        return False
    return x.is_cuda or (x.device.type == "cpu" and interpret_mode())


@functools.lru_cache(maxsize=256)
def supports(spec: QuantSpec, codes: bool = True) -> bool:
    """Specs the kernels cover: NVFP4 and MX formats with power-of-two blocks (1, 2..128) or
    (b, b) with b in 2..64; with codes=False (fake quantization, no QTensor) also intK's
    absmax-scaled grids. Everything else (int codes, ternary, binary, other blocks) is the
    reference's."""
    kind = spec.info.scale_kind
    if kind is ScaleKind.ABSMAX:
        if codes or not spec.info.element.name.startswith("int"):  # seq2 is the reference's
            return False
    elif kind not in (ScaleKind.E4M3, ScaleKind.E8M0):
        return False
    br, bc = spec.block
    pow2 = bc >= 2 and bc & (bc - 1) == 0
    return pow2 and (bc <= 128 if br == 1 else bc <= 64)
