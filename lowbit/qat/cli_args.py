"""Command-line glue for `lowbit qat` (lowbit/cli.py owns the parser).

Bad values raise ValueError with a one-line message; cli.py prints it as
`lowbit: error: <message>` and exits with code 2.
"""

from __future__ import annotations

import argparse
import sys

from lowbit.config import add_flags, flag_fields, flag_values
from lowbit.qat.config import ESTIMATORS, JacQuantConfig, QATConfig, parse_compare_arm
from lowbit.qat.run import QATJob, run_qat
from lowbit.train.compare import parse_seeds
from lowbit.train.runner import NonFiniteLossError

_JQ = JacQuantConfig()


def add_qat_arguments(p: argparse.ArgumentParser) -> None:
    # the flags QATJob's fields declare (--from, --model, --seeds, --steps, --lr, --out-dir, ...);
    # None, not given, is the field's default
    add_flags(p, QATJob)
    p.add_argument("--allow-unfinished", action="store_true",
                   help="with --from: start from a run that has no final.json (it stopped "
                        "before its last step), from its last checkpoint")
    # the flags QATConfig's fields declare (--weights, --estimator, --learn-scales, ...)
    add_flags(p, QATConfig)
    p.add_argument("--compare", metavar="ARMS",
                   help="one run per comma-separated arm on the same data, steps and seed, "
                        "e.g. ste,lsq,jacquant; an arm is ESTIMATOR[/OPTION...] with a QAT "
                        "setting's options and lrxM (M times --lr), e.g. "
                        "ste,ste/lrx0.7,jacquant,jacquant/shuffled; a table and one plot with "
                        "BF16, RTN and GPTQ")
    # the flags JacQuantConfig's fields declare (--refresh-every, --b-max, ...); None, not given,
    # lets job_from_args refuse them with another estimator
    add_flags(p, JacQuantConfig)
    p.add_argument("--no-baselines", action="store_true", help="skip the BF16, RTN and GPTQ evaluations")
    p.add_argument("--baselines-only", action="store_true",
                   help="evaluate BF16, RTN and GPTQ only (no QAT run)")
    p.add_argument("--resume", action="store_true",
                   help="continue the runs: finished ones are kept as they are, unfinished ones "
                        "resume from their checkpoints, ones not begun start")
    p.add_argument("--overwrite", action="store_true", help="start over in existing run folders")
    p.add_argument("--no-progress", action="store_true", help="print only the final table")


def job_from_args(args: argparse.Namespace) -> QATJob:
    estimator = args.estimator or QATConfig.estimator
    arms = [estimator] if args.compare is None else [a.strip() for a in args.compare.split(",")]
    estimators = [arm.split("/")[0].strip() for arm in arms]
    for e, arm in zip(estimators, arms):
        if e not in ESTIMATORS:
            raise ValueError(f"unknown estimator {e!r} in --compare arm {arm!r}; use "
                             f"{', '.join(ESTIMATORS)}, each with /OPTION...s, e.g. ste/lrx1.5")
    if args.compare is not None and len(arms) < 2:
        raise ValueError("--compare needs two or more comma-separated estimators, e.g. ste,jacquant")
    job = flag_values(args, QATJob)   # the run-level flags given; QATJob's defaults for the rest
    if "seeds" in job:
        job["seeds"] = tuple(parse_seeds(job["seeds"]))
    # the flags' config; each arm's estimator and options go on top (parse_compare_arm)
    base = QATConfig(**{**flag_values(args, QATConfig), "estimator": "ste"},
                     jacquant=jacquant_from_args(args, estimators))
    configs, lr_multipliers = zip(*(parse_compare_arm(arm, base) for arm in arms))
    if args.allow_unfinished and args.source is None:
        raise ValueError("--allow-unfinished goes with --from RUN_DIR (a --model folder, or the "
                         "cached base run, is never unfinished)")
    return QATJob(configs=list(configs), lr_multipliers=lr_multipliers, **job,
                  baselines=not args.no_baselines, baselines_only=args.baselines_only,
                  progress=not args.no_progress, allow_unfinished=args.allow_unfinished,
                  resume=args.resume, overwrite=args.overwrite)


def jacquant_from_args(args: argparse.Namespace, estimators: list[str]) -> JacQuantConfig:
    """The JacQuantConfig of the jacquant flags given; one given without jacquant among the
    estimators is refused, naming the flag and the estimators."""
    given = flag_values(args, JacQuantConfig)
    if given and "jacquant" not in estimators:
        first = next(f for f in flag_fields(JacQuantConfig) if f.name in given)
        declared = first.metadata["flag"]
        flag = declared["option"]
        if declared.get("action") is argparse.BooleanOptionalAction and not given[first.name]:
            flag = "--no-" + flag[2:]   # as typed: --no-b-per-element
        chosen = (f"--estimator {estimators[0]}" if len(estimators) == 1
                  else f"--compare {','.join(estimators)}")
        raise ValueError(f"{flag} sets jacquant's B, which {chosen} does not use; leave it out, "
                         f"or choose --estimator jacquant")
    return JacQuantConfig(**given)


def config_flags(config: QATConfig) -> list[str]:
    """The `lowbit qat` flags that make one run of `config` (--weights and --estimator, and the
    others where they differ from the default): how benchmarks/qat_experiment.py turns a setting
    (lowbit.qat.parse_qat_spec) into a command."""
    if config.jacquant.moment_decay != _JQ.moment_decay:
        raise ValueError("lowbit qat has no flag for jacquant moment_decay; leave it at "
                         f"{_JQ.moment_decay}")
    flags = ["--weights", config.weights, "--estimator", config.estimator]
    for settings, defaults in ((config, QATConfig()), (config.jacquant, _JQ)):
        for f in flag_fields(type(settings)):
            value, declared = getattr(settings, f.name), f.metadata["flag"]
            if f.name in ("weights", "estimator") or value == getattr(defaults, f.name):
                continue
            if declared.get("action") is argparse.BooleanOptionalAction:
                flags.append(declared["option"] if value else "--no-" + declared["option"][2:])
            elif declared.get("action") in ("store_true", "store_false"):
                flags.append(declared["option"])   # a switch whose value is not the default
            else:
                flags += [declared["option"], str(value)]
    return flags


def run_qat_command(args: argparse.Namespace) -> None:
    """`lowbit qat`. A run stopped by non-finite losses ends the process with one line and exit
    code 1, as `lowbit train`'s does, its advice in `lowbit qat`'s flags."""
    job = job_from_args(args)
    try:
        summary = run_qat(job)
    except NonFiniteLossError as e:
        print(f"lowbit: error: {e} Try a lower --lr or a longer --warmup-steps", file=sys.stderr)
        raise SystemExit(1) from None
    if args.scale_init is None and any(
            c.format.is_int and c.format.bits <= 3 and c.scale_init == "absmax" for c in job.configs):
        # the default stays absmax (every documented command keeps its meaning); after the run,
        # so that a refused command still says one line, the better choice
        print(f"lowbit: note: {job.configs[0].weights} with absmax scales (the default); at 2-3 "
              f"bits --scale-init mse usually starts closer (docs/qat.md)", file=sys.stderr)
    if "stopped" in summary:
        print(summary["stopped"])
        return
    print(summary["table"], end="")
    print(f"figure: {summary['figure']}\ntable: {summary['dir']}/table.md")
    if "comparison" in summary:
        print(f"seeds: {summary['comparison']} and seeds.png beside it")
