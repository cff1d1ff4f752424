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

import torch

from lowbit.export.layouts import FORMAT_LAYOUTS, ExportFormat, parse_export_format

__all__ = ["add_export_arguments", "run_export", "load_source", "master_weights", "export_format"]


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


def load_source(source: str | Path, allow_unfinished: bool = False):
    """(model in float32, weights mapping or None, tokenizer or None, tokenizer folder or None,
    the QAT run's weight format or None) of a Hugging Face folder or a run folder; a run folder
    another process holds, or without final.json (unless allow_unfinished), is refused."""
    from lowbit.models import load_model
    from lowbit.train.run_dir import RunDir

    path = Path(source)
    if not path.exists():
        raise ValueError(f"no such run or model folder: {path}")
    run = RunDir(path)
    if run.checkpoint.is_file():
        run.check_free()   # a live run's checkpoint is not the model it will end with
        if not (path / "final.json").is_file() and not allow_unfinished:
            raise ValueError(f"{path} holds an unfinished run (no final.json: it stopped before "
                             f"its last step); finish it with --resume, or pass "
                             f"--allow-unfinished to export its last checkpoint")
        return _load_run(path)
    model, tokenizer, _ = load_model(path, dtype=torch.float32)
    return model, None, tokenizer, path, None


def _load_run(path: Path):
    from lowbit.formats import load_qtensors
    from lowbit.models import build_model, is_model_folder
    from lowbit.train.build import model_config
    from lowbit.train.checkpoint import load_checkpoint
    from lowbit.train.config import TrainConfig
    from lowbit.train.run_dir import RunDir

    checkpoint = load_checkpoint(RunDir(path).checkpoint)
    config = TrainConfig.from_dict(checkpoint["config"])
    state = checkpoint["model"]
    vocab = state["model.embed_tokens.weight"].shape[0]
    model = build_model(model_config(config, vocab))
    model.load_state_dict(master_weights(state))
    weights = None
    if (path / "quantized.safetensors").is_file():
        weights = load_qtensors(path / "quantized.safetensors")
    trained = None
    if config.qat is not None:
        trained = config.qat["weights"]
        if weights is None:
            raise ValueError(f"{path} is a QAT run without quantized.safetensors (its packed "
                             f"weights, written when the run finishes); finish it with "
                             f"`lowbit qat ... --resume`")
    tokenizer, tokenizer_dir = None, None
    if is_model_folder(config.model):
        tokenizer_dir = Path(config.model)
    elif config.tokenizer == "bpe":
        tokenizer = _run_tokenizer(path, config, checkpoint.get("data_fingerprint"))
    return model.eval(), weights, tokenizer, tokenizer_dir, trained


def _run_tokenizer(path: Path, config, fingerprint: str | None):
    """A BPE run's tokenizer, trained again from its corpus as the run built it
    (lowbit.train.build.build_data). Its ids are the model's only on the corpus the run read:
    the tokens' fingerprint must be the checkpoint's (checkpoints without one are taken as they
    are)."""
    from lowbit.data import data_root
    from lowbit.train.build import build_data

    data = build_data(config)
    if fingerprint is not None and data.fingerprint != fingerprint:
        where = "" if config.corpus == "pycode" else f" in {data_root(config.data_dir)}"
        raise ValueError(f"cannot export {path}: its BPE tokenizer is trained again from corpus "
                         f"{config.corpus}{where}, which is not the text the run trained on "
                         f"(tokens' fingerprint {data.fingerprint[:12]}, the checkpoint's "
                         f"{fingerprint[:12]}), so its ids would not be the model's; restore that "
                         f"corpus there")
    return data.dataset.tokenizer


def master_weights(state: dict) -> dict:
    """A model state dict with parametrized weights (a QAT checkpoint's
    `m.parametrizations.weight.original` and its quantizer's state) as plain `m.weight`."""
    out = {}
    for name, tensor in state.items():
        if ".parametrizations." not in name:
            out[name] = tensor
        elif name.endswith(".original"):
            module, _, rest = name.partition(".parametrizations.")
            out[f"{module}.{rest.removesuffix('.original')}"] = tensor
    return out


def export_format(requested: str | None, trained: str | None, source) -> ExportFormat:
    """The format to write: the requested one, or a QAT run's own; a QAT run asked for another
    format (which would quantize its trained weights again) is refused. For a QAT run, `int4`
    names its int4 weights whatever their groups; `int4:g64` or `int4:asym` must be theirs."""
    if trained is None:
        return parse_export_format(requested or "nvfp4")
    try:
        own = parse_export_format(trained)
    except ValueError as e:
        raise ValueError(f"{source} trained {trained} weights (QAT): {e}") from None
    if requested is None:
        return own
    asked = parse_export_format(requested)
    # options left out (int4 for an int4:g32:asym run) are the run's; options named must match
    options = [o.strip() for o in requested.lower().split(":")[1:]]
    group_named = any(o == "row" or o.startswith("g") for o in options)
    if (asked.name != own.name or ("asym" in options and not own.asym)
            or (group_named and asked.group != own.group)):
        raise ValueError(f"{source} trained {trained} weights (QAT), which export as they are; "
                         f"--format {requested} would quantize them again: use --format {own} "
                         f"(or leave --format out)")
    return own


def _calibration_batches(model, tokenizer, corpus: str, n: int):
    from lowbit.data import BPETokenizer, load_corpus

    if tokenizer is None:
        raise ValueError("--activations nvfp4 calibrates on text, which needs the model's "
                         "tokenizer (tokenizer.json); this source has none")
    tok = tokenizer if hasattr(tokenizer, "encode_array") else BPETokenizer(tokenizer)
    text = load_corpus(corpus).splits["train"][: 4 * 256 * n * 8]
    ids = torch.from_numpy(tok.encode_array(text).astype("int64"))
    seq = min(256, model.config.max_seq_len)
    usable = (len(ids) // seq) * seq
    if usable < seq:
        raise ValueError(f"corpus {corpus} is too short to calibrate")
    windows = ids[:usable].view(-1, seq)
    return [windows[i:i + 4] for i in range(0, min(len(windows), 4 * n), 4)]


def _check_apart(source: Path, out: Path, what: str = "the source folder") -> None:
    """Refuse an --out that is `source`, holds it or lies inside it (symlinks resolved): the
    export would write over what it reads."""
    src, dst = source.resolve(), out.resolve()
    if dst == src:
        where = f"is {what}"
    elif dst.is_relative_to(src):
        where = f"lies inside {what} {source}"
    elif src.is_relative_to(dst):
        where = f"holds {what} {source}"
    else:
        return
    raise ValueError(f"--out {out} {where}, and the export would write over what it reads; "
                     f"choose an --out outside {source}")


def run_export(args: argparse.Namespace) -> None:
    from lowbit.export import calibrate_input_amax, export_model
    from lowbit.export.writer import check_export_folder, write_text
    from lowbit.models.hf import load_tokenizer

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder; choose another --out")
    _check_apart(Path(args.source), out)
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
        _check_apart(Path(tokenizer_dir), out, "the run's model folder")
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
            model, _calibration_batches(model, tok, args.calib_corpus, args.calib_batches))
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
