"""Command-line glue for `lowbit train` and `lowbit plot`.

lowbit/cli.py owns the parser; these functions add the subcommands' flags and run them.
Every flag maps to one TrainConfig field (the field's docstring is the long help). Flags
default to None, meaning "TrainConfig's default", so that config_from_args can tell what the
user actually set. Bad values raise ValueError with a one-line message, which cli.py prints
as `lowbit: error: <message>` before exiting with code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from lowbit.train.compare import compare, format_table, parse_seeds
from lowbit.train.config import FINE_TUNE_LR, TrainConfig
from lowbit.train.loop import NonFiniteLossError, train
from lowbit.train.plot import plot_runs

_DEFAULT = TrainConfig()

# (flag, TrainConfig field, type, help), in the order `lowbit train --help` lists them.
_VALUE_FLAGS: list[tuple[str, str, type, str]] = [
    ("--model", "model", str, "model preset (tiny, small, 100m, 1b) or PATH of a Hugging Face "
     "model folder (Llama, Qwen2, Qwen3, Qwen3-MoE), trained with its own tokenizer"),
    ("--n-layers", "n_layers", int, "override the preset's depth"),
    ("--dim", "dim", int, "override the preset's width (64-dim heads)"),
    ("--n-experts", "n_experts", int, "override the preset's MoE experts (0: dense)"),
    ("--dropout", "dropout", float, "override the preset's dropout"),
    ("--corpus", "corpus", str, "tinyshakespeare, wikitext2, gutenberg, english, pycode"),
    ("--tokenizer", "tokenizer", str, "bytes or bpe"),
    ("--bpe-vocab-size", "bpe_vocab_size", int, "vocabulary of the BPE tokenizer"),
    ("--corpus-max-bytes", "corpus_max_bytes", int, "cut each split of the corpus to this many bytes"),
    ("--data-dir", "data_dir", str, "folder of the corpora (default: lowbit.data's)"),
    ("--seq-len", "seq_len", int, "tokens per training sequence"),
    ("--batch-size", "batch_size", int, "sequences per micro-batch"),
    ("--grad-accum-steps", "grad_accum_steps", int, "micro-batches per optimizer step"),
    ("--steps", "max_steps", int, "optimizer steps to train for; a small number shortens the "
     "run (e.g. --steps 20 for CI), the warmup shrinks to fit unless --warmup-steps is given"),
    ("--tokens", "max_tokens", int, "train for this many tokens instead of --steps"),
    ("--lr", "lr", float, "peak learning rate (default 2e-3; 2e-5 with --model PATH, which fine-tunes)"),
    ("--min-lr-ratio", "min_lr_ratio", float, "final learning rate as a fraction of --lr"),
    ("--warmup-steps", "warmup_steps", int, "linear warmup steps"),
    ("--weight-decay", "weight_decay", float, "AdamW weight decay (matrices only)"),
    ("--betas", "betas", str, "AdamW betas as two comma-separated numbers"),
    ("--grad-clip", "grad_clip", float, "clip the gradient norm to this (0: no clipping)"),
    ("--eval-every", "eval_every", int, "steps between evaluations (0: only at the end)"),
    ("--eval-batches", "eval_batches", int, "validation micro-batches per evaluation"),
    ("--log-every", "log_every", int, "steps between metrics records"),
    ("--diag-every", "diag_every", int, "steps between diagnostics"),
    ("--checkpoint-every", "checkpoint_every", int,
     "steps between checkpoints (0: only at the end)"),
    ("--keep-checkpoints", "keep_checkpoints", int,
     "checkpoints kept, the newest and those before it (a damaged one falls back to the previous)"),
    ("--max-consecutive-nonfinite", "max_consecutive_nonfinite", int,
     "stop after this many NaN/Inf steps in a row"),
    ("--seed", "seed", int, "seed of the init, dropout and data order"),
    ("--device", "device", str, "auto, cpu, cuda or cuda:N"),
    ("--parallel", "parallel", str, "under torchrun: ddp (replicate) or fsdp (shard with FSDP2)"),
    ("--recipe", "recipe", str, "quantized-training recipe (bf16: none)"),
    ("--fold-inexact", "fold_inexact", str,
     "FP8-GEMM recipes, a step whose one-chunk folds rounded values: redo (exactly), adapt "
     "(redo, and move the layers that needed it to the emulated path) or round (keep it, log "
     "the count)"),
    ("--out-dir", "out_dir", str, "parent folder of run folders"),
    ("--run-name", "run_name", str, "run folder name (default: <model>-<corpus>-<recipe>)"),
]


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    for flag, field, kind, text in _VALUE_FLAGS:
        default = getattr(_DEFAULT, field)
        if field == "betas":
            default = ",".join(str(b) for b in default)
        shown = f" (default: {default})" if default not in (None, "") else ""
        metavar = "DIR" if field.endswith("dir") else {int: "N", float: "X"}.get(kind, "NAME")
        parser.add_argument(flag, dest=field, type=kind, default=None, metavar=metavar,
                            help=text + shown)
    parser.add_argument("--no-bf16-autocast", action="store_true",
                        help="on CUDA, compute in fp32 instead of under bf16 autocast")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="replay each step from one CUDA graph (one GPU, dense model; with "
                             "--compile, the compiled model): a quantized step is then not "
                             "host-bound")
    parser.add_argument("--no-diagnostics", action="store_true",
                        help="skip the gradient-bias / operand-consistency diagnostics")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar, step or evaluation lines: the run prints its start "
                             "and done lines only (metrics are still written)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run folder's checkpoint (same flags as before)")
    parser.add_argument("--overwrite", action="store_true",
                        help="start over in a run folder that already holds a run")
    parser.add_argument("--compare", metavar="RECIPES", default=None,
                        help="train each of these comma-separated recipes on the same data "
                             "and seed, e.g. bf16,mxfp4, then plot and tabulate them")
    parser.add_argument("--seeds", metavar="SEEDS", default=None,
                        help="with --compare: run every recipe at each of these comma-separated "
                             "seeds (e.g. 0,1,2; same data order per seed) and tabulate the "
                             "gaps to the first recipe as mean ± sd over the paired seeds")
    parser.add_argument("--parallel-runs", metavar="N", type=int, default=1,
                        help="with --compare: train N runs at once, each in a process of its "
                             "own (on one GPU, they share it; default: 1, one after another)")




def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig the flags describe (for --compare: the first recipe's). With --resume,
    what the run folder's config.json holds for every value flag not given (`lowbit train
    --steps 50` then `lowbit train --resume` continues that run, as TRL's and torchtitan's
    resumes take the saved run); the checkpoint's config is checked against it on load."""
    fields = {field: getattr(args, field) for _, field, _, _ in _VALUE_FLAGS
              if getattr(args, field) is not None}
    if getattr(args, "resume", False) and args.compare is None:
        fields = {**_saved_fields(fields), **fields}
    if "betas" in fields:
        fields["betas"] = _parse_betas(fields["betas"])
    if "model" in fields:
        from lowbit.models import is_model_folder
        if is_model_folder(fields["model"]):
            fields.setdefault("tokenizer", "model")
            fields.setdefault("lr", FINE_TUNE_LR)   # a trained model: fine-tuning's rate, not pretraining's
    if args.compare is not None:
        if "recipe" in fields:
            raise ValueError("--compare names the recipes; drop --recipe")
        fields["recipe"] = _parse_recipes(args.compare)[0]
        if args.seeds is not None:
            if "seed" in fields:
                raise ValueError("--seeds names the seeds of the comparison; drop --seed")
            fields["seed"] = parse_seeds(args.seeds)[0]
    elif args.seeds is not None or args.parallel_runs != 1:
        raise ValueError("--seeds and --parallel-runs go with --compare R1,R2,...")
    fields["bf16_autocast"] = not args.no_bf16_autocast
    fields["compile"] = args.compile
    fields["cuda_graph"] = args.cuda_graph
    fields["diagnostics"] = not args.no_diagnostics
    fields["progress"] = not args.no_progress
    if "warmup_steps" not in fields:
        # A run shortened with --steps keeps a tenth of itself for warmup, so that
        # `lowbit train --steps 20` works without also having to pass --warmup-steps.
        steps = TrainConfig(**{**fields, "warmup_steps": 0}).total_steps
        fields["warmup_steps"] = min(_DEFAULT.warmup_steps, steps // 10)
    return TrainConfig(**fields)


def _saved_fields(given: dict) -> dict:
    """The value-flag fields of the run folder the given flags name (its config.json), or {}
    where there is none (a resume of nothing is refused later, with its own message)."""
    import json
    from pathlib import Path

    naming = TrainConfig(**{k: v for k, v in given.items()
                            if k in ("model", "corpus", "recipe", "run_name", "out_dir")})
    saved_file = Path(naming.out_dir) / naming.name / "config.json"
    if not saved_file.is_file():
        return {}
    try:
        saved = json.loads(saved_file.read_text())
    except (OSError, ValueError):
        return {}   # unreadable: the resume's own checks say so
    value_fields = {field for _, field, _, _ in _VALUE_FLAGS}
    fields = {k: v for k, v in saved.items() if k in value_fields and v is not None}
    if isinstance(fields.get("betas"), list):      # as the flag spells it
        fields["betas"] = ",".join(str(b) for b in fields["betas"])
    return fields


def run_train(args: argparse.Namespace) -> None:
    """`lowbit train`: one run, or with --compare one run per recipe (and seed) plus a summary.

    A run stopped by non-finite losses ends the process with one line on stderr and exit
    code 1 (not 2: the flags were fine, the training diverged).
    """
    config = config_from_args(args)
    if args.compare is None:
        try:
            train(config, resume=args.resume, overwrite=args.overwrite)
        except NonFiniteLossError as e:
            print(f"lowbit: error: {e} Try a lower --lr, a longer --warmup-steps, or "
                  f"--grad-clip", file=sys.stderr)
            raise SystemExit(1) from None
        return
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError("--compare runs its recipes itself, one process or --parallel-runs; "
                         "under torchrun, launch one `lowbit train --recipe R` per recipe instead")
    recipes = _parse_recipes(args.compare)
    if args.parallel_runs < 1:
        raise ValueError(f"--parallel-runs must be at least 1 (got {args.parallel_runs})")
    # With --run-name NAME the runs are NAME-<recipe> and the summary goes to NAME/;
    # without it, each run gets its default name and the summary compare-<model>-<corpus>/.
    # With --seeds, each run name ends in -s<seed>.
    seeds = parse_seeds(args.seeds) if args.seeds is not None else [config.seed]
    configs = []
    for seed in seeds:
        for recipe in recipes:
            run = f"{config.run_name or f'{config.model}-{config.corpus}'}-{recipe}"
            if args.seeds is not None:
                run += f"-s{seed}"
            elif not config.run_name:
                run = ""
            configs.append(dataclasses.replace(config, recipe=recipe, seed=seed, run_name=run))
    comparison = compare(configs, name=config.run_name or None, overwrite=args.overwrite,
                         resume=args.resume, parallel_runs=args.parallel_runs,
                         progress=config.progress)
    print(format_table(comparison), end="")
    print(f"figures: {comparison.figure}, {', '.join(map(str, comparison.extra_figures))}\n"
          f"table: {comparison.table}")


def add_plot_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", metavar="RUN", help="run folders, e.g. runs/tiny-*")
    parser.add_argument("--out", default="plot.png", help="PNG to write (default: plot.png)")
    parser.add_argument("--title", default=None, help="figure title (default: the run names)")


def run_plot(args: argparse.Namespace) -> None:
    """`lowbit plot RUN...`: the loss curves of the runs in one figure."""
    print(plot_runs(args.runs, args.out, title=args.title))


def _parse_betas(text: str) -> tuple[float, float]:
    try:
        beta1, beta2 = (float(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--betas must be two comma-separated numbers, e.g. 0.9,0.95 "
                         f"(got {text!r})") from None
    return beta1, beta2


def _parse_recipes(text: str) -> list[str]:
    recipes = [part.strip() for part in text.split(",")]
    if len(recipes) < 2 or "" in recipes or len(set(recipes)) != len(recipes):
        raise ValueError(f"--compare needs two or more distinct comma-separated recipes, "
                         f"e.g. bf16,mxfp4 (got {text!r})")
    return recipes
