"""The `lowbit` command: train, plot, qat, rl, inspect, bench, export.

Every command refuses bad input with one line, `lowbit: error: <what was wrong and what to
do>`, and exit code 2; no traceback (set LOWBIT_DEBUG=1 to see one).
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
import time

from lowbit.config import CALL_STARTED

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse would print the whole usage first)
        print(f"lowbit: error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        raise SystemExit(2)


def _add_inspect(sub) -> None:
    p = sub.add_parser(
        "inspect", help="what FP4/FP8/intK quantization does to a model's weights",
        description="Print, per tensor and format, SQNR (dB), relative error, the fraction of "
                    "values clipped and flushed to zero, and packed bytes against bf16.")
    p.add_argument("path", nargs="?", help="a .safetensors file or a folder of them (sharded checkpoint)")
    p.add_argument("--model", metavar="PATH",
                   help="a Hugging Face model folder: its decoder's linear and expert weights "
                        "(what lowbit export packs; --filter overrides)")
    p.add_argument("--random", metavar="SHAPE", help="inspect a random normal tensor of this shape, e.g. 4096x4096")
    p.add_argument("--formats", default="nvfp4,mxfp4,mxfp8_e4m3,int4",
                   help="comma-separated formats, each with optional :options "
                        "(floor, rceil, single, sr, RxC block), e.g. nvfp4,mxfp4:rceil:32x32 "
                        "(default: %(default)s)")
    p.add_argument("--filter", metavar="REGEX", help="only tensors whose name matches REGEX")
    p.add_argument("--skip-non-float", action="store_true", help="leave out integer/bool tensors instead of failing")
    p.add_argument("--seed", type=int, default=0, help="seed for --random and stochastic rounding")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    g = p.add_argument_group("gradients", "a trained run's weight-gradient bias and variance per "
                             "recipe (lowbit.diagnostics.gradients), instead of the weights")
    g.add_argument("--gradients", metavar="RUN_DIR",
                   help="a lowbit train run folder: its last checkpoint, its data's first batch")
    g.add_argument("--recipes", default="mxfp4,stable-fp4-1d,stable-fp4,stable-nvfp4-16x16,nvfp4",
                   help="comma-separated recipes (default: %(default)s)")
    g.add_argument("--draws", type=int, default=64, help="stochastic-rounding draws (default: 64)")
    g.add_argument("--operands", action="store_true",
                   help="also each GEMM operand alone (the others in high precision)")
    g.add_argument("--layers", action="store_true", help="print every layer, not only the model")
    g.add_argument("--plot", metavar="PNG", help="write the bars of bias and variance here")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: auto)")
    p.set_defaults(func=_run_inspect)


def _run_inspect(args) -> None:
    import torch

    from lowbit.diagnostics.inspect import (
        InspectError, format_table, inspect_tensors, iter_safetensors, parse_format, parse_shape,
        rows_to_json,
    )

    if args.gradients is not None:
        if args.path is not None or args.model is not None or args.random is not None:
            raise InspectError("--gradients reads a run folder: give no safetensors path, "
                               "--model or --random with it")
        _inspect_gradients(args)
        return
    if args.model is not None:
        from lowbit.models.hf import read_config
        if args.path is not None:
            raise InspectError("give the safetensors path or --model PATH, not both")
        read_config(args.model)   # refuses a folder lowbit cannot load, in one line
        args.path = args.model
        args.filter = args.filter or r"layers\.\d+\..*(proj)"
    formats = [parse_format(f) for f in args.formats.split(",") if f.strip()]
    if not formats:
        raise InspectError("--formats is empty; name at least one format, e.g. --formats nvfp4")
    if (args.path is None) == (args.random is None):
        raise InspectError("give either a safetensors path or --random SHAPE (not both, not neither)")
    if args.random:
        shape = parse_shape(args.random)
        g = torch.Generator().manual_seed(args.seed)
        tensors = [(f"random[{args.random}]", torch.randn(shape, generator=g))]
        total = 1
    else:
        total, tensors = iter_safetensors(args.path, args.skip_non_float, args.filter)
        if not total:
            raise InspectError(f"no tensors in {args.path}" + (f" match {args.filter!r}" if args.filter else ""))
    rows = inspect_tensors(tensors, formats, total=total, progress=not args.no_progress, seed=args.seed)
    print(rows_to_json(rows) if args.json else format_table(rows))


def _inspect_gradients(args) -> None:
    """`lowbit inspect --gradients RUN_DIR`: the run's checkpointed weights (config from the
    checksummed checkpoint), its data's first training batch, each recipe's gradient bias and
    variance against the run's high-precision gradient."""
    import dataclasses
    import json
    from pathlib import Path

    from tqdm import tqdm

    from lowbit.diagnostics.gradients import OPERANDS, format_report, gradient_bias_variance, plot_report
    from lowbit.train.build import build_data, build_model
    from lowbit.train.config import resolve_device
    from lowbit.train.run_dir import RunDir

    run = Path(args.gradients)
    if not run.is_dir():
        raise ValueError(f"--gradients {run} is not a folder; give a lowbit train run folder")
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    if not recipes:
        raise ValueError("--recipes is empty; name at least one recipe, e.g. --recipes mxfp4")
    device = resolve_device(args.device)
    saved = RunDir(run).open_train_run(allow_unfinished=True, use="inspect the gradients of")
    config = dataclasses.replace(saved.config, recipe="bf16", progress=False)
    data = build_data(config)
    model = build_model(config, data.vocab_size)
    model.load_state_dict(saved.state["model"])
    del saved
    idx, targets = (t.to(device) for t in data.train_batch(0))
    bar = tqdm(total=len(recipes) * (1 + len(OPERANDS) * bool(args.operands)), unit="config",
               desc="gradients", disable=args.no_progress, file=sys.stderr)

    def advance(recipe, operands, taken):
        bar.set_postfix_str(f"{recipe} {operands}: {taken} draws")
        bar.update()

    try:
        report = gradient_bias_variance(model.to(device), idx, targets, recipes, draws=args.draws,
                                        operands=args.operands, seed=args.seed, progress=advance)
    finally:
        bar.close()
    if args.json:   # a results file as docs/results keeps them: meta (date, commit, machine, command)
        from lowbit.bench import run_meta

        print(json.dumps({"meta": run_meta(device.type), "results": {
            "run": str(run), "draws": args.draws, "rows": [dataclasses.asdict(r) for r in report.rows]}},
            indent=1))
    else:
        print(format_report(report, layers=args.layers))
    if args.plot:
        plot_report(report, args.plot)
        print(f"plot: {args.plot}", file=sys.stderr if args.json else sys.stdout)


def _command(sub, name: str, add_arguments, run, help: str, description: str | None = None) -> None:
    """One subcommand: its parser, the module's add_arguments(parser) and run(args)."""
    p = sub.add_parser(name, help=help, description=description)
    add_arguments(p)
    p.set_defaults(func=run)


def _add_train(sub) -> None:
    from lowbit.train.cli_args import add_plot_arguments, add_train_arguments, run_plot, run_train

    _command(sub, "train", add_train_arguments, run_train,
             help="pretrain a language model with a quantized-training recipe",
             description="Train a built-in LLaMA-style model. With no arguments: the tiny preset "
                         "on Tiny Shakespeare with the stable-fp4 recipe, on the CPU in about "
                         "two minutes.")
    _command(sub, "plot", add_plot_arguments, run_plot,
             help="redraw the loss curves of run folders in one figure")


def _add_qat(sub) -> None:
    from lowbit.qat.cli_args import add_qat_arguments, run_qat_command

    _command(sub, "qat", add_qat_arguments, run_qat_command,
             help="quantization-aware training to 1-4-bit weights (ste, lsq, jacquant)",
             description="Fine-tune a trained model with its weights fake-quantized (intK, "
                         "ternary, binary, seq2, nvfp4, mxfp4), with a choice of gradient "
                         "estimator, against BF16, round-to-nearest and GPTQ. With no arguments: "
                         "a tiny BF16 model on Tiny Shakespeare (trained first, cached), QAT to "
                         "int2:g32 with jacquant, on the CPU in about two minutes.")


def _add_bench(sub) -> None:
    from lowbit import bench

    _command(sub, "bench", bench.add_arguments, bench.run,
             help="benchmarks: step time and memory of training recipes",
             description="Speed and memory of recipes, printed as tables with ratios to a "
                         "baseline measured in the same run.")


def _add_export(sub) -> None:
    from lowbit.export.cli_args import add_export_arguments, run_export

    _command(sub, "export", add_export_arguments, run_export,
             help="write a servable low-bit Hugging Face folder (NVFP4, MXFP4, int4/int8)",
             description="Pack a model's linear and expert weights as NVFP4 (ModelOpt or "
                         "compressed-tensors layout), MXFP4 or int4/int8 (compressed-tensors), "
                         "everything else BF16, for vLLM, SGLang or TensorRT-LLM; a QAT run's "
                         "trained weights as they are; see docs/models.md.")


def _add_rl(sub) -> None:
    from lowbit.rl.cli_args import add_rl_arguments, run_rl_command

    _command(sub, "rl", add_rl_arguments, run_rl_command,
             help="GRPO with low-precision rollouts (bf16, fp8, NVFP4, QUADS)",
             description="Reinforcement learning on a verifiable task with a separate rollout "
                         "engine in low precision. With no arguments: a tiny policy warm-started "
                         "on one-digit addition, then GRPO with NVFP4 rollouts and QUADS "
                         "alignment, on the CPU in a few minutes.")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="lowbit", description="Train LLMs in 4-bit and lower precision.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    _add_inspect(sub)
    _add_train(sub)
    _add_qat(sub)
    _add_bench(sub)
    _add_export(sub)
    _add_rl(sub)
    return parser


def _version() -> str:
    from lowbit import __version__
    return f"lowbit {__version__}"


def main(argv: list[str] | None = None) -> int:
    # the command's start, which --stop-after-minutes counts from (lowbit.config.
    # call_started); the processes of parallel runs inherit it; put back on return
    before = os.environ.get(CALL_STARTED)
    os.environ[CALL_STARTED] = repr(time.time())
    try:
        return _main(argv)
    finally:
        if before is None:
            os.environ.pop(CALL_STARTED, None)
        else:
            os.environ[CALL_STARTED] = before


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        args.func(args)
    except (ValueError, FileNotFoundError) as e:
        if os.environ.get("LOWBIT_DEBUG"):
            raise
        print(f"lowbit: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `lowbit inspect ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as e:  # a path that is a file, not writable, ...: the path and the reason
        if os.environ.get("LOWBIT_DEBUG"):
            raise
        where = f"{e.filename}: " if e.filename else ""
        advice = ("free space on its disk, or choose another path" if e.errno == errno.ENOSPC
                  else "check the path, or choose another")
        print(f"lowbit: error: {where}{(e.strerror or str(e)).lower()}; {advice}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # lowbit.train's says the step, checkpoint and --resume
        print(f"lowbit: interrupted {e}".rstrip(), file=sys.stderr)
        return 130
    except RuntimeError as e:
        if type(e).__name__ != "OutOfMemoryError" or os.environ.get("LOWBIT_DEBUG"):
            raise
        print(f"lowbit: error: {out_of_memory_message(args.command, str(e))}", file=sys.stderr)
        return 1
    return 0


OUT_OF_MEMORY_ADVICE = {
    "rl": "lower --micro-batch-size (the trainer's passes run on that many completions at a "
          "time, e.g. 16) or --prompts-per-step",
    "train": "lower --batch-size and raise --grad-accum-steps by the same factor (the same "
             "tokens per step)",
    "qat": "lower --batch-size",
    "bench": "lower --batch-size, --seq-len or the shapes measured",
}


def out_of_memory_message(command: str, error: str) -> str:
    """One line for torch.OutOfMemoryError: what ran out (the error's first two sentences,
    e.g. "CUDA out of memory. Tried to allocate 10.29 GiB") and what to change."""
    what = ". ".join(error.split(". ")[:2]).rstrip(".")
    return f"out of memory ({what}): {OUT_OF_MEMORY_ADVICE.get(command, 'free GPU memory, or run on a larger GPU')}"


if __name__ == "__main__":
    sys.exit(main())
