"""Write a lowbit model as a servable low-bit Hugging Face folder.

    report = export_model(model, "out/", format="nvfp4", layout="modelopt")
    report = export_model(model, "out/", weights=qat_weights)     # packed weights as they are

What is quantized: every linear of the decoder layers (q/k/v/o, gate/up/down) and every
MoE expert's three projections, each written as its own 2D tensor under the Hub's per-expert
names (`mlp.experts.{e}.gate_proj`...). What stays BF16 and is listed as excluded: lm_head,
the MoE routers (`mlp.gate`), embeddings, norms, biases, and any linear whose input width is
not a multiple of the block (servers need whole blocks along the reduction dimension).

Fused groups share one tensor scale, as TensorRT-LLM requires (vLLM takes the group's max
and warns otherwise): q/k/v of a layer, gate/up of a dense MLP, gate/up of each expert. When
lowbit quantizes (round to nearest), it quantizes the group's weights stacked along the
output rows, one tensor, and splits the rows: 1D blocks run along the input dimension, so
every block is the block it would be alone, under the group's tensor scale.

Already-quantized weights (`weights`: a mapping from Hugging Face weight name to QTensor,
e.g. a QAT run's converted weights) are written as they are, bit for bit: no requantization.
Keys are the names the export writes (`model.layers.0.self_attn.q_proj.weight`,
`model.layers.0.mlp.experts.3.up_proj.weight`), or, for an expert, its fused gate/up as one
(2F, C) QTensor under `model.layers.0.mlp.experts.3.gate_up_proj`, or a layer's whole experts
stacks as lowbit's and transformers' parameters hold them, `model.layers.0.mlp.experts.gate_up_proj`
(E, 2F, C) and `....experts.down_proj` (E, C, F) (what lowbit.qat.packed_weights returns). 2D tiles (16x16 NVFP4,
32x32 MX) become the serving layout's 1D row blocks exactly (each row of a tile has the
tile's scale). A group whose QTensors carry different tensor scales is refused unless
allow_unshared_scales (vLLM then uses their max, TensorRT-LLM cannot load it faithfully).

Files. Every file is written to a temporary file in `out` and renamed over its name
(lowbit.files.write_atomic): a name that is a symlink (a Hugging Face cache
snapshot) is replaced, never written through, and a failed write (a full disk) leaves no
partial file. Files a previous export wrote that this one does not (EXPORT_FILES, the
`model-0000i-of-0000n.safetensors` shards, their temporary files) are removed afterwards, so
an old index or shard is never served beside the new weights; other files are left alone,
except that another `*.safetensors` in `out` (a QAT run's quantized.safetensors) is refused
before anything is written, since servers load every safetensors file of a folder without
an index.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from collections.abc import Mapping

import torch
from tqdm import tqdm

from lowbit.dispatch import quantize_with_spec
from lowbit.export.layouts import (FORMAT_LAYOUTS, compressed_tensors_config,
                                   int_compressed_tensors_config, modelopt_config,
                                   parse_export_format, tensor_names)
from lowbit.export.packing import int_tensors
from lowbit.formats import QTensor, QuantSpec
from lowbit.formats.weight_format import WeightFormat
from lowbit.formats.quantize import tensor_scale_from_amax
from lowbit.files import TEMP_NAME, write_atomic, write_text_atomic
from lowbit.models.hf import hf_config_dict, hf_state_items, write_shards

__all__ = ["ExportReport", "export_model", "export_bf16", "quantize_group", "split_rows", "row_blocks",
           "weight_groups", "check_export_folder", "write_text", "TOKENIZER_FILES",
           "EXPORT_FILES"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja", "vocab.json", "merges.txt",
                   "tokenizer.model")
EXPORT_FILES = ("config.json", "hf_quant_config.json", "model.safetensors",
                "model.safetensors.index.json", "lowbit_export.json", *TOKENIZER_FILES)
"""The names an export writes (`lowbit export` adds lowbit_export.json), besides its shards."""
_SHARD = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


@dataclass
class ExportReport:
    out: Path
    format: str
    layout: str
    quantized: list[str] = field(default_factory=list)
    """Hugging Face module names written packed."""
    excluded: list[str] = field(default_factory=list)
    """Linear-like modules left in BF16 (listed in the config's exclude/ignore)."""
    quantized_bytes: int = 0
    """Bytes of the packed weights: codes, block scales and tensor scales."""
    quantized_bf16_bytes: int = 0
    """The same weights in BF16."""
    total_bytes: int = 0
    """Every tensor written."""
    bf16_total_bytes: int = 0
    """The whole model in BF16 (what save_hf in bfloat16 writes)."""
    activations: str = "bf16"
    """"nvfp4": W4A4 with calibrated static input scales; "bf16": weight-only."""
    notes: list[str] = field(default_factory=list)
    """Readers known to load this export wrong (`lowbit export` prints each as a warning)."""

    @property
    def weight_ratio(self) -> float:
        return self.quantized_bytes / max(self.quantized_bf16_bytes, 1)

    @property
    def total_ratio(self) -> float:
        return self.total_bytes / max(self.bf16_total_bytes, 1)

    def __str__(self) -> str:
        scheme = "W4A4, static NVFP4 input scales" if self.activations == "nvfp4" else "weight-only"
        return (f"lowbit export: {self.format} ({self.layout}, {scheme}) -> {self.out}: "
                f"{len(self.quantized)} weights packed, {len(self.excluded)} modules kept in BF16; "
                f"quantized weights {self.quantized_bytes / 2**20:.2f} MiB = "
                f"{self.weight_ratio:.3f}x their BF16 size; whole folder "
                f"{self.total_bytes / 2**20:.2f} MiB = {self.total_ratio:.3f}x the BF16 folder")


TRANSFORMERS_FUSED_EXPERTS = (
    "transformers (5.25, with compressed-tensors 0.20.1) fuses a checkpoint's per-expert tensors "
    "into experts.gate_up_proj / down_proj and decompresses them without {what}, so it {effect}; "
    "compressed-tensors' own decompressor and lowbit.export.load_exported read these experts "
    "exactly (docs/models.md, 'MoE exports in transformers')")


def reader_notes(fmt: WeightFormat, layout: str, quantized: list[str]) -> list[str]:
    """Known problems of readers with an export of these packed weights: transformers'
    fused-experts decompression (transformers/integrations/compressed_tensors.py,
    CompressedTensorsDequantize.convert) passes each expert's packed weight, block scales and
    shape, not its NVFP4 tensor scale or its zero points."""
    if layout != "compressed-tensors" or not any(".experts." in n for n in quantized):
        return []
    if fmt.name == "nvfp4":
        return [TRANSFORMERS_FUSED_EXPERTS.format(
            what="weight_global_scale", effect="loads every expert weight without its tensor "
            "scale, silently wrong (up to 6 x 448 = 2,688 in magnitude)")]
    if fmt.asym:
        return [TRANSFORMERS_FUSED_EXPERTS.format(
            what="weight_zero_point", effect="refuses the export ('Asymmetric quant requires "
            "zero-point values')")]
    return []


def quantize_group(weights: list[torch.Tensor], spec: QuantSpec) -> list[QTensor]:
    """Quantize weights that share their input dimension under one tensor scale: stacked
    along the rows, quantized once, split back. Each block is the one it would be alone."""
    stacked = torch.cat([w.detach() for w in weights], dim=0)
    return split_rows(quantize_with_spec(stacked, spec), [w.shape[0] for w in weights])


def split_rows(q: QTensor, sizes: list[int]) -> list[QTensor]:
    """A 1D-block QTensor (R, C) cut into row ranges (same tensor scale), bits unchanged."""
    if q.spec.is_2d:
        q = row_blocks(q)
    out, start = [], 0
    for n in sizes:
        rows = slice(start, start + n)
        out.append(QTensor(q.codes[rows], q.scales[rows], q.tensor_scale, q.spec,
                           (n, q.shape[1]), q.dtype,
                           zeros=None if q.zeros is None else q.zeros[rows]))
        start += n
    return out


def row_blocks(q: QTensor) -> QTensor:
    """(b, b) tiles as (1, b) row blocks: each row takes its tile's scale, codes unchanged
    (both pack the last dim padded to whole blocks of b)."""
    if not q.spec.is_2d:
        return q
    b = q.spec.block[1]
    spec = QuantSpec(q.spec.format, (1, b), q.spec.scale_rule, q.spec.rounding, q.spec.tensor_scale)
    scales = q.scales.repeat_interleave(b, dim=-2)[..., : q.shape[-2], :].contiguous()
    return QTensor(q.codes, scales, q.tensor_scale, spec, tuple(q.shape), q.dtype)


def weight_groups(model) -> list[list[tuple[str, torch.Tensor]]]:
    """The model's quantizable weights as fused groups of (Hugging Face module name, weight)."""
    groups = []
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}"
        attn = layer.self_attn
        groups.append([(f"{p}.self_attn.{n}", getattr(attn, n).weight)
                       for n in ("q_proj", "k_proj", "v_proj")])
        groups.append([(f"{p}.self_attn.o_proj", attn.o_proj.weight)])
        if layer.is_moe:
            experts = layer.mlp.experts
            F = experts.intermediate_dim
            for e in range(experts.num_experts):
                gu = experts.gate_up_proj[e]
                groups.append([(f"{p}.mlp.experts.{e}.gate_proj", gu[:F]),
                               (f"{p}.mlp.experts.{e}.up_proj", gu[F:])])
                groups.append([(f"{p}.mlp.experts.{e}.down_proj", experts.down_proj[e])])
        else:
            groups.append([(f"{p}.mlp.{n}", getattr(layer.mlp, n).weight)
                           for n in ("gate_proj", "up_proj")])
            groups.append([(f"{p}.mlp.down_proj", layer.mlp.down_proj.weight)])
    return groups


def _expert_slice(weights: Mapping[str, QTensor], name: str) -> QTensor | None:
    """Expert e's 2D QTensor from a 3D experts stack: `...experts.{e}.gate_up_proj` (2F, C) from
    `...experts.gate_up_proj` (E, 2F, C), `...experts.{e}.down_proj.weight` from
    `...experts.down_proj`; None if the mapping has no stack. One tensor scale for the stack."""
    parts = name.removesuffix(".weight").split(".")
    if len(parts) < 3 or parts[-3] != "experts" or not parts[-2].isdigit():
        return None
    stack = weights.get(".".join(parts[:-2] + [parts[-1]]))
    if stack is None:
        return None
    e = int(parts[-2])
    zeros = None if stack.zeros is None else stack.zeros[e]
    return QTensor(stack.codes[e], stack.scales[e], stack.tensor_scale, stack.spec,
                   tuple(stack.shape[1:]), stack.dtype, zeros=zeros)


def _lookup(weights: Mapping[str, QTensor], name: str) -> QTensor | None:
    found = weights.get(name)
    return found if found is not None else _expert_slice(weights, name)


def _given(weights: Mapping[str, QTensor], group, fmt: WeightFormat, spec: QuantSpec
           ) -> list[QTensor] | None:
    names = [name for name, _ in group]
    found = [_lookup(weights, f"{n}.weight") for n in names]
    if all(q is None for q in found) and names[0].endswith(".gate_proj") and ".experts." in names[0]:
        fused = _lookup(weights, names[0].removesuffix(".gate_proj") + ".gate_up_proj")
        if fused is not None:
            found = split_rows(row_blocks(fused), [group[0][1].shape[0], group[1][1].shape[0]])
    if all(q is None for q in found):
        return None
    if any(q is None for q in found):
        missing = [n for n, q in zip(names, found) if q is None]
        raise ValueError(f"weights has QTensors for part of the fused group {', '.join(names)} "
                         f"(not {', '.join(missing)}); give the whole group or none of it")
    out = []
    for (name, w), q in zip(group, found):
        if q.format != fmt.format_name or (fmt.is_int and q.spec.block != spec.block):
            raise ValueError(f"weights[{name}.weight] is {q.format} in blocks of "
                             f"{q.spec.block[0]}x{q.spec.block[1]}, not {fmt}: the export writes "
                             f"given weights as they are; export them with the format they have")
        if tuple(q.shape) != tuple(w.shape):
            raise ValueError(f"weights[{name}.weight] has shape {tuple(q.shape)}, the model's "
                             f"weight {tuple(w.shape)}")
        out.append(row_blocks(q))
    return out


def _tensor_scale(q: QTensor) -> torch.Tensor:
    # single-level NVFP4 (no tensor scale) is two-level with tensor scale 1: the same values
    return (q.tensor_scale if q.tensor_scale is not None
            else torch.ones((), dtype=torch.float32, device=q.device)).float().reshape(())


def export_model(model, out: str | Path, format: str | WeightFormat = "nvfp4",
                 layout: str | None = None,
                 weights: Mapping[str, QTensor] | None = None, scale_rule: str = "floor",
                 input_amax: Mapping[str, float] | None = None, tokenizer=None,
                 tokenizer_dir: str | Path | None = None, allow_unshared_scales: bool = False,
                 max_shard_bytes: int = 4 * 2**30, progress: bool = True) -> ExportReport:
    """Write `model` (a lowbit.models.Transformer, converted or not) to `out` in `layout`.

    format: "nvfp4" (layouts modelopt, compressed-tensors), "mxfp4" (compressed-tensors), or
        "int4" / "int8" with ":gG" / ":row" and ":asym" (compressed-tensors pack-quantized);
        lowbit.export.layouts.parse_export_format. layout None: modelopt for nvfp4, else
        compressed-tensors.
    weights: already-quantized weights by Hugging Face name (see the module docstring);
        groups not in it are quantized here, round to nearest.
    scale_rule: for mxfp4 weights lowbit quantizes ("floor" or "rceil").
    input_amax: module name -> activation amax from calibration (lowbit.export.calibrate);
        given, the checkpoint is W4A4 (NVFP4 activations with these static global scales),
        else weight-only (W4A16).
    tokenizer: a `tokenizers.Tokenizer` to save as tokenizer.json; tokenizer_dir: a folder
        whose tokenizer files (TOKENIZER_FILES) are copied.
    """
    from importlib.metadata import PackageNotFoundError, version

    try:
        __version__ = version("lowbit")
    except PackageNotFoundError:
        __version__ = "unknown"
    fmt = format if isinstance(format, WeightFormat) else parse_export_format(format)
    if fmt.name == "mxfp4":
        fmt = replace(fmt, scale_rule=None if scale_rule == "floor" else scale_rule)
    format = fmt.name
    layout = layout or FORMAT_LAYOUTS[format][0]
    if layout not in FORMAT_LAYOUTS[format]:
        raise ValueError(f"{format} has no {layout} layout; use --layout "
                         f"{' or '.join(FORMAT_LAYOUTS[format])}")
    if input_amax is not None and format != "nvfp4":
        raise ValueError("calibrated activations (W4A4) are written for nvfp4 only")
    out = Path(out)
    check_export_folder(out)
    out.mkdir(parents=True, exist_ok=True)
    names = tensor_names(layout)
    report = ExportReport(out, str(fmt), layout, activations="nvfp4" if input_amax is not None else "bf16")
    weights = weights or {}
    tensors: dict[str, torch.Tensor] = {}
    exact_scales: dict[str, str] = {}
    done: set[str] = set()   # parameter names written packed (or their expert stacks)

    groups = weight_groups(model)
    for group in tqdm(groups, desc="lowbit export", unit="group", disable=not progress):
        in_features = group[0][1].shape[1]
        spec = fmt.spec(in_features)
        # servers need whole blocks along the reduction dimension (integer kernels: whole
        # groups of 8 as well)
        if in_features % spec.block[1] or (fmt.is_int and in_features % 8):
            report.excluded.extend(name for name, _ in group)
            continue
        qs = _given(weights, group, fmt, spec)
        if qs is None:
            qs = quantize_group([w for _, w in group], spec)
        scales = [_tensor_scale(q) for q in qs] if format == "nvfp4" else []
        if len(scales) > 1 and not all(torch.equal(s, scales[0]) for s in scales) \
                and not allow_unshared_scales:
            raise ValueError(f"the fused group {', '.join(n for n, _ in group)} has different "
                             f"tensor scales; TensorRT-LLM needs one per group (quantize the group "
                             f"with lowbit.export.quantize_group), or pass --allow-unshared-scales")
        for (name, w), q in zip(group, qs):
            report.quantized.append(name)
            report.quantized_bf16_bytes += w.numel() * 2
            done.add(name)
            if fmt.is_int:
                packed = {f"{name}.{k}": t.cpu() for k, t in int_tensors(q).items()}
                tensors.update(packed)
                report.quantized_bytes += sum(t.nbytes for k, t in packed.items()
                                              if not k.endswith("weight_shape"))
                continue
            tensors[f"{name}.{names['codes']}"] = q.codes.contiguous().cpu()
            scale_tensor = q.scales.contiguous().cpu()
            tensors[f"{name}.{names['scales']}"] = scale_tensor
            if format == "nvfp4":
                s = _tensor_scale(q).cpu()
                if layout == "modelopt":
                    tensors[f"{name}.{names['tensor_scale']}"] = s.clone()
                else:
                    tensors[f"{name}.{names['tensor_scale']}"] = (1.0 / s).reshape(1)
                    exact_scales[name] = float(s).hex()   # float32 -> double: exact
                if input_amax is not None:
                    amax = torch.tensor(float(input_amax[name]), dtype=torch.float32)
                    act = tensor_scale_from_amax(amax)      # the engine's static scale too
                    tensors[f"{name}.{names['input_scale']}"] = (
                        act if layout == "modelopt" else (1.0 / act).reshape(1))
            report.quantized_bytes += q.nbytes

    # everything else in BF16, under its Hugging Face name (experts never: they are all packed
    # or, for a width not divisible by the block, written per expert in BF16 below)
    from lowbit.models.hf import hf_state_items
    for name, tensor in hf_state_items(model):
        module = name.rsplit(".", 1)[0]
        if module in done and name.endswith(".weight"):
            continue
        tensors[name] = tensor.detach().to("cpu", torch.bfloat16).contiguous()
    for i, layer in enumerate(model.model.layers):
        if layer.is_moe:
            report.excluded.append(f"model.layers.{i}.mlp.gate")
    report.excluded.insert(0, "lm_head")
    report.notes = reader_notes(fmt, layout, report.quantized)
    config = model.config
    report.bf16_total_bytes = sum(2 * t.numel() for _, t in hf_state_items(model))
    report.total_bytes = sum(t.numel() * t.element_size() for t in tensors.values())

    metadata = {"lowbit.export": json.dumps({"format": str(fmt), "layout": layout,
                                             "version": __version__})}
    if exact_scales:
        metadata["lowbit.tensor_scales"] = json.dumps(exact_scales)
    written = write_shards(out, ((name, tensors[name]) for name in sorted(tensors, key=_natural)),
                           metadata, max_shard_bytes)

    hf_config = hf_config_dict(config, torch.bfloat16)
    activations = input_amax is not None
    if layout == "modelopt":
        quant = modelopt_config(report.excluded, activations, __version__)
        written.append(write_text(out / "hf_quant_config.json", json.dumps(quant, indent=2) + "\n"))
        q = quant["quantization"]
        hf_config["quantization_config"] = {"quant_method": "modelopt", **q,
                                            "ignore": q["exclude_modules"]}
    elif fmt.is_int:
        hf_config["quantization_config"] = int_compressed_tensors_config(
            fmt, report.excluded, __version__)
    else:
        hf_config["quantization_config"] = compressed_tensors_config(
            format, report.excluded, activations, __version__)
    written.append(write_text(out / "config.json", json.dumps(hf_config, indent=2) + "\n"))
    written += _write_tokenizer(out, tokenizer, tokenizer_dir)
    _remove_stale(out, {p.name for p in written})
    return report


def export_bf16(model, out: str | Path, tokenizer=None, tokenizer_dir: str | Path | None = None,
                max_shard_bytes: int = 4 * 2**30) -> list[Path]:
    """A lowbit model as a plain Hugging Face folder in bf16 (`lowbit export --format bf16`):
    the weights as they are, Hugging Face's names and config, the tokenizer; what transformers,
    vLLM and `lowbit --model PATH` load with no quantization. The same file rules as
    export_model (atomic, symlink-safe, an earlier export's files removed). Returns the paths
    written."""
    out = Path(out)
    check_export_folder(out)
    out.mkdir(parents=True, exist_ok=True)
    written = write_shards(out, ((name, t.detach().to("cpu", torch.bfloat16).contiguous())
                                 for name, t in hf_state_items(model)), max_shard_bytes=max_shard_bytes)
    config = json.dumps(hf_config_dict(model.config, torch.bfloat16), indent=2) + "\n"
    written.append(write_text(out / "config.json", config))
    written += _write_tokenizer(out, tokenizer, tokenizer_dir)
    _remove_stale(out, {p.name for p in written})
    return written


def _write_tokenizer(out: Path, tokenizer, tokenizer_dir) -> list[Path]:
    """The tokenizer files of `tokenizer_dir` copied, or `tokenizer` saved as tokenizer.json."""
    written = []
    if tokenizer_dir is not None:
        for file in TOKENIZER_FILES:
            source = Path(tokenizer_dir) / file
            if source.is_file():
                write_atomic(out / file, lambda tmp, source=source: shutil.copyfile(source, tmp))
                written.append(out / file)
    elif tokenizer is not None:
        tok = getattr(tokenizer, "tokenizer", tokenizer)
        write_atomic(out / "tokenizer.json", lambda tmp: tok.save(str(tmp)))
        written.append(out / "tokenizer.json")
    return written


def check_export_folder(out: str | Path) -> None:
    """Refuse an `out` holding a `*.safetensors` file an export does not write (a QAT run's
    quantized.safetensors): servers load every safetensors file of a folder without an
    index, so it would be served beside the exported weights. Nothing is removed."""
    out = Path(out)
    if not out.is_dir():
        return
    foreign = sorted(p.name for p in out.glob("*.safetensors")
                     if p.name not in EXPORT_FILES and not _SHARD.match(p.name))
    if foreign:
        raise ValueError(f"{out} holds {', '.join(foreign)}, which lowbit export does not write "
                         f"and a server would load beside the exported weights; move "
                         f"{'it' if len(foreign) == 1 else 'them'} out of {out} or choose another "
                         f"--out")


def write_text(path: Path, text: str) -> Path:
    """`text` written to `path` through lowbit.files; returns `path` (the list of what an
    export wrote is built from it)."""
    write_text_atomic(path, text)
    return path


def _remove_stale(out: Path, written: set[str]) -> None:
    """Remove what a previous export wrote into `out` that this one did not write (and the
    temporary files of a killed export); files an export never writes are left alone."""
    def exported(name: str) -> bool:
        return name in EXPORT_FILES or bool(_SHARD.match(name))

    for path in out.iterdir():
        temp = TEMP_NAME.match(path.name)
        stale = (exported(path.name) and path.name not in written) or bool(temp and exported(temp[1]))
        if stale and not path.is_dir():
            path.unlink()


def _natural(name: str):
    return [int(p) if p.isdigit() else p for p in name.split(".")]
