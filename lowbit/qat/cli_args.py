"""Command-line glue for `lowbit qat` (lowbit/cli.py owns the parser).

Bad values raise ValueError with a one-line message; cli.py prints it as
`lowbit: error: <message>` and exits with code 2.
"""

from __future__ import annotations

import argparse
import sys

from lowbit.qat.config import ESTIMATORS, JacQuantConfig, QATConfig, parse_compare_arm
from lowbit.qat.run import BASE_STEPS, QATJob, run_qat
from lowbit.train.compare import parse_seeds
from lowbit.train.loop import NonFiniteLossError

_JQ = JacQuantConfig()


def add_qat_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--from", dest="source", metavar="RUN_DIR",
                   help="a finished `lowbit train` run folder to quantize (default: train a BF16 "
                        f"tiny model on Tiny Shakespeare first, {BASE_STEPS} steps, cached)")
    p.add_argument("--allow-unfinished", action="store_true",
                   help="with --from: start from a run that has no final.json (it stopped "
                        "before its last step), from its last checkpoint")
    p.add_argument("--model", metavar="PATH",
                   help="a Hugging Face model folder to quantize (Llama, Qwen2, Qwen3, Qwen3-MoE): "
                        "QAT starts from its weights, with its own tokenizer (instead of --from)")
    p.add_argument("--corpus", default=None,
                   help="with --model: the corpus to fine-tune on (default: tinyshakespeare)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="with --model: tokens per sequence (default: 128)")
    p.add_argument("--corpus-max-bytes", type=int, default=None,
                   help="with --model: cut each split of the corpus to this many bytes")
    p.add_argument("--weights", default=QATConfig.weights,
                   help="weight format: int2|int3|int4|int8 with :gG, :row, :asym; ternary, "
                        "binary, seq2 (with :gG or :row); nvfp4, mxfp4 (default: %(default)s)")
    p.add_argument("--estimator", default=QATConfig.estimator, choices=ESTIMATORS,
                   help="gradient estimator (default: %(default)s)")
    p.add_argument("--compare", metavar="ARMS",
                   help="one run per comma-separated arm on the same data, steps and seed, "
                        "e.g. ste,lsq,jacquant; an arm is ESTIMATOR[/OPTION...] with a QAT "
                        "setting's options and lrxM (M times --lr), e.g. "
                        "ste,ste/lrx0.7,jacquant,jacquant/shuffled; a table and one plot with "
                        "BF16, RTN and GPTQ")
    p.add_argument("--seeds", default="0", help="comma-separated seeds, one run each (default: 0)")
    p.add_argument("--learn-scales", action=argparse.BooleanOptionalAction, default=None,
                   help="learn the scales with LSQ's gradient (default: only for lsq)")
    p.add_argument("--scale-init", default="absmax", choices=("absmax", "mse"),
                   help="initial scales from the weights (default: %(default)s)")
    p.add_argument("--steps", type=int, default=QATJob.steps, help="QAT steps (default: %(default)s)")
    p.add_argument("--lr", type=float, default=None,
                   help="peak learning rate (default: 2e-5 from a trained Hugging Face model, "
                        "--model or a --from run trained from one; else 1e-3)")
    p.add_argument("--warmup-steps", type=int, default=QATJob.warmup_steps, help="default: %(default)s")
    p.add_argument("--batch-size", type=int, default=None, help="default: the source run's")
    p.add_argument("--eval-every", type=int, default=QATJob.eval_every, help="default: %(default)s")
    p.add_argument("--checkpoint-every", type=int, default=QATJob.checkpoint_every, help="default: %(default)s")
    # jacquant's flags default to None, "not given", so that job_from_args can refuse them
    # with another estimator; JacQuantConfig's defaults apply
    p.add_argument("--refresh-every", type=int, default=None,
                   help=f"jacquant: refit B every N steps (default: {_JQ.refresh_every})")
    p.add_argument("--b-max", type=float, default=None,
                   help=f"jacquant: B's upper clamp (default: {_JQ.b_max})")
    p.add_argument("--b-estimate", default=None, choices=("probe", "dither", "both"),
                   help=f"jacquant: how B is fit (default: {_JQ.estimate})")
    p.add_argument("--b-eps", type=float, default=None,
                   help=f"jacquant: perturbation half-width in quantization steps (default: {_JQ.eps})")
    p.add_argument("--b-samples", type=int, default=None,
                   help=f"jacquant: probes per refresh (default: {_JQ.samples})")
    p.add_argument("--b-ema", type=float, default=None,
                   help=f"jacquant: EMA across refreshes (default: {_JQ.ema})")
    p.add_argument("--b-per-element", action=argparse.BooleanOptionalAction, default=None,
                   help="jacquant: one B per weight (the default), or with --no-b-per-element one "
                        "per quantization group")
    p.add_argument("--b-unweighted", action="store_true", default=None,
                   help="jacquant: no input second-moment weighting of a per-group B "
                        "(per element the weighting cancels, so it has none)")
    p.add_argument("--b-on", default=None, choices=("grad", "update"),
                   help="jacquant: B scales each optimizer step's change of the weight, with an "
                        "STE backward (update), or the gradient in backward (grad; under AdamW "
                        f"it measures as STE does) (default: {_JQ.b_on})")
    p.add_argument("--b-shuffled", action="store_true", default=None,
                   help="jacquant: a control; the B used is the fitted B permuted within each "
                        "tensor at each refit (same values, no information about which weight)")
    p.add_argument("--distill", type=float, nargs="?", const=1.0, default=0.0, metavar="ALPHA",
                   help="distill from the high-precision source model: loss = (1 - ALPHA) * CE + "
                        "ALPHA * KL(teacher || student) on the logits (ALPHA default 1 when given)")
    p.add_argument("--distill-temperature", type=float, default=QATConfig.distill_temperature,
                   metavar="T", help="softmax temperature of the distillation KL (default: %(default)s)")
    p.add_argument("--base-steps", type=int, default=BASE_STEPS,
                   help="without --from: steps of the BF16 model trained first (default: %(default)s)")
    p.add_argument("--no-baselines", action="store_true", help="skip the BF16, RTN and GPTQ evaluations")
    p.add_argument("--baselines-only", action="store_true",
                   help="evaluate BF16, RTN and GPTQ only (no QAT run)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--out-dir", default="runs", metavar="DIR", help="parent folder of run folders (default: runs)")
    p.add_argument("--run-name", default="", help="prefix of the run folders (default: qat-<source>)")
    p.add_argument("--resume", action="store_true",
                   help="continue the runs: finished ones are kept as they are, unfinished ones "
                        "resume from their checkpoints, ones not begun start")
    p.add_argument("--overwrite", action="store_true", help="start over in existing run folders")
    p.add_argument("--no-progress", action="store_true", help="print only the final table")


def job_from_args(args: argparse.Namespace) -> QATJob:
    arms = [args.estimator] if args.compare is None else [a.strip() for a in args.compare.split(",")]
    estimators = [arm.split("/")[0].strip() for arm in arms]
    for e, arm in zip(estimators, arms):
        if e not in ESTIMATORS:
            raise ValueError(f"unknown estimator {e!r} in --compare arm {arm!r}; use "
                             f"{', '.join(ESTIMATORS)}, each with /OPTION...s, e.g. ste/lrx1.5")
    if args.compare is not None and len(arms) < 2:
        raise ValueError("--compare needs two or more comma-separated estimators, e.g. ste,jacquant")
    seeds = tuple(parse_seeds(args.seeds))
    # the flags' config; each arm's estimator and options go on top (parse_compare_arm)
    base = QATConfig(weights=args.weights, estimator="ste", learn_scales=args.learn_scales,
                     scale_init=args.scale_init, jacquant=jacquant_from_args(args, estimators),
                     distill=args.distill, distill_temperature=args.distill_temperature)
    configs, lr_multipliers = zip(*(parse_compare_arm(arm, base) for arm in arms))
    if args.allow_unfinished and args.source is None:
        raise ValueError("--allow-unfinished goes with --from RUN_DIR (a --model folder, or the "
                         "cached base run, is never unfinished)")
    return QATJob(configs=list(configs), lr_multipliers=lr_multipliers, source=args.source, model=args.model, corpus=args.corpus,
                  seq_len=args.seq_len, corpus_max_bytes=args.corpus_max_bytes, seeds=seeds,
                  steps=args.steps, lr=args.lr,
                  warmup_steps=args.warmup_steps, batch_size=args.batch_size,
                  eval_every=args.eval_every, checkpoint_every=args.checkpoint_every,
                  device=args.device, out_dir=args.out_dir, name=args.run_name,
                  base_steps=args.base_steps, baselines=not args.no_baselines,
                  baselines_only=args.baselines_only,
                  progress=not args.no_progress, allow_unfinished=args.allow_unfinished,
                  resume=args.resume, overwrite=args.overwrite)


# `lowbit qat`'s flags that set JacQuant's B (JacQuantConfig's field each): they mean something
# to the jacquant estimator only
JACQUANT_FLAGS = (("--refresh-every", "refresh_every"), ("--b-max", "b_max"),
                  ("--b-estimate", "estimate"), ("--b-eps", "eps"), ("--b-samples", "samples"),
                  ("--b-ema", "ema"), ("--b-per-element", "per_element"),
                  ("--b-unweighted", "weighted"), ("--b-on", "b_on"), ("--b-shuffled", "shuffle_b"))


def jacquant_from_args(args: argparse.Namespace, estimators: list[str]) -> JacQuantConfig:
    """The JacQuantConfig of the jacquant flags given; one given without jacquant among the
    estimators is refused, naming the flag and the estimators."""
    values = {field: getattr(args, flag[2:].replace("-", "_")) for flag, field in JACQUANT_FLAGS}
    given = {field: value for field, value in values.items() if value is not None}
    if given and "jacquant" not in estimators:
        flag, field = next((flag, field) for flag, field in JACQUANT_FLAGS if field in given)
        if given[field] is False:   # as typed: --no-b-per-element
            flag = "--no-" + flag[2:]
        chosen = (f"--estimator {estimators[0]}" if len(estimators) == 1
                  else f"--compare {','.join(estimators)}")
        raise ValueError(f"{flag} sets jacquant's B, which {chosen} does not use; leave it out, "
                         f"or choose --estimator jacquant")
    if "weighted" in given:   # the flag --b-unweighted
        given["weighted"] = False
    return JacQuantConfig(**given)


def config_flags(config: QATConfig) -> list[str]:
    """The `lowbit qat` flags that make one run of `config` (defaults left out): how
    benchmarks/qat_experiment.py turns a setting (lowbit.qat.parse_qat_spec) into a command."""
    flags = ["--weights", config.weights, "--estimator", config.estimator]
    if config.learn_scales is not None:
        flags.append("--learn-scales" if config.learn_scales else "--no-learn-scales")
    if config.scale_init != "absmax":
        flags += ["--scale-init", config.scale_init]
    if config.distill:
        flags += ["--distill", str(config.distill)]
    if config.distill_temperature != QATConfig.distill_temperature:
        flags += ["--distill-temperature", str(config.distill_temperature)]
    jq = config.jacquant
    for flag, field in (("--refresh-every", "refresh_every"), ("--b-max", "b_max"),
                        ("--b-estimate", "estimate"), ("--b-eps", "eps"), ("--b-samples", "samples"),
                        ("--b-ema", "ema"), ("--b-on", "b_on")):
        if getattr(jq, field) != getattr(_JQ, field):
            flags += [flag, str(getattr(jq, field))]
    if jq.per_element != _JQ.per_element:
        flags.append("--b-per-element" if jq.per_element else "--no-b-per-element")
    if not jq.weighted:
        flags.append("--b-unweighted")
    if jq.shuffle_b:
        flags.append("--b-shuffled")
    if jq.moment_decay != _JQ.moment_decay:
        raise ValueError("lowbit qat has no flag for jacquant moment_decay; leave it at "
                         f"{_JQ.moment_decay}")
    return flags


def run_qat_command(args: argparse.Namespace) -> None:
    """`lowbit qat`. A run stopped by non-finite losses ends the process with one line and exit
    code 1, as `lowbit train`'s does, its advice in `lowbit qat`'s flags."""
    try:
        summary = run_qat(job_from_args(args))
    except NonFiniteLossError as e:
        print(f"lowbit: error: {e} Try a lower --lr or a longer --warmup-steps", file=sys.stderr)
        raise SystemExit(1) from None
    print(summary["table"], end="")
    print(f"figure: {summary['figure']}\ntable: {summary['dir']}/table.md")
    if "comparison" in summary:
        print(f"seeds: {summary['comparison']} and seeds.png beside it")
