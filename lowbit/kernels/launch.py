"""Programmatic dependent launch (PDL) for the rollout engine's decode kernels.

On Hopper a kernel launched with PDL starts while the kernel before it finishes: it reads what
that kernel cannot have written (weights, positions, RoPE rows), then waits for it
(`wait_for_inputs`) and lets the next kernel start launching. A batch-1 decode step is a chain
of about a hundred short kernels, and the gaps between them are a large part of it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit.kernels import interpret_mode

__all__ = ["cdiv", "pdl_supported", "pdl_launch", "wait_for_inputs"]


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for a grid's size on the host: triton.cdiv is a ConstexprFunction in triton
    3.9 (the CPU's), about 2 us a call, and a launch path calls it several times."""
    return -(-a // b)


def pdl_supported(device: torch.device | str) -> bool:
    """Programmatic dependent launch applies: a CUDA device of compute capability 9.0 or newer
    (Hopper), kernels compiled rather than interpreted."""
    device = torch.device(device)
    return (device.type == "cuda" and not interpret_mode()
            and torch.cuda.get_device_capability(device)[0] >= 9)


def pdl_launch(pdl: bool, device: torch.device) -> dict:
    """The launch arguments for `pdl`: a kernel's PDL constexpr, and Triton's launch_pdl."""
    on = bool(pdl) and pdl_supported(device)
    return {"PDL": on, "launch_pdl": True} if on else {"PDL": False}


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """Under PDL, wait until the kernel launched before this one has finished and its writes
    are visible, then let the next kernel start launching (its programs wait the same way
    before they read anything this one writes)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
