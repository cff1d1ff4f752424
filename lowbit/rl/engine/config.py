"""The engine's settings, checked where they are made."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lowbit import kernels
from lowbit.models.config import ModelConfig
from lowbit.rl.precision import ActivationScale, Precision, RolloutMode

__all__ = ["EngineConfig", "COMPILE_MODES"]

# torch.compile modes a decode step may be compiled with (compile_decode): those without
# inductor's own CUDA graphs, since the engine captures the step itself
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")


@dataclass
class EngineConfig:
    precision: Precision | str = Precision.BF16
    """bf16, fp8, nvfp4-w4a16 or nvfp4 (lowbit.rl.precision)."""
    rac_ratio: float = 0.0
    """The fraction of each token's input channels RAC compensates (nvfp4 only)."""
    device: torch.device | str = "cpu"
    dtype: torch.dtype | None = None
    """Compute dtype; default bf16 on CUDA, float32 elsewhere."""
    max_batch_size: int = 64
    max_seq_len: int | None = None
    """Positions a row holds (prompt plus completion). Given, the KV cache holds that many from
    the start; None: up to the model's max_seq_len, the cache growing to what generate calls
    need (lowbit.rl.engine.KVCache.reserve), so a 40k-token context costs nothing unused."""
    cuda_graph: bool | None = None
    """Replay decode steps from CUDA graphs, one per batch-size bucket (default: on CUDA)."""
    compile_decode: bool | str = False
    """torch.compile the decode step: True for the default mode, or a mode of COMPILE_MODES.
    On the inference kernels (decode_kernels) each kernel call stays one operator and Inductor
    fuses the PyTorch operations between them (lowbit.kernels.engine_ops); without them the
    whole plain-PyTorch step is compiled."""
    packed_gemm: bool = False
    """The NVFP4 modes' GEMMs read the packed weights (re-laid at sync as tiles,
    lowbit.formats.nvfp4_tiles; 0.5625 bytes a parameter, decoded in registers by
    lowbit.kernels.engine_linear) and multiply the exact NVFP4 weight. Off: the engine keeps
    each NVFP4 weight dequantized to the compute dtype beside it and multiplies that copy on
    cuBLAS (the weight rounded to bf16, a relative 2^-9 at most; bf16's speed, 1.25x its
    memory). On one H200 the packed GEMMs decode faster than bf16 at 8-32 rows and slower at 1
    and 128 on 0.6-1.1B models, at 0.37-0.47x bf16's memory (docs/results/rollout.md), so
    they are not the default yet. The plain-PyTorch path (decode_kernels off) multiplies the
    same values as the kernels: the exact ones with this on, the copy with it off."""
    decode_kernels: bool | None = None
    """Run on lowbit's Triton inference kernels (GEMMs on the stored weights, decode attention,
    activation quantizers; lowbit.dispatch.inference): default on CUDA when triton imports;
    False: the plain-PyTorch path everywhere."""

    activation_scale: ActivationScale | str = ActivationScale.PER_TOKEN
    """How nvfp4 scales a linear's input (lowbit.rl.precision): "per-token" (a power-of-two
    pre-scale from each token's amax), or "static", a served NVFP4 checkpoint's numerics: one
    FP32 scale per linear from a calibrated amax (load_state_dict's input_amax, refreshed at
    every weight sync), dynamic 1x16 E4M3 block scales under it, values beyond the calibrated
    range saturated."""

    rac_group: int = 0
    """0: RAC chooses a token's channels over the whole row; G (a power of two from 16): the top
    of each G consecutive channels (lowbit.rl.precision)."""

    rac_fold: bool = False
    """RAC's residual added into the quantized activation (one GEMM operand, rounded once to the
    compute dtype) instead of multiplied as a second operand (lowbit.rl.precision)."""

    def resolve(self, model: ModelConfig) -> EngineConfig:
        """Check every setting against the model, fill the defaults; refuses in one line."""
        mode = RolloutMode.make(self.precision, self.rac_ratio, self.activation_scale,
                                self.packed_gemm, self.rac_group, rac_fold=self.rac_fold)
        self.precision, self.rac_ratio, self.activation_scale, self.rac_group, self.rac_fold = (
            mode.precision, mode.rac_ratio, mode.activation_scale, mode.rac_group, mode.rac_fold)
        self.device = torch.device(self.device)
        if self.device.type == "cuda" and self.device.index is None and torch.cuda.is_available():
            # "cuda" as the tensors it holds will say it, so that a device comparison (a weight
            # sync from the trainer's GPU: RolloutEngine.sync) sees the same card as the same
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = self.dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        if self.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype {self.dtype}: the engine computes in float32, bfloat16 or float16")
        if not (isinstance(self.max_batch_size, int) and self.max_batch_size >= 1):
            raise ValueError(f"max_batch_size must be a positive integer (got {self.max_batch_size!r})")
        if self.max_seq_len is not None and not (isinstance(self.max_seq_len, int)
                                                 and self.max_seq_len >= 1):
            raise ValueError(f"max_seq_len must be a positive integer or None for the model's "
                             f"(got {self.max_seq_len!r})")
        self.preallocate = self.max_seq_len is not None
        self.max_seq_len = self.max_seq_len or model.max_seq_len
        if self.max_seq_len > model.max_seq_len:
            raise ValueError(f"max_seq_len {self.max_seq_len} exceeds the model's RoPE tables "
                             f"(config.max_seq_len={model.max_seq_len})")
        if isinstance(self.compile_decode, str) and self.compile_decode not in COMPILE_MODES:
            raise ValueError(f"compile_decode mode {self.compile_decode!r}: use one of "
                             f"{', '.join(COMPILE_MODES)} (the engine captures its own CUDA graphs)")
        if self.compile_decode and model.is_moe:
            raise ValueError("compile_decode needs a dense model (MoE expert grouping on the "
                             "plain-PyTorch path reads counts back to the host)")
        available = kernels.kernels_available(torch.empty(0, device=self.device))
        if self.decode_kernels and not available:
            raise ValueError("decode_kernels needs triton and a CUDA device (or TRITON_INTERPRET=1 "
                             "on the CPU, which is slow)")
        if self.decode_kernels is None:
            self.decode_kernels = self.device.type == "cuda" and available
        # the kernels group MoE experts on the device; the PyTorch path reads counts back
        graphable = self.device.type == "cuda" and (self.decode_kernels or not model.is_moe)
        if self.cuda_graph is None:
            self.cuda_graph = graphable
        if self.cuda_graph and not graphable:
            raise ValueError("cuda_graph needs a CUDA device, and for an MoE model the inference "
                             "kernels (the plain-PyTorch expert grouping reads counts back to the host)")
        return self

    preallocate: bool = field(default=False, init=False)
    """Set by resolve: max_seq_len was given, so the cache holds it from the start."""
