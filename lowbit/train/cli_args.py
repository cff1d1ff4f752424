"""Command-line glue for `lowbit train` and `lowbit plot`.

lowbit/cli.py owns the parser; these functions add the subcommands' flags and run them.
Every value flag is declared with the TrainConfig field it sets (lowbit.config.flag; the
field's docstring is the long help). Flags default to None, meaning "TrainConfig's default",
so that config_from_args can tell what the user actually set. Bad values raise ValueError with
a one-line message, which cli.py prints as `lowbit: error: <message>` before exiting with
code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from lowbit.config import add_flags, flag_fields, flag_values
from lowbit.train.compare import compare, format_table, parse_seeds
from lowbit.train.config import FINE_TUNE_LR, TrainConfig
from lowbit.train.loop import train
from lowbit.train.runner import NonFiniteLossError
from lowbit.train.plot import plot_runs
from lowbit.train.run_dir import RunDir

_DEFAULT = TrainConfig()


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, TrainConfig)   # the value flags, declared with TrainConfig's fields
    parser.add_argument("--no-bf16-autocast", action="store_true",
                        help="on CUDA, compute in fp32 instead of under bf16 autocast")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="replay each step from one CUDA graph (one GPU; MoE experts on the "
                             "grouped GEMM; with "
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
    fields = flag_values(args, TrainConfig)
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
    from pathlib import Path

    naming = TrainConfig(**{k: v for k, v in given.items()
                            if k in ("model", "corpus", "recipe", "run_name", "out_dir")})
    try:
        saved = RunDir(Path(naming.out_dir) / naming.name).config_record() or {}
    except (OSError, ValueError):
        return {}   # unreadable: the resume's own checks say so
    value_fields = {f.name for f in flag_fields(TrainConfig)}
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
