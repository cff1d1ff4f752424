"""`lowbit export RUN_OR_MODEL --format nvfp4 [--layout modelopt|compressed-tensors] --out DIR`.

RUN_OR_MODEL is a Hugging Face model folder, or a finished `lowbit train` run folder (its last
checkpoint; a run without final.json, stopped or still running, only with --allow-unfinished,
and never while another lowbit process holds it). A run whose tokenizer is BPE gets it trained
again from its corpus, which must be the corpus the run trained on (the checkpoint's data
fingerprint), or the token ids would not be the model's. A run folder holding `quantized.safetensors` (lowbit.save_qtensors, keys the
Hugging Face weight names: what a `lowbit qat` run writes) exports those packed weights as they
are; the rest of the model is quantized round to nearest. A QAT run exports in the format it
trained (the default --format there); another --format is refused, since its weights would
have to be quantized again.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


from lowbit.export.layouts import FORMAT_LAYOUTS, parse_export_format
from lowbit.export.source import (check_apart, corpus_calibration_batches, export_format,
                                  load_source)

__all__ = ["add_export_arguments", "run_export"]


def add_export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", metavar="RUN_OR_MODEL",
                   help="a Hugging Face model folder or a lowbit train run folder")
    p.add_argument("--format", default=None,
                   help="weight format: nvfp4, mxfp4, int4 or int8 (with :gG or :row, and :asym; "
                        "int4's default g128, int8's row), or bf16: a plain Hugging Face folder, unquantized "
                        "(default: a QAT run's own format, else nvfp4)")
    p.add_argument("--layout", default=None, choices=("modelopt", "compressed-tensors"),
                   help="checkpoint layout (default: modelopt for nvfp4, compressed-tensors "
                        "for mxfp4, which ModelOpt has no layout for)")
    p.add_argument("--out", required=True, metavar="DIR", help="folder to write")
    p.add_argument("--scale-rule", default="floor", choices=("floor", "rceil"),
                   help="mxfp4 block scales for weights lowbit quantizes (default: floor)")
    p.add_argument("--activations", default="bf16", choices=("bf16", "nvfp4"),
                   help="bf16: weight-only (W4A16); nvfp4: W4A4 with static activation scales "
                        "calibrated on --calib-corpus (default: bf16)")
    p.add_argument("--calib-corpus", default="tinyshakespeare", metavar="NAME",
                   help="corpus for --activations nvfp4 (default: tinyshakespeare)")
    p.add_argument("--calib-batches", type=int, default=8, metavar="N",
                   help="calibration batches of 4 x 256 tokens (default: 8)")
    p.add_argument("--allow-unshared-scales", action="store_true",
                   help="write given QTensors of a fused group (q/k/v, gate/up) that carry "
                        "different tensor scales as they are (vLLM takes their max)")
    p.add_argument("--overwrite", action="store_true", help="write into a folder that has files")
    p.add_argument("--allow-unfinished", action="store_true",
                   help="export a run folder that has no final.json (it stopped before its "
                        "last step) from its last checkpoint")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_export(args: argparse.Namespace) -> None:
    from lowbit.export import calibrate_input_amax, export_model
    from lowbit.export.writer import check_export_folder, write_text
    from lowbit.models.hf import load_tokenizer

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder; choose another --out")
    check_apart(Path(args.source), out)
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        raise ValueError(f"{out} is not empty; pass --overwrite or choose another --out")
    check_export_folder(out)
    if args.calib_batches < 1:
        raise ValueError("--calib-batches must be >= 1")
    plain = args.format is not None and args.format.strip().lower() == "bf16"
    if plain and (args.layout is not None or args.activations != "bf16"):
        raise ValueError("--format bf16 writes a plain Hugging Face folder: it takes no --layout "
                         "and no --activations nvfp4")
    if args.format is not None and not plain:
        parse_export_format(args.format)   # a bad format: refused before anything loads
    model, weights, tokenizer, tokenizer_dir, trained = load_source(args.source,
                                                                    args.allow_unfinished)
    if tokenizer_dir is not None:   # a run trained from a model folder copies its tokenizer
        check_apart(Path(tokenizer_dir), out, "the run's model folder")
    if plain:
        if trained is not None:
            raise ValueError(f"{args.source} trained {trained} weights (QAT), which export as they "
                             f"are: use --format {trained} (or leave --format out); --format bf16 "
                             f"writes a train run's or a model folder's weights")
        from lowbit.export.writer import export_bf16
        written = export_bf16(model, out, tokenizer=tokenizer, tokenizer_dir=tokenizer_dir)
        write_text(out / "lowbit_export.json", json.dumps({
            "source": str(args.source), "format": "bf16", "files": sorted(p.name for p in written)},
            indent=2) + "\n")
        print(f"lowbit export: {args.source} -> {out} as a plain Hugging Face folder in bf16 "
              f"({len(written)} files)")
        return
    fmt = export_format(args.format, trained, args.source)
    layout = args.layout or FORMAT_LAYOUTS[fmt.name][0]   # export_model checks the pair
    input_amax = None
    if args.activations == "nvfp4":
        tok = tokenizer or (load_tokenizer(tokenizer_dir) if tokenizer_dir else None)
        input_amax = calibrate_input_amax(
            model, corpus_calibration_batches(model, tok, args.calib_corpus, args.calib_batches))
    report = export_model(model, out, format=fmt, layout=layout, weights=weights,
                          scale_rule=args.scale_rule, input_amax=input_amax,
                          tokenizer=tokenizer, tokenizer_dir=tokenizer_dir,
                          allow_unshared_scales=args.allow_unshared_scales,
                          progress=not args.no_progress)
    print(report)
    for note in report.notes:
        print(f"lowbit: warning: {note}", file=sys.stderr)
    write_text(out / "lowbit_export.json", json.dumps({
        "source": str(args.source), "format": str(fmt), "layout": layout,
        "activations": args.activations, "packed_weights": len(report.quantized),
        "excluded": report.excluded, "quantized_bytes": report.quantized_bytes,
        "quantized_bf16_bytes": report.quantized_bf16_bytes, "weight_ratio": report.weight_ratio,
        "total_bytes": report.total_bytes, "bf16_total_bytes": report.bf16_total_bytes,
        "total_ratio": report.total_ratio,
        "qat_weights_given": 0 if weights is None else len(weights),
        "reader_notes": report.notes}, indent=2) + "\n")
