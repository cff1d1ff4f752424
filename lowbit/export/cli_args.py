"""`lowbit export RUN_OR_MODEL --format nvfp4 [--layout modelopt|compressed-tensors] --out DIR`.

RUN_OR_MODEL is a Hugging Face model folder, or a finished `lowbit train` run folder (its last
checkpoint; a run without final.json, stopped or still running, only with --allow-unfinished,
and never while another lowbit process holds it). A run whose tokenizer is BPE gets it trained
again from its corpus, which must be the corpus the run trained on (the checkpoint's data
fingerprint), or the token ids would not be the model's. A run folder holding
`quantized.safetensors` (lowbit.save_qtensors, keys the Hugging Face weight names: what a
`lowbit qat` run writes) exports those packed weights as they
are; the rest of the model is quantized round to nearest. A QAT run exports in the format it
trained (the default --format there); another --format is refused, since its weights would
have to be quantized again.

The flags are ExportConfig's fields (lowbit.export.config), which checks their values where the
command line builds it; run_export checks the folders, then loads and writes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


from lowbit.config import add_flags, flag_values
from lowbit.export.config import ExportConfig
from lowbit.export.source import (check_apart, corpus_calibration_batches, export_format,
                                  load_source)

__all__ = ["add_export_arguments", "run_export", "config_from_args"]


def add_export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", metavar="RUN_OR_MODEL",
                   help="a Hugging Face model folder or a lowbit train run folder")
    # the flags ExportConfig's fields declare (--format, --layout, --out, ...)
    add_flags(p, ExportConfig)


def config_from_args(args: argparse.Namespace) -> ExportConfig:
    """The ExportConfig of the command line: the flags given, the fields' defaults for the rest."""
    return ExportConfig(source=args.source, **flag_values(args, ExportConfig))


def run_export(args: argparse.Namespace) -> None:
    from lowbit.export import calibrate_input_amax, export_model
    from lowbit.export.writer import check_export_folder, write_text
    from lowbit.models.hf import load_tokenizer

    config = config_from_args(args)
    out = Path(config.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder; choose another --out")
    check_apart(Path(config.source), out)
    if out.exists() and any(out.iterdir()) and not config.overwrite:
        raise ValueError(f"{out} is not empty; pass --overwrite or choose another --out")
    check_export_folder(out)
    model, weights, tokenizer, tokenizer_dir, trained = load_source(config.source,
                                                                    config.allow_unfinished)
    if tokenizer_dir is not None:   # a run trained from a model folder copies its tokenizer
        check_apart(Path(tokenizer_dir), out, "the run's model folder")
    if config.plain_bf16:
        if trained is not None:
            raise ValueError(f"{config.source} trained {trained} weights (QAT), which export as "
                             f"they are: use --format {trained} (or leave --format out); --format bf16 "
                             f"writes a train run's or a model folder's weights")
        from lowbit.export.writer import export_bf16
        written = export_bf16(model, out, tokenizer=tokenizer, tokenizer_dir=tokenizer_dir)
        write_text(out / "lowbit_export.json", json.dumps({
            "source": str(config.source), "format": "bf16",
            "files": sorted(p.name for p in written)}, indent=2) + "\n")
        print(f"lowbit export: {config.source} -> {out} as a plain Hugging Face folder in bf16 "
              f"({len(written)} files)")
        return
    fmt = export_format(config.weight_format, trained, config.source, text=config.format)
    input_amax = None
    if config.activations == "nvfp4":
        tok = tokenizer or (load_tokenizer(tokenizer_dir) if tokenizer_dir else None)
        batches = corpus_calibration_batches(model, tok, config.calib_corpus, config.calib_batches)
        input_amax = calibrate_input_amax(model, batches)
    report = export_model(model, out, format=fmt, layout=config.layout, weights=weights,
                          scale_rule=config.scale_rule, input_amax=input_amax,
                          tokenizer=tokenizer, tokenizer_dir=tokenizer_dir,
                          allow_unshared_scales=config.allow_unshared_scales,
                          progress=config.progress)
    print(report)
    for note in report.notes:
        print(f"lowbit: warning: {note}", file=sys.stderr)
    write_text(out / "lowbit_export.json", json.dumps({
        "source": str(config.source), "format": str(fmt), "layout": report.layout,
        "activations": config.activations, "packed_weights": len(report.quantized),
        "excluded": report.excluded, "quantized_bytes": report.quantized_bytes,
        "quantized_bf16_bytes": report.quantized_bf16_bytes, "weight_ratio": report.weight_ratio,
        "total_bytes": report.total_bytes, "bf16_total_bytes": report.bf16_total_bytes,
        "total_ratio": report.total_ratio,
        "qat_weights_given": 0 if weights is None else len(weights),
        "reader_notes": report.notes}, indent=2) + "\n")
