"""The engine's weights: each linear layer stored as its precision mode says, and the decoder's
tensors by Hugging Face parameter names.

    weights = EngineWeights.load(state_dict, model_config, precision, rac_ratio, device, dtype)
    weights.layers[i].qkv_proj(x, norm=ln)       # an EngineLinear: quantize x as the mode says, GEMM

With `input_amax` (module name -> calibrated amax of its input, lowbit.export.calibrate's
names) the NVFP4 activations take static scales, as a served checkpoint's (lowbit.rl.precision):
each EngineLinear and expert GEMM holds its amax as a float32 tensor on the device, refreshed in
place by a weight sync like the weights.

A linear's weight is a lowbit.formats.LinearWeight: the packed NVFP4 codes and scales (or FP8
codes, or the compute-dtype values for bf16) exactly as lowbit.rl.precision.quantize_weight
makes them, made once per weight sync and never dequantized on the GPU -- the GEMM kernels
read the stored form (lowbit.dispatch.inference). Projections that read the same input are one
GEMM (q|k|v, gate|up), each part quantized on its own (its own NVFP4 tensor scale, as the
trainer fake-quantizes each projection); an MoE layer's experts are one stack (E, N, K), each
expert quantized on its own.

The engine never holds the trainer's tensors: every weight is copied to the engine's device
and compute dtype first, so the trainer may step while the engine generates.

A weight sync (`EngineWeights.load_`) writes into the tensors the engine holds, so that CUDA
graphs captured on them stay valid: every key, shape and packed form of the state dict is
checked first (a refused state dict leaves the weights as they were), then each part -- an
EngineLinear, an MoE layer's EngineExperts, a norm or embedding tensor -- is built as `load`
builds it and copied into its live twin before the next is built. So a sync holds at most one
of the engine's parts twice, never the whole model, and stores the same bits as a fresh `load`
(a state dict with experts stored one by one, older Qwen3-MoE files', is stacked whole first,
as `load` stacks it).

A trainer that syncs from its own parameters, stepped in place, hands the engine the same
tensors each time: on CUDA the second read in a row of the same tensors (the load and a first
sync, or two syncs) is also captured in a CUDA graph (`load_`'s `graph`, which RolloutEngine
passes with `cuda_graph`), and later syncs replay it, every part's kernels in one launch from
the host, the same bits. The graph's memory pool keeps what the capture needed at its peak (the
largest part's build: an embedding's copy, an expert stack's buffers) while the graph lives.

A weight sync may move packed bytes (for an engine on another device than the trainer's):
`pack_state_dict` quantizes each weight the engine stores quantized where the trainer holds it
(after the cast to the engine's compute dtype, as `load` does), and `load` takes those
QTensors as they are, moved to its device -- 0.5625 bytes a parameter for NVFP4 instead of 2,
the same bits as quantizing on arrival.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from lowbit.dispatch import inference
from lowbit.formats import QTensor
from lowbit.formats.activations import fp8_values
from lowbit.formats.linear_weight import LinearWeight
from lowbit.models.config import ModelConfig
from lowbit.rl.precision import Precision, RolloutMode, quantize_weight, quantize_weight_rows, stored_weight_spec

__all__ = ["EngineLinear", "EngineExperts", "EngineLayer", "EngineWeights", "pack_state_dict"]


def _linear_weight(weights: list[torch.Tensor | QTensor], precision: Precision,
                   device: torch.device, dtype: torch.dtype) -> LinearWeight:
    """Parts (N_i, K) of any dtype and device, fused along N in the mode's storage; a part given
    packed (a QTensor of the mode's spec made from `dtype` values: pack_state_dict) is moved
    as it is, not quantized again. Parts given as tensors are quantized each on its own, all in
    one pass (quantize_weight_rows)."""
    for w in weights:
        _check_packed(w, precision, dtype)
    if precision is Precision.BF16:
        own = [w.detach().to(device=device, dtype=dtype, copy=True) for w in weights]   # our copies
        return LinearWeight.dense(own[0] if len(own) == 1 else torch.cat(own))
    if not any(isinstance(w, QTensor) for w in weights):
        x = torch.cat([w.detach() for w in weights]) if len(weights) > 1 else weights[0].detach()
        return LinearWeight.from_qtensors(_quantized_rows(x, [w.shape[0] for w in weights], precision, device,
                                                          dtype), dtype)
    # packed by the sender (pack_state_dict): moved as they are (from_qtensors copies them)
    return LinearWeight.from_qtensors([w.to(device) if isinstance(w, QTensor) else
                                       _quantized_rows(w.detach(), [w.shape[0]], precision, device, dtype)[0]
                                       for w in weights], dtype)


def _quantized_rows(x: torch.Tensor, rows: list[int], precision: Precision, device: torch.device,
                    dtype: torch.dtype) -> list[QTensor]:
    """Each run of `rows` rows of x (R, K) -- fused parts, or an expert stack's experts --
    quantized on its own, on `device` from `dtype` values, all in one pass."""
    return quantize_weight_rows(x.to(device=device, dtype=dtype), rows, precision)


def _expert_stack(w: torch.Tensor | list[QTensor], precision: Precision, device: torch.device,
                  dtype: torch.dtype) -> LinearWeight:
    """An MoE layer's expert stack (E, N, K), or its experts packed (pack_state_dict), as one
    (E, N, ...) LinearWeight, each expert quantized on its own (all in one pass)."""
    if precision is Precision.BF16 or not isinstance(w, torch.Tensor):
        return LinearWeight.stack([_linear_weight([e], precision, device, dtype) for e in w])
    E, N, K = w.shape
    fused = LinearWeight.from_qtensors(_quantized_rows(w.detach().reshape(E * N, K), [N] * E, precision,
                                                       device, dtype), dtype)
    return LinearWeight(fused.format, fused.data.view(E, N, -1),
                        None if fused.block_scales is None else fused.block_scales.view(E, N, -1),
                        fused.row_scales.view(E, N), K, dtype)


def _check_packed(weight: torch.Tensor | QTensor, precision: Precision, dtype: torch.dtype) -> None:
    """Refuses a packed part (pack_state_dict's QTensor) that is not what the mode stores from
    `dtype` values; a tensor passes (it is quantized on arrival)."""
    if not isinstance(weight, QTensor):
        return
    if precision is Precision.BF16:
        raise ValueError("a bf16 engine stores dense weights: give it tensors, not packed QTensors")
    spec = stored_weight_spec(precision, weight.shape[-1])
    if len(weight.shape) != 2 or weight.spec != spec or weight.dtype != dtype:
        raise ValueError(f"a packed weight must be what this engine stores: {spec.format} "
                         f"blocks {spec.block} of {dtype} values, 2-D; got {weight.format} blocks "
                         f"{weight.spec.block} of {weight.dtype} values, shape {tuple(weight.shape)} "
                         f"(pack it with the engine's pack_state_dict)")


def _linear_names(cfg: ModelConfig) -> list[str]:
    """The state dict entries the engine stores as linear weights (Hugging Face names; an MoE
    layer's experts as its two fused stacks)."""
    names = []
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        names += [f"{p}self_attn.{n}_proj.weight" for n in "qkvo"]
        names += ([p + "mlp.experts.gate_up_proj", p + "mlp.experts.down_proj"] if cfg.is_moe else
                  [f"{p}mlp.{n}_proj.weight" for n in ("gate", "up", "down")])
    return names


@torch.no_grad()
def pack_state_dict(state_dict: Mapping[str, torch.Tensor], cfg: ModelConfig, precision: Precision,
                    dtype: torch.dtype) -> dict:
    """The trainer's side of a packed weight sync: `state_dict` with every linear weight the
    engine stores quantized replaced by the QTensor it would make (cast to the engine's compute
    `dtype` and quantized where the tensor is), an MoE layer's expert stack by a list of one
    QTensor per expert; the other tensors as given. EngineWeights.load takes the result as the
    same bits it would quantize itself (the quantizers are bit-exact on every device). bf16:
    nothing to pack."""
    if precision is Precision.BF16:
        return dict(state_dict)
    sd = _fuse_hf_experts(dict(state_dict), cfg)
    for name in _linear_names(cfg):
        w = sd.get(name)
        if isinstance(w, torch.Tensor):   # a missing one is load's to refuse, by name
            sd[name] = (quantize_weight_rows(w.detach().reshape(-1, w.shape[-1]).to(dtype), [w.shape[1]] * w.shape[0],
                                             precision) if w.dim() == 3
                        else quantize_weight(w.detach().to(dtype), precision))
    return sd


class EngineLinear:
    """One linear layer of the engine (several fused, with `fused`): its weight as `precision`
    stores it, and its GEMM with the activation quantization the mode applies.

    A bias (Qwen2's q/k/v, attention_bias, mlp_bias) stays in the compute dtype and is added to
    the GEMM's output, as servers do and as the trainer's high-precision bias is."""

    def __init__(self, weight: torch.Tensor, precision: Precision, rac_ratio: float,
                 device: torch.device, dtype: torch.dtype, bias: torch.Tensor | None = None,
                 packed_gemm: bool = False, input_amax: float | None = None,
                 rac_group: int = 0, rac_fold: bool = False) -> None:
        self._build([weight], precision, rac_ratio, device, dtype, None if bias is None else [bias],
                    packed_gemm, input_amax, rac_group, rac_fold)

    @classmethod
    def fused(cls, weights: list[torch.Tensor], precision: Precision, rac_ratio: float,
              device: torch.device, dtype: torch.dtype, biases: list[torch.Tensor] | None = None,
              packed_gemm: bool = False, input_amax: float | None = None,
              rac_group: int = 0, rac_fold: bool = False) -> EngineLinear:
        """One GEMM for several weights (out_i, in) of the same in_features; its output is the
        parts' outputs side by side, in order. biases: one (out_i,) per part, or None;
        input_amax: nvfp4's static scale, the calibrated amax of the input (None: per token);
        rac_group, rac_fold: RAC's channel group, its residual folded into the activation
        (lowbit.rl.precision)."""
        self = cls.__new__(cls)
        self._build(list(weights), precision, rac_ratio, device, dtype, biases, packed_gemm,
                    input_amax, rac_group, rac_fold)
        return self

    def _build(self, weights, precision, rac_ratio, device, dtype, biases, packed_gemm,
               input_amax, rac_group, rac_fold) -> None:
        # RAC needs nvfp4, its group and fold a ratio: the engine's one place for the rules
        mode = RolloutMode.make(precision, rac_ratio, rac_group=rac_group, rac_fold=rac_fold)
        self.rac_group, self.rac_fold = mode.rac_group, mode.rac_fold
        self.input_amax = _static_amax(input_amax, precision, device)
        """nvfp4 with static scales: (1,) float32, the input's calibrated amax; else None."""
        if len({w.shape[-1] for w in weights}) != 1:
            raise ValueError(f"fused weights need the same in_features (got shapes "
                             f"{[tuple(w.shape) for w in weights]})")
        if biases is not None and [tuple(b.shape) for b in biases] != [(w.shape[0],) for w in weights]:
            raise ValueError(f"biases of shapes {[tuple(b.shape) for b in biases]} do not match "
                             f"weights of shapes {[tuple(w.shape) for w in weights]}")
        self.precision, self.rac_ratio = precision, float(rac_ratio)
        self.weight = _linear_weight(weights, precision, device, dtype)
        """The stored weight (lowbit.formats.LinearWeight), (out, in)."""
        self.gemm_weight = _gemm_weight(self.weight, precision, packed_gemm)
        """What the GEMM reads: the stored weight, or (NVFP4 without packed_gemm) its values."""
        self.bias = (None if biases is None else
                     torch.cat([b.detach().to(device=device, dtype=dtype) for b in biases]))
        """(out,) added to the output in the compute dtype, or None."""
        self.split_sizes = tuple(w.shape[0] for w in weights)
        self.out_features, self.in_features = self.weight.out_features, self.weight.in_features

    @property
    def values(self) -> torch.Tensor:
        """(out, in) the stored weight's values in the compute dtype, the parts stacked
        (LinearWeight.dequantize: the trainer's fake-quantized weight, bit for bit). The NVFP4
        GEMM multiplies them before that rounding (LinearWeight.reference_values)."""
        return self.weight.dequantize()

    def part(self, i: int) -> torch.Tensor:
        """The values of part i (a view of `values`)."""
        start = sum(self.split_sizes[:i])
        return self.values[start:start + self.split_sizes[i]]

    @property
    def nbytes(self) -> int:
        """Bytes of the stored weight (packed for quantizing modes)."""
        return self.weight.nbytes

    @torch.no_grad()
    def copy_(self, other: EngineLinear) -> None:
        """other's weight, dequantized copy, bias and static scale into this layer's tensors, in
        place (a weight sync, EngineWeights.load_: CUDA graphs captured on them stay valid);
        other is of the same mode and shapes. The saturation flag follows other's
        (LinearWeight.copy_)."""
        _copy_parts(((self.weight, other.weight), (self.gemm_weight, other.gemm_weight),
                     (self.bias, other.bias), (self.input_amax, other.input_amax)))

    def __call__(self, x: torch.Tensor, *, norm: torch.Tensor | None = None, eps: float = 1e-6,
                 silu_mul: bool = False, residual: torch.Tensor | None = None,
                 pdl: bool = False, use_kernels: bool = True) -> torch.Tensor:
        """x (..., in) -> (..., out): prologue (norm: the engine's RMSNorm; silu_mul: SiLU(gate)
        * up of x = [gate | up]), the mode's activation quantization, the GEMM, bias, and the
        residual (..., out) added."""
        lead = x.shape[:-1]
        x2d = x.reshape(-1, x.shape[-1])
        res = None if residual is None else residual.reshape(-1, self.out_features)
        kw = dict(use_kernels=use_kernels)
        if self.precision is Precision.NVFP4:
            x_hat, r_hat = inference.quantize_activations(x2d, "nvfp4", self.rac_ratio, norm=norm,
                                                          eps=eps, silu_mul=silu_mul,
                                                          input_amax=self.input_amax,
                                                          rac_group=self.rac_group,
                                                          rac_fold=self.rac_fold, **kw)
            y = inference.linear(x_hat, self.gemm_weight, self.bias, x2=r_hat, residual=res, **kw)
        elif self.precision is Precision.FP8:
            codes, scale = inference.quantize_activations(x2d, "fp8", norm=norm, eps=eps,
                                                          silu_mul=silu_mul, **kw)
            y = inference.fp8_linear(codes, scale, self.weight, self.bias, res, **kw)
        else:
            y = inference.linear(x2d, self.gemm_weight, self.bias, norm=norm, eps=eps,
                                 silu_mul=silu_mul, residual=res, pdl=pdl, **kw)
        return y.reshape(*lead, self.out_features)


def _static_amax(amax: float | None, precision: Precision, device: torch.device) -> torch.Tensor | None:
    """A calibrated input amax as the (1,) float32 tensor the quantizers read, or None."""
    if amax is None:
        return None
    RolloutMode.make(precision, activation_scale="static")   # a static scale needs nvfp4
    return torch.tensor([amax], dtype=torch.float32, device=device)


def _gemm_weight(weight: LinearWeight, precision: Precision, packed_gemm: bool) -> LinearWeight:
    """The weight a GEMM multiplies: the stored one, or for NVFP4 without packed_gemm its
    dequantized values as a dense weight in the compute dtype (kept beside the packed one and
    refreshed in place by a weight sync, so CUDA graphs that read it stay valid)."""
    if packed_gemm or precision not in (Precision.NVFP4, Precision.NVFP4_W4A16):
        return weight
    return LinearWeight.dense(weight.dequantize())


class EngineExperts:
    """An MoE layer's experts: gate|up (E, 2F, C) and down (E, C, F) stacks, each expert
    quantized on its own (its own NVFP4 tensor scale, as lowbit.nn.QuantExperts fake-quantizes
    them in the trainer), and their grouped GEMMs."""

    def __init__(self, gate_up: torch.Tensor | list[QTensor], down: torch.Tensor | list[QTensor],
                 precision: Precision,
                 rac_ratio: float, device: torch.device, dtype: torch.dtype,
                 packed_gemm: bool = False,
                 input_amax: tuple[float, float] | None = None, rac_group: int = 0,
                 rac_fold: bool = False) -> None:
        """input_amax: nvfp4's static scales, the calibrated amax of the gate|up GEMM's input and
        of the down GEMM's, each shared by all experts (None: per token); rac_group, rac_fold:
        RAC's channel group, its residual folded into the activation (lowbit.rl.precision)."""
        mode = RolloutMode.make(precision, rac_ratio, rac_group=rac_group, rac_fold=rac_fold)
        self.rac_group, self.rac_fold = mode.rac_group, mode.rac_fold
        self.precision, self.rac_ratio = precision, float(rac_ratio)
        gate_up_amax, down_amax = (None, None) if input_amax is None else input_amax
        self.gate_up_amax = _static_amax(gate_up_amax, precision, device)
        self.down_amax = _static_amax(down_amax, precision, device)
        self.gate_up = _expert_stack(gate_up, precision, device, dtype)
        self.down = _expert_stack(down, precision, device, dtype)
        self.gate_up_gemm = _gemm_weight(self.gate_up, precision, packed_gemm)
        self.down_gemm = _gemm_weight(self.down, precision, packed_gemm)
        self.n_experts = len(gate_up)

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes

    @torch.no_grad()
    def copy_(self, other: EngineExperts) -> None:
        """other's stacks (and their dequantized copies, static scales) into this layer's
        tensors, in place, as EngineLinear.copy_."""
        _copy_parts(((self.gate_up, other.gate_up), (self.gate_up_gemm, other.gate_up_gemm),
                     (self.down, other.down), (self.down_gemm, other.down_gemm),
                     (self.gate_up_amax, other.gate_up_amax), (self.down_amax, other.down_amax)))

    def __call__(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                 use_kernels: bool = True) -> torch.Tensor:
        """x (T, C), index and weights (T, k) of the routed experts -> (T, C): every (token,
        expert) row through its expert, then the k rows of a token weighted and summed in
        routing order."""
        T, k = index.shape
        expert_of_row = index.reshape(-1)                                       # (T k,) token-major
        groups = inference.expert_groups(x, expert_of_row, self.n_experts, use_kernels)
        kw = dict(use_kernels=use_kernels)
        gw = dict(groups=groups, **kw)
        if self.precision is Precision.NVFP4:
            x_hat, r_hat = inference.quantize_activations(x, "nvfp4", self.rac_ratio,
                                                          input_amax=self.gate_up_amax,
                                                          rac_group=self.rac_group,
                                                          rac_fold=self.rac_fold, **kw)
            gate_up = inference.grouped_linear(x_hat, self.gate_up_gemm, expert_of_row, k, x2=r_hat, **gw)
            h_hat, rh_hat = inference.quantize_activations(gate_up, "nvfp4", self.rac_ratio,
                                                           silu_mul=True, input_amax=self.down_amax,
                                                           rac_group=self.rac_group,
                                                           rac_fold=self.rac_fold, **kw)
            y = inference.grouped_linear(h_hat, self.down_gemm, expert_of_row, x2=rh_hat, **gw)
        elif self.precision is Precision.FP8:
            gate_up = inference.grouped_linear(_fp8_values(x, **kw), self.gate_up_gemm, expert_of_row,
                                               k, **gw)
            h = _fp8_values(gate_up, silu_mul=True, **kw)
            y = inference.grouped_linear(h, self.down_gemm, expert_of_row, **gw)
        else:
            gate_up = inference.grouped_linear(x, self.gate_up_gemm, expert_of_row, k, **gw)
            y = inference.grouped_linear(gate_up, self.down_gemm, expert_of_row, silu_mul=True, **gw)
        return (y.view(T, k, -1) * weights[:, :, None]).sum(dim=1)


def _copy_parts(pairs) -> None:
    """(mine, theirs) pairs of tensors or LinearWeights, None where a layer has none, copied in
    place; a dequantized copy that is the stored weight itself (packed_gemm, fp8, bf16) once."""
    done = set()
    for mine, theirs in pairs:
        if (mine is None) != (theirs is None):
            raise ValueError("copy_ needs layers of one mode (one has a bias, a dequantized copy "
                             "or a static scale the other has not)")
        if mine is not None and id(mine) not in done:
            done.add(id(mine))
            mine.copy_(theirs)


def _fp8_values(x: torch.Tensor, silu_mul: bool = False, use_kernels: bool = True) -> torch.Tensor:
    """The per-token FP8 activation's values in x's dtype (E4M3 times a power of two: exact)."""
    codes, scale = inference.quantize_activations(x, "fp8", silu_mul=silu_mul, use_kernels=use_kernels)
    return fp8_values(codes, scale, x.dtype)


class EngineLayer:
    """One decoder layer's weights as the engine holds them."""

    def __init__(self) -> None:
        self.input_layernorm = self.post_attention_layernorm = None
        self.qk_norm: torch.Tensor | None = None                       # (H + KV, D): q_norm, k_norm
        self.qkv_proj: EngineLinear | None = None
        self.o_proj: EngineLinear | None = None
        self.gate_up_proj: EngineLinear | None = None                  # dense
        self.down_proj: EngineLinear | None = None
        self.router: torch.Tensor | None = None                        # MoE: (E, C)
        self.experts: EngineExperts | None = None


class EngineWeights:
    """Every tensor the engine's decoder reads: embeddings, layers, final norm, output head;
    made by `load`, rewritten in place by a weight sync (`load_`)."""

    def __init__(self, embed: torch.Tensor, layers: list[EngineLayer], norm: torch.Tensor,
                 lm_head: torch.Tensor) -> None:
        self.embed, self.layers, self.norm, self.lm_head = embed, layers, norm, lm_head
        self.partial = False
        """A load_ stopped while writing (an error after its checks passed, such as running out
        of memory): the tensors hold part the old weights, part the new, until a load_ ends."""
        self._reader: _Reader | None = None   # load's settings, which load_ reads with
        self._last_sources: tuple | None = None   # what the last sync read (_sources)
        self._sync_graph: _SyncGraph | None = None
        self.replayed_syncs = 0
        """Syncs that replayed a captured one (load_'s `graph`)."""
        self.sync_graph_off: str | None = None
        """Why a sync could not be captured in a CUDA graph (None: it could, or was not tried);
        syncs then run eagerly."""

    @classmethod
    @torch.no_grad()
    def load(cls, state_dict: dict[str, torch.Tensor], cfg: ModelConfig, precision: Precision,
             rac_ratio: float, device: torch.device, dtype: torch.dtype,
             packed_gemm: bool = False,
             input_amax: Mapping[str, float] | None = None, rac_group: int = 0,
             rac_fold: bool = False) -> EngineWeights:
        """From a state dict by Hugging Face parameter names; missing or unexpected keys, and
        tensors of another shape than the config implies, are refused. packed_gemm: the GEMMs
        read the packed NVFP4 weights (else their dequantized values, kept beside them).
        input_amax: nvfp4 with static activation scales: module name -> calibrated amax of its
        input (lowbit.export.calibrate_input_amax's; a missing linear or a non-finite amax is
        refused); fused projections take the largest of their parts', an MoE layer's GEMMs
        the largest over the experts that saw tokens. None: per-token scales. rac_group,
        rac_fold: RAC's channel group, its residual folded into the activation
        (lowbit.rl.precision)."""
        reader = _Reader(cfg, precision, rac_ratio, device, dtype, packed_gemm, rac_group,
                         rac_fold, static=input_amax is not None)
        weights = cls(None, [EngineLayer() for _ in range(cfg.n_layers)], None, None)
        parts, weights._last_sources = reader.plan(state_dict, weights, input_amax, sources=reader.graphable)
        for owner, name, make in parts:
            setattr(owner, name, make())
        if cfg.tie_embeddings:   # one tensor for both
            weights.lm_head = weights.embed
        weights._reader = reader
        # each weight's saturation flag, read from the device once for all of them
        LinearWeight.settle(weights._linear_weights())
        return weights

    @torch.no_grad()
    def load_(self, state_dict: Mapping[str, torch.Tensor],
              input_amax: Mapping[str, float] | None = None, graph: bool = False) -> bool:
        """A weight sync: `state_dict` into these weights' own tensors, in place, read with the
        settings `load` was given (input_amax: where load had it, this sync's calibration).
        Every key, shape, packed form and calibrated amax is checked first, as load checks
        them: a state dict load would refuse raises ValueError with nothing written. Then each
        part is built as load builds it and copied into its live twin before the next is built
        (EngineLinear.copy_, EngineExperts.copy_): the bits of a fresh load, at most one part
        held twice. An error while writing leaves `partial` set.

        graph: on CUDA, the second read in a row of the same tensors (a trainer's parameters,
        stepped in place: the load and a first sync, or two syncs) is also captured in a CUDA
        graph, and each later sync from them replays it: every part's kernels in one launch
        from the host, the same bits (see `captured_sync`). A sync from other tensors, packed
        parts, or with static activation scales (their amax are the host's numbers) runs
        eagerly, and so does one after a form of a weight was first made (its tiles, at a
        first decode: the graph would not refresh them), which captures itself again as it
        ends; a capture that fails turns the graph off for these weights (`sync_graph_off`
        says why). The graph's memory pool keeps the capture's peak (the largest part's build:
        an embedding's copy, an expert stack's buffers) while the graph lives.

        Returns whether every linear weight's saturation flag is what it was: a kernel captured
        on these weights (a CUDA graph, a compiled step) took the flag as a constant, so False
        asks the caller to capture them again."""
        reader = self._reader
        if reader is None:
            raise ValueError("load_ rewrites weights made by EngineWeights.load; load them first")
        if (input_amax is not None) != reader.static:
            raise ValueError(f"these weights were loaded {'with' if reader.static else 'without'} "
                             f"static activation scales: a sync gives input_amax exactly where load had it")
        graph = graph and reader.graphable and self.sync_graph_off is None
        parts, sources = reader.plan(state_dict, self, input_amax, sources=graph)   # every check
        linears = self._linear_weights()
        # the flags the kernels were captured with (after a load_ that stopped half-way, unknown)
        saturates = None if self.partial else [w.may_saturate for w in linears]
        if (sources is not None and self._sync_graph is not None and self._sync_graph.sources == sources
                and self._sync_graph.forms == [w.made_forms for w in linears]):
            self.partial = True
            try:
                with torch.cuda.device(reader.device):
                    self._sync_graph.replay(linears)
            except BaseException:
                self._sync_graph = None       # eager from the next sync on; `partial` stays set
                raise
            self.partial = False
            self.replayed_syncs += 1
        else:
            self._sync_graph = None                           # another sync's, or none
            self.partial = True
            for owner, name, make in parts:
                getattr(owner, name).copy_(make())            # the new part is freed here
            self.partial = False
            if sources is not None and sources == self._last_sources:
                self._sync_graph = self._capture(parts, linears, sources)
            LinearWeight.settle(linears)   # the new flags, one read from the device for all
        self._last_sources = sources
        return saturates == [w.may_saturate for w in linears]

    @property
    def captured_sync(self) -> bool:
        """A sync is held in a CUDA graph (load_'s `graph`): the next sync from the same tensors
        replays it."""
        return self._sync_graph is not None

    def _capture(self, parts, linears: list[LinearWeight], sources: tuple) -> _SyncGraph | None:
        """The sync just run, captured (recorded, not run: the weights hold its result already);
        None, with `sync_graph_off` set, where it cannot be (a part that reads the host, or no
        memory left for the graph's pool)."""
        graph = torch.cuda.CUDAGraph()
        try:   # on the engine's device; other threads (a trainer's) may use the GPU meanwhile
            with torch.cuda.device(self._reader.device), torch.cuda.graph(graph, capture_error_mode="thread_local"):
                for owner, name, make in parts:
                    getattr(owner, name).copy_(make())
                maxima = LinearWeight.row_scale_maxima(linears)
        except Exception as e:   # noqa: BLE001 -- any failure: the eager sync stays, as it was
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            self.sync_graph_off = f"capture failed ({type(e).__name__}: {first})"
            return None
        finally:
            for w in linears:   # copy_ under capture took each flag as unknown: read it again
                w.forget_saturation()
        return _SyncGraph(sources, graph, maxima, [w.made_forms for w in linears])

    def _linear_weights(self) -> list[LinearWeight]:
        return [p for p in self._parts() if isinstance(p, LinearWeight)]

    def _parts(self):
        """Every tensor and LinearWeight, in a fixed order (a tied head once; a dequantized
        copy the GEMMs read after the weight it copies)."""
        yield self.embed
        for layer in self.layers:
            for t in (layer.input_layernorm, layer.post_attention_layernorm, layer.qk_norm,
                      layer.router):
                if t is not None:
                    yield t
            for lin in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
                if lin is not None:
                    yield lin.weight
                    if lin.gemm_weight is not lin.weight:    # the dequantized copy
                        yield lin.gemm_weight
                    if lin.bias is not None:
                        yield lin.bias
                    if lin.input_amax is not None:           # static activation scale
                        yield lin.input_amax
            if layer.experts is not None:
                for stored, gemm in ((layer.experts.gate_up, layer.experts.gate_up_gemm),
                                     (layer.experts.down, layer.experts.down_gemm)):
                    yield stored
                    if gemm is not stored:
                        yield gemm
                for amax in (layer.experts.gate_up_amax, layer.experts.down_amax):
                    if amax is not None:
                        yield amax
        yield self.norm
        if self.lm_head is not self.embed:
            yield self.lm_head

    def linear_bytes(self) -> int:
        """Bytes of the stored linear-layer weights (packed in the quantizing modes)."""
        total = 0
        for layer in self.layers:
            for part in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj,
                         layer.experts):
                total += part.nbytes if part is not None else 0
        return total


_Part = EngineLinear | EngineExperts | torch.Tensor   # what a state dict is read into


class _SyncGraph:
    """A weight sync captured in a CUDA graph (EngineWeights.load_'s `graph`): the tensors it
    reads (`_sources`), the graph, each weight's largest row scale, which the graph leaves on
    the device for `LinearWeight.settle`, and the forms made from each weight that it refreshes
    (LinearWeight.made_forms: one made since, tiles at a first decode, is not, so the graph is
    not replayed then: that sync runs eagerly and is captured anew). Besides its sources, the
    graph reads tensors that the kernels' modules keep for the process (run ends, tables)."""

    def __init__(self, sources: tuple, graph: torch.cuda.CUDAGraph, maxima: torch.Tensor | None,
                 forms: list[tuple[bool, bool]]) -> None:
        self.sources, self.graph, self.maxima, self.forms = sources, graph, maxima, forms

    def replay(self, linears: list[LinearWeight]) -> None:
        self.graph.replay()
        LinearWeight.settle(linears, [] if self.maxima is None else self.maxima.tolist())


@dataclass(frozen=True)
class _Reader:
    """How an engine reads a state dict into its parts: load's settings, kept for load_."""

    cfg: ModelConfig
    precision: Precision
    rac_ratio: float
    device: torch.device
    dtype: torch.dtype
    packed_gemm: bool
    rac_group: int
    rac_fold: bool
    static: bool
    """Static NVFP4 activation scales: every read takes the calibrated input_amax."""

    @property
    def graphable(self) -> bool:
        """A sync may be captured in a CUDA graph (load_'s `graph`): a CUDA engine without
        static scales, whose amax are the host's numbers."""
        return self.device.type == "cuda" and not self.static

    def plan(self, state_dict: Mapping[str, torch.Tensor], into: EngineWeights,
             input_amax: Mapping[str, float] | None, sources: bool = False
             ) -> tuple[list[tuple[object, str, Callable[[], _Part]]], tuple | None]:
        """Every part of `into` (new weights' empty layers, or the live ones) as (its owner:
        `into` or one of its layers, the attribute, a function that builds it from the state
        dict), once every check of the state dict has passed: what is refused raises here,
        before anything is built; and with `sources`, what the parts read (`_sources`: a
        captured sync's key; else None)."""
        cfg, precision, device, dtype = self.cfg, self.precision, self.device, self.dtype
        sd = _fuse_hf_experts(dict(state_dict), cfg)
        if input_amax is not None and precision is not Precision.NVFP4:
            raise ValueError(f"input_amax sets static NVFP4 activation scales; precision "
                             f"{precision.value} has none")

        def amax_of(*modules: str, any_of: bool = False) -> float | None:
            # the largest calibrated amax of these modules (any_of: of those calibrated)
            if input_amax is None:
                return None
            found = [input_amax[m] for m in modules if m in input_amax]
            if not found or (len(found) < len(modules) and not any_of):
                missing = next(m for m in modules if m not in input_amax)
                raise ValueError(f"input_amax has no calibrated amax for {missing!r}; calibrate "
                                 f"every linear (lowbit.export.calibrate_input_amax)")
            for m in modules:   # one by one: Python's max() may skip a NaN
                if m in input_amax and not (math.isfinite(float(input_amax[m])) and input_amax[m] >= 0):
                    raise ValueError(f"calibrated input amax {input_amax[m]} for {m!r}: a static "
                                     "scale needs a finite amax >= 0 (was the calibration finite?)")
            return max(float(a) for a in found)
        used: set[str] = set()
        model = (f"{cfg.n_layers} layers, dim {cfg.dim}"
                 + (f", {cfg.n_experts} experts" if cfg.is_moe else ""))

        def take(name: str, shape: tuple[int, ...],
                 linear: bool = False) -> torch.Tensor | QTensor | list[QTensor]:
            # shape: what the config implies; a wrong one would fail (or compute garbage) later.
            # Only a linear weight may come packed (pack_state_dict): an expert stack as a list
            if name not in sd:
                raise ValueError(f"state dict has no {name!r}; the engine's model has {model}")
            value = sd[name]
            if isinstance(value, (list, tuple)):
                got = (len(value), *value[0].shape) if value else (0,)
            else:
                got = tuple(value.shape)
            if tuple(got) != shape:
                raise ValueError(f"state dict's {name!r} has shape {tuple(got)}, not "
                                 f"the {shape} the engine's model expects ({model})")
            if linear:
                for part in value if isinstance(value, (list, tuple)) else [value]:
                    _check_packed(part, precision, dtype)
            elif not isinstance(value, torch.Tensor):
                raise ValueError(f"state dict's {name!r} must be a tensor: only linear weights "
                                 f"come packed")
            used.add(name)
            return value

        def plain(name: str, shape: tuple[int, ...]) -> Callable[[], torch.Tensor]:
            return functools.partial(_own_copy, take(name, shape), device, dtype)

        def linear(*parts: tuple[str, tuple[int, int]], bias: bool = False) -> Callable[[], EngineLinear]:
            # parts: (weight name, (out, in)); bias: the config says these projections have
            # one (Qwen2's q/k/v; attention_bias, mlp_bias), named as their weights are
            biases = ([take(n.removesuffix("weight") + "bias", shape[:1]) for n, shape in parts]
                      if bias else None)
            return functools.partial(EngineLinear.fused, [take(n, shape, linear=True) for n, shape in parts],
                                     precision, self.rac_ratio, device, dtype, biases, self.packed_gemm,
                                     amax_of(*(n.removesuffix(".weight") for n, _ in parts)),
                                     self.rac_group, self.rac_fold)

        C, V, hd = cfg.dim, cfg.vocab_size, cfg.head_dim
        q, kv = cfg.n_heads * hd, cfg.n_kv_heads * hd
        plan = [(into, "embed", plain("model.embed_tokens.weight", (V, C)))]
        for i, layer in enumerate(into.layers):
            p = f"model.layers.{i}."
            plan += [(layer, "input_layernorm", plain(p + "input_layernorm.weight", (C,))),
                     (layer, "post_attention_layernorm", plain(p + "post_attention_layernorm.weight", (C,))),
                     (layer, "qkv_proj", linear((p + "self_attn.q_proj.weight", (q, C)),
                                                (p + "self_attn.k_proj.weight", (kv, C)),
                                                (p + "self_attn.v_proj.weight", (kv, C)), bias=cfg.qkv_bias)),
                     (layer, "o_proj", linear((p + "self_attn.o_proj.weight", (C, q)), bias=cfg.o_bias))]
            if cfg.qk_norm:
                plan.append((layer, "qk_norm", functools.partial(
                    _qk_norm, plain(p + "self_attn.q_norm.weight", (hd,)), cfg.n_heads,
                    plain(p + "self_attn.k_norm.weight", (hd,)), cfg.n_kv_heads)))
            if cfg.is_moe:
                E, F = cfg.n_experts, cfg.moe_ffn_dim
                plan.append((layer, "router", plain(p + "mlp.gate.weight", (E, C))))
                experts = [f"{p}mlp.experts.{e}." for e in range(E)]
                amax = None if input_amax is None else (
                    amax_of(*(e + proj for e in experts for proj in ("gate_proj", "up_proj")), any_of=True),
                    amax_of(*(e + "down_proj" for e in experts), any_of=True))
                plan.append((layer, "experts", functools.partial(
                    EngineExperts, take(p + "mlp.experts.gate_up_proj", (E, 2 * F, C), linear=True),
                    take(p + "mlp.experts.down_proj", (E, C, F), linear=True), precision, self.rac_ratio,
                    device, dtype, self.packed_gemm, amax, self.rac_group, self.rac_fold)))
            else:
                F = cfg.ffn_dim
                plan += [(layer, "gate_up_proj", linear((p + "mlp.gate_proj.weight", (F, C)),
                                                        (p + "mlp.up_proj.weight", (F, C)), bias=cfg.mlp_bias)),
                         (layer, "down_proj", linear((p + "mlp.down_proj.weight", (C, F)), bias=cfg.mlp_bias))]
        plan.append((into, "norm", plain("model.norm.weight", (C,))))
        if cfg.tie_embeddings:   # the head is the embedding (a tied state dict may list it too)
            used.add("lm_head.weight")
        else:
            plan.append((into, "lm_head", plain("lm_head.weight", (V, C))))
        unexpected = sorted(k for k in sd if k not in used and not k.endswith("rotary_emb.inv_freq"))
        if unexpected:
            raise ValueError(f"state dict has keys the engine's model does not: "
                             f"{', '.join(unexpected[:4])}{' ...' if len(unexpected) > 4 else ''}")
        return plan, (_sources({k: sd[k] for k in sd if k in used}, device) if sources else None)


def _sources(sd: Mapping[str, object], device: torch.device) -> tuple | None:
    """What a sync's parts read: each tensor's name, address, shape, strides and dtype, in order
    -- a captured sync replays on the same tensors only. None where a value is not a tensor on
    the engine's device (packed parts, a CPU trainer's tensors: their syncs run eagerly)."""
    key = []
    for name, value in sd.items():
        if type(value) is not torch.Tensor or value.device != device:   # no subclasses (DTensor)
            return None
        key.append((name, value.data_ptr(), tuple(value.shape), value.stride(), value.dtype))
    return tuple(key)


def _own_copy(value: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The engine's own copy of a state dict tensor, on its device and in its dtype."""
    return value.detach().to(device=device, dtype=dtype, copy=True)


def _qk_norm(q_norm: Callable[[], torch.Tensor], n_heads: int, k_norm: Callable[[], torch.Tensor],
             n_kv_heads: int) -> torch.Tensor:
    """(H + KV, D): one per-head weight for q's and k's heads side by side."""
    return torch.cat([q_norm().expand(n_heads, -1), k_norm().expand(n_kv_heads, -1)])


def _fuse_hf_experts(sd: dict, cfg: ModelConfig) -> dict:
    """Checkpoints that store experts one by one (`mlp.experts.<e>.gate_proj.weight`, older
    Qwen3-MoE files) become the fused (E, 2F, C) / (E, C, F) layout lowbit and transformers 5.x
    use."""
    if not cfg.is_moe:
        return sd
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}.mlp.experts."
        if p + "0.gate_proj.weight" not in sd:
            continue
        gates = [sd.pop(p + f"{e}.gate_proj.weight") for e in range(cfg.n_experts)]
        ups = [sd.pop(p + f"{e}.up_proj.weight") for e in range(cfg.n_experts)]
        downs = [sd.pop(p + f"{e}.down_proj.weight") for e in range(cfg.n_experts)]
        sd[p + "gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gates, ups)])
        sd[p + "down_proj"] = torch.stack(downs)
    return sd
