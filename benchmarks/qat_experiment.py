"""The JacQuant experiment: pretrain a BF16 model, then QAT it with every estimator in parallel.

    python benchmarks/qat_experiment.py --out DIR [--pretrain-minutes 4] [--qat-minutes 4.5] \
        [--settings int2:g64/ste/0,int2:g64/jacquant/0,...] [--smoke]

1. `lowbit bench train --interleave` times ste against jacquant (K = 100) on the pretraining
   model's shape, alone on the device, in blocks that take turns (the overhead the issue asks for);
2. `lowbit train --recipe bf16` pretrains the model (pycode by default) for as many steps as
   fit --pretrain-minutes (measured on the first steps of the run itself: the schedule is set
   from a 30-step probe), or --pretrain-steps; `--base RUN` takes a finished run instead (so
   one base serves experiments run one after another);
3. one `lowbit qat --from <that run>` process per setting WEIGHTS/ESTIMATOR/SEED[/OPTIONS]
   (--qat-args adds flags to each, e.g. '--batch-size 16';
   lowbit.qat.parse_qat_spec's options: kK, epsE, probe|dither|both, elem (per-element B),
   upd (B on the update), learned, mse (MSE scales), kd[A] (distillation from the BF16 model)),
   all at once on the same device (or --max-procs N at a time), each with the same steps, data
   order per seed and tokens;
   a process still running at the deadline is stopped and its last evaluation used; the summary
   (step 4) is written then, and again after one `--baselines-only` process per weight format
   (RTN, GPTQ), run after the QAT runs so their memory never adds to the QAT runs' (a command
   stopped from outside during the baselines keeps the QAT results);
4. `summarize`: a table of every setting's validation loss and gap to BF16 and to its seed's
   bf16 control (at every evaluation all runs reached), each non-STE run's gap over the STE
   run's with the same forward quantizer and seed and over the best STE arm's (any LR), the
   code flips a weight at one common step, and B's statistics, into DIR/table.md; DIR/summary.json
   holds the same with every run's curve and flip records (the raw data), DIR/figure.png every
   run's validation loss over its steps (`--plot SUMMARY.json PNG` redraws it from a summary).
--smoke runs the same on the CPU at a toy size (CI).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lowbit.qat import QATConfig, parse_qat_spec  # noqa: E402
from lowbit.qat.cli_args import config_flags  # noqa: E402
from lowbit.train.metrics import read_metrics  # noqa: E402
from lowbit.files import write_text_atomic  # noqa: E402
from lowbit.train.run_dir import RunDir  # noqa: E402

DEFAULT_SETTINGS = ",".join([
    "bf16/ste/0", "bf16/ste/1", "int2:g64/ste/0", "int2:g64/jacquant/0", "int2:g64/ste/1", "int2:g64/jacquant/1",
    "int2:g64/lsq/0", "int2:g64/clipped-ste/0", "int2:g64/jacquant/0/eps0.25",
    "int2:g64/jacquant/0/dither", "ternary:g64/ste/0", "ternary:g64/jacquant/0",
    "seq2:g64/ste/0", "seq2:g64/jacquant/0", "int3:g64/ste/0", "int3:g64/jacquant/0",
])


def lowbit(*args: str) -> list[str]:
    return [sys.executable, "-m", "lowbit", *args]


def parse_setting(text: str) -> tuple[QATConfig, int, float | None, str, str]:
    """'WEIGHTS/ESTIMATOR/SEED[/OPTION...]' -> (its QATConfig, the seed, its own learning rate or
    None for --qat-lr, a run name, its optimizer); the options are lowbit.qat.parse_qat_spec's
    (kK, epsE, probe|dither|both, elem|group, upd|grad, learned, mse, kd[A]), lrX (this
    setting's peak LR, e.g. lr7e-5) and sgd (SGD with momentum 0.9 instead of AdamW: lowbit qat
    --optimizer sgd; give it its own lrX)."""
    parts = text.strip().split("/")
    if len(parts) < 3 or not parts[2].isdigit():
        raise ValueError(f"setting {text!r}: write WEIGHTS/ESTIMATOR/SEED[/OPTION...], e.g. "
                         "int2:g64/jacquant/0/elem")
    lr = None
    options = []
    optimizer = "adamw"
    for option in parts[3:]:
        if option == "sgd":
            optimizer = "sgd"
        elif option.startswith("lr"):
            try:
                lr = float(option[2:])
            except ValueError:
                raise ValueError(f"setting {text!r}: {option!r} is no learning rate; write e.g. lr7e-5") from None
        else:
            options.append(option)
    try:
        config = parse_qat_spec("/".join(parts[:2] + options))
    except ValueError as e:
        raise ValueError(f"setting {text!r}: {e}") from None
    name = "-".join([parts[0].replace(":", ""), parts[1], *parts[3:], f"s{parts[2]}"])
    return config, int(parts[2]), lr, name, optimizer


def same_quantizer(a: QATConfig, b: QATConfig) -> bool:
    """Whether two settings share the forward quantizer (weights, scale init, learned scales),
    as a jacquant run and the STE run it is compared with must; B's options do not count."""
    return (a.weights, a.scale_init, a.scales_learned) == (b.weights, b.scale_init, b.scales_learned)


def summarize(settings: list, qat_dir: Path, baselines: dict, qat_lr: float,
              logs: Path | None = None) -> tuple[dict, str]:
    """Step 4 from the runs' folders: ({"rows", "gap_ratios", "gaps_by_step", "code_flips_at",
    "compared_at_step", "failed"}, the table). settings: parse_setting's tuples.

    - rows: each setting's last evaluation at the common step (the last every run that trained
      reached), its gap to BF16 and to the bf16 control of its seed, B's first and last
      statistics, and its whole curve (`evals`: [step, val loss]) and code flips (`code_flips`:
      [step, fraction changed since the record before]) for the raw data;
    - gap_ratios: each non-STE (or other-LR STE) run's gap to control over that of STE with the
      same quantizer, seed and optimizer, at --qat-lr (AdamW) or the run's own LR (SGD)
      (`ratio`), and over the best STE arm of that quantizer, seed and optimizer, whatever its
      LR (`best_ste`, `ratio_best`): a method is only as good as the tuned baseline it beats;
    - gaps_by_step: every run's gap to its control at each evaluation step all runs reached;
    - code_flips_at: {"step": the last flip record every int run reached, "flips": per run the
      flips a weight by then}, so that runs stopped at different steps compare at one."""
    bf16 = baselines.get("bf16")
    records = {}
    for config, seed, lr, name, optimizer in settings:
        runs_of = sorted(qat_dir.glob(f"{name}-*"))
        # read_metrics drops a torn last line: a run stopped at the deadline may leave one
        records[name] = (read_metrics(runs_of[0]) if runs_of and (runs_of[0] / "metrics.jsonl").is_file()
                         else [])
    reached = {}
    for config, seed, lr, name, optimizer in settings:
        steps = [r["step"] for r in records[name] if r["event"] == "eval"]
        if steps and max(steps) > 0:
            reached[name] = max(steps)
    common = min(reached.values()) if reached else None   # every run that trained got this far
    failed = {}
    for config, seed, lr, name, optimizer in settings:
        if name not in reached:
            log = None if logs is None else logs / f"{name}.log"
            failed[name] = log.read_text()[-1500:] if log is not None and log.is_file() else "no log"
    rows = []
    for config, seed, lr, name, optimizer in settings:
        recs = records[name]
        evals = [r for r in recs if r["event"] == "eval" and (common is None or r["step"] <= common)]
        ev = evals[-1] if evals and name in reached else None
        b = [r for r in recs if r["event"] == "jacquant"]

        def b_stats(r):
            return {k: v for k, v in r.items() if k.startswith("b/") and k.count("/") == 1}
        rows.append({"setting": name, "weights": config.weights, "estimator": config.estimator,
                     "seed": seed, "lr": lr or qat_lr, "optimizer": optimizer, "config": config.to_dict(),
                     "flags": config_flags(config),
                     "step": ev and ev["step"], "val_loss": ev and ev["val_loss"],
                     "gap": (ev["val_loss"] - bf16) if ev and bf16 is not None else None,
                     "b_first": b_stats(b[0]) if b and ev else None,
                     "b_last": b_stats(b[-1]) if b and ev else None,
                     "evals": [[r["step"], r["val_loss"]] for r in recs if r["event"] == "eval"],
                     "code_flips": [[r["step"], r["qat/code_flips"]] for r in recs
                                    if "qat/code_flips" in r]})
    # gaps to the control: bf16 fine-tuned the same steps, same seed, under the same optimizer,
    # at --qat-lr (AdamW) or the run's own LR (SGD); a run without one has no gap
    def control_key(r):
        return r["seed"], r["optimizer"], qat_lr if r["optimizer"] == "adamw" else r["lr"]
    controls: dict[tuple, dict] = {}   # the first bf16 setting of each key
    for r in rows:
        if r["weights"] == "bf16" and r["val_loss"] is not None:
            controls.setdefault(control_key(r), r)
    for r in rows:
        control = controls.get(control_key(r))
        r["gap_control"] = (r["val_loss"] - control["val_loss"]) if control and r["val_loss"] is not None else None
    ratios = []
    for r in rows:
        if r["weights"] == "bf16" or r["gap_control"] is None or (r["estimator"] == "ste" and r["lr"] == qat_lr):
            continue
        mine = QATConfig.from_dict(r["config"])
        # STE under the same optimizer: at --qat-lr under AdamW, at the run's own LR under SGD
        stes = [x for x in rows if x["estimator"] == "ste" and x["seed"] == r["seed"]
                and x["gap_control"] is not None and x is not r and x["optimizer"] == r["optimizer"]
                and same_quantizer(QATConfig.from_dict(x["config"]), mine)]
        ste = next((x for x in stes if x["lr"] == (qat_lr if r["optimizer"] == "adamw" else r["lr"])), None)
        best = min(stes, key=lambda x: x["gap_control"], default=None)
        if ste and ste["gap_control"] > 0:
            ratios.append({"run": r["setting"], "ste": ste["setting"],
                           "gap_ratio": r["gap_control"] / ste["gap_control"],
                           "best_ste": best["setting"],
                           "ratio_best": r["gap_control"] / best["gap_control"] if best["gap_control"] > 0 else None})
    # each run's gap to its control at every evaluation all of them reached
    by_step = {}
    eval_steps = [{s for s, _ in r["evals"]} for r in rows if r["setting"] in reached]
    shared = sorted(set.intersection(*eval_steps)) if eval_steps else []
    for r in rows:
        control = controls.get(control_key(r))
        if control is None or r["setting"] not in reached:
            continue
        mine, theirs = dict(map(tuple, r["evals"])), dict(map(tuple, control["evals"]))
        by_step[r["setting"]] = {s: mine[s] - theirs[s] for s in shared if s > 0 and s in theirs}
    # cumulative code flips at the last flip record every int run reached
    flipped = [r for r in rows if r["code_flips"] and r["setting"] in reached]
    flip_step = min(r["code_flips"][-1][0] for r in flipped) if flipped else None
    flips = {r["setting"]: sum(f for s, f in r["code_flips"] if s <= flip_step) for r in flipped}

    lines = ["| setting | step | val loss | gap to bf16 |", "| --- | ---: | ---: | ---: |"]
    for name, loss in sorted(baselines.items()):
        lines.append(f"| {name} | | {loss:.4f} | {'' if bf16 is None else f'{loss - bf16:+.4f}'} |")
    for r in rows:
        loss = "-" if r["val_loss"] is None else f"{r['val_loss']:.4f}"
        gap = "-" if r["gap"] is None else f"{r['gap']:+.4f}"
        lines.append(f"| {r['setting']} | {r['step']} | {loss} | {gap} |")
    lines += ["", f"compared at step {common}; gap to control = val loss - the bf16 control's (same seed)",
              "", "| setting | gap to control |" + "".join(f" step {s} |" for s in shared if s > 0),
              "| --- | ---: |" + " ---: |" * len([s for s in shared if s > 0])]
    lines += [f"| {r['setting']} | {r['gap_control']:+.4f} |"
              + "".join(f" {by_step[r['setting']][s]:+.4f} |" for s in shared
                        if s > 0 and s in by_step.get(r["setting"], {}))
              for r in rows if r["gap_control"] is not None]
    lines += ["", "| run | ste run | gap / gap_ste | best ste run | gap / its gap |",
              "| --- | --- | ---: | --- | ---: |"]
    lines += [f"| {x['run']} | {x['ste']} | {x['gap_ratio']:.3f} | {x['best_ste']} | "
              f"{'-' if x['ratio_best'] is None else format(x['ratio_best'], '.3f')} |" for x in ratios]
    if flipped:
        lines += ["", f"code flips a weight by step {flip_step}: "
                  + ", ".join(f"{name} {value:.3f}" for name, value in flips.items())]
    lines += ["", "failed: " + (", ".join(failed) or "none")]
    summary = {"rows": rows, "gap_ratios": ratios, "gaps_by_step": by_step,
               "code_flips_at": {"step": flip_step, "flips": flips},
               "compared_at_step": common, "failed": failed}
    return summary, "\n".join(lines) + "\n"


def plot(rows: list[dict], baselines: dict, png: Path) -> None:
    """Every run's validation loss over its QAT steps, one panel per optimizer: one colour per
    arm (the setting without its seed), one line style per seed; the BF16 base as a dotted
    line (RTN and GPTQ, far above, in the title)."""
    from lowbit.train.plot import pyplot, save_figure

    plt = pyplot()
    optimizers = sorted({r.get("optimizer", "adamw") for r in rows})
    fig, axes = plt.subplots(1, len(optimizers), figsize=(6.5 * len(optimizers), 4.5), squeeze=False)
    arms = sorted({r["setting"].rsplit("-s", 1)[0] for r in rows})
    colours = {arm: f"C{i % 10}" for i, arm in enumerate(arms)}
    seeds = sorted({r["seed"] for r in rows})
    styles = {seed: ("-", "--", ":", "-.")[i % 4] for i, seed in enumerate(seeds)}
    for ax, optimizer in zip(axes[0], optimizers):
        for r in rows:
            if r.get("optimizer", "adamw") != optimizer or not r.get("evals"):
                continue
            # from the first evaluation after step 0: step 0 of an int2 run is the base
            # quantized before QAT, far above the rest (it would flatten the curves)
            steps, losses = zip(*r["evals"][1:]) if len(r["evals"]) > 1 else zip(*r["evals"])
            arm = r["setting"].rsplit("-s", 1)[0]
            ax.plot(steps, losses, styles[r["seed"]], color=colours[arm],
                    label=arm if r["seed"] == seeds[0] else None)
        if "bf16" in baselines:
            ax.axhline(baselines["bf16"], color="k", linestyle=":", label="bf16 base")
        ax.set_title(optimizer)
        ax.set_xlabel("QAT step")
        ax.set_ylabel("validation loss")
        ax.legend(fontsize=7)
    post = ", ".join(f"{k} {v:.3f}" for k, v in baselines.items() if k != "bf16")
    fig.suptitle("QAT validation loss (line style: seed " + " / ".join(map(str, seeds)) + ")"
                 + (f"; post-training: {post}" if post else ""), fontsize=9)
    save_figure(fig, png, dpi=110)


def write_summary(out: Path, meta: dict, settings: list, qat_dir: Path, baselines: dict, qat_lr: float,
                  bench_rows, t0: float) -> tuple[dict, str, dict]:
    """summarize the runs into out/table.md and out/summary.json (each written whole, then
    renamed); returns (the summary, the table, the failed runs)."""
    summary, table = summarize(settings, qat_dir, baselines, qat_lr, logs=out)
    meta["compared_at_step"] = summary.pop("compared_at_step")
    meta["failed"] = failed = summary.pop("failed")
    write_text_atomic(out / "table.md", table)
    write_text_atomic(out / "summary.json", json.dumps({"meta": meta, "baselines": baselines, **summary,
                                                        "bench": bench_rows, "wall_s": time.time() - t0}, indent=2))
    return summary, table, failed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="folder for runs, logs and the summary (required unless --plot)")
    ap.add_argument("--plot", nargs=2, metavar=("SUMMARY", "PNG"),
                    help="only redraw a finished experiment's figure from its summary.json (or a "
                         "docs/results file holding it under results) into PNG")
    ap.add_argument("--settings", default=DEFAULT_SETTINGS)
    ap.add_argument("--base", metavar="RUN", default=None,
                    help="a finished `lowbit train` run to quantize instead of pretraining one (step 2 "
                         "is skipped; --model-args then only feed the overhead benchmark)")
    ap.add_argument("--qat-args", default="",
                    help="more flags for every `lowbit qat` process, e.g. '--batch-size 16'")
    ap.add_argument("--pretrain-minutes", type=float, default=4.0)
    ap.add_argument("--pretrain-steps", type=int, default=None,
                    help="pretrain exactly this many steps (default: as many as fit --pretrain-minutes)")
    ap.add_argument("--qat-minutes", type=float, default=4.5)
    ap.add_argument("--qat-steps", type=int, default=300)
    ap.add_argument("--qat-lr", type=float, default=5e-4)
    ap.add_argument("--model-args", default="--model 100m --dim 576 --corpus pycode --tokenizer bpe "
                    "--bpe-vocab-size 8192 --corpus-max-bytes 60000000 --seq-len 512 --batch-size 32 "
                    "--lr 1e-3 --eval-batches 16")
    ap.add_argument("--skip-overhead", action="store_true",
                    help="skip step 1 (the ste/jacquant step-time benchmark)")
    ap.add_argument("--overhead-settings", default="bf16,qat/int2:g64/ste/mse,"
                    "qat/int2:g64/jacquant/k100/mse/grad,qat/int2:g64/jacquant/k100/mse",
                    help="lowbit bench train --recipes of step 1, timed in interleaved blocks")
    ap.add_argument("--overhead-steps", type=int, default=25, help="timed steps per block")
    ap.add_argument("--overhead-blocks", type=int, default=4,
                    help="blocks per setting, taking turns (lowbit bench train --interleave)")
    ap.add_argument("--max-procs", type=int, default=None, metavar="N",
                    help="at most N QAT processes at once, the next starting as one ends (default: all "
                         "at once; many compiling at once can starve each other of CPU cores)")
    ap.add_argument("--smoke", action="store_true", help="toy sizes on the CPU")
    args = ap.parse_args()
    if args.plot:
        try:
            data = json.loads(Path(args.plot[0]).read_text())
            data = data.get("results", data)
            rows, baselines = data["rows"], data.get("baselines", {})
        except (OSError, ValueError, KeyError, AttributeError) as e:
            print(f"qat_experiment.py: error: --plot reads an experiment's summary.json (or a results "
                  f"file holding it under results), and {args.plot[0]} is not one: {e!r}", file=sys.stderr)
            raise SystemExit(2) from None
        plot(rows, baselines, Path(args.plot[1]))
        return
    if not args.out:
        ap.error("--out is required (unless --plot)")
    try:   # every setting is checked before anything is created or run
        settings = [parse_setting(s) for s in args.settings.split(",") if s.strip()]
    except ValueError as e:
        print(f"qat_experiment.py: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.base and args.pretrain_steps:
        ap.error("--pretrain-steps trains a base, --base takes one: give one of them")
    if args.max_procs is not None and args.max_procs < 1:
        ap.error(f"--max-procs must be a positive integer (got {args.max_procs})")
    if args.base and not RunDir(Path(args.base)).finished:
        print(f"qat_experiment.py: error: --base {args.base} is not a finished `lowbit train` run (a "
              f"final.json and a checkpoint); train it to the end, or leave --base out to pretrain one",
              file=sys.stderr)
        raise SystemExit(2)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    model_args = args.model_args.split()
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        # width 128: every linear's inputs (128, 384) divide into the settings' groups of 64
        model_args = ["--model", "tiny", "--dim", "128", "--seq-len", "64", "--batch-size", "8"]
        args.qat_steps = 6
    t0 = time.time()
    meta = {"date": time.strftime("%Y-%m-%d"), "argv": sys.argv[1:]}

    # 1. overhead, alone on the device
    bench_json = out / "bench-overhead.json"
    overhead = ("bf16,qat/int2:g32/ste,qat/int2:g32/jacquant/k2" if args.smoke
                else args.overhead_settings)
    bench = ["bench", "train", "--model", "tiny" if args.smoke else "100m", "--recipes", overhead,
             "--steps", "4" if args.smoke else str(args.overhead_steps),
             "--warmup", "1" if args.smoke else "5", "--seq-len", "64" if args.smoke else "1024",
             "--interleave", "2" if args.smoke else str(args.overhead_blocks),
             "--batch-size", "2" if args.smoke else "16", "--device", device, "--json", str(bench_json)]
    if not args.skip_overhead:
        r = subprocess.run(lowbit(*bench), env=env, capture_output=True, text=True)
        print(r.stdout[-3000:], r.stderr[-2000:], flush=True)

    # 2. pretrain (unless --base), the schedule fitted to the time from a probe of 30 steps
    runs = out / "runs"
    base = ["train", "--recipe", "bf16", *model_args, "--device", device, "--out-dir", str(runs),
            "--no-diagnostics", "--no-progress"]
    if args.base:
        source, steps = Path(args.base), None
    elif args.smoke:
        steps = 20
    elif args.pretrain_steps:
        steps = args.pretrain_steps
    else:
        subprocess.run(lowbit(*base, "--steps", "30", "--warmup-steps", "5", "--eval-every", "0",
                              "--checkpoint-every", "0", "--run-name", "probe"), env=env, check=True)
        rates = [r["step_time_s"] for r in map(json.loads, (runs / "probe" / "metrics.jsonl").read_text().splitlines())
                 if r.get("event") == "train"][1:]   # the first record holds the warm-up steps
        per_step = sum(rates) / max(len(rates), 1)
        steps = max(200, int(args.pretrain_minutes * 60 / (1.08 * per_step)))  # +8%: the evaluations
    if steps is not None:
        print(f"pretraining {steps} steps ({time.time() - t0:.0f} s so far)", flush=True)
        subprocess.run(lowbit(*base, "--steps", str(steps), "--warmup-steps", str(min(100, steps // 10)),
                              "--eval-every", str(max(steps // 4, 1)), "--checkpoint-every", "0",
                              "--run-name", "base"), env=env, check=True)
        source = runs / "base"
    meta["base"] = str(source)
    meta["pretrain_final"] = final = RunDir(source).final_record()
    meta["pretrain_steps"] = final.get("steps", steps)

    # 3. QAT, every setting at once (or --max-procs at a time), plus the baselines
    procs = []
    qat_dir = out / "qat"
    common = ["qat", "--from", str(source), "--steps", str(args.qat_steps),
              "--warmup-steps", "20" if not args.smoke else "1", "--eval-every",
              str(max(args.qat_steps // 6, 1)), "--checkpoint-every", "0", "--device", device,
              "--out-dir", str(qat_dir), "--no-progress", *shlex.split(args.qat_args)]
    waiting = list(settings)
    limit = args.max_procs or len(settings)

    def start_next() -> None:
        config, seed, lr, name, optimizer = waiting.pop(0)
        log = open(out / f"{name}.log", "w")
        procs.append((name, subprocess.Popen(
            lowbit(*common, *config_flags(config), "--seeds", str(seed), "--lr", str(lr or args.qat_lr),
                   "--optimizer", optimizer,
                   "--no-baselines", "--run-name", name),
            env=env, stdout=log, stderr=subprocess.STDOUT)))
    deadline = time.time() + args.qat_minutes * 60
    while time.time() < deadline and (waiting or any(p.poll() is None for _, p in procs)):
        while waiting and sum(p.poll() is None for _, p in procs) < limit:
            start_next()
        time.sleep(2 if not args.smoke else 0.2)
    for config, seed, lr, name, optimizer in waiting:   # never started: the summary marks them failed
        print(f"{name} not started by the deadline (--max-procs {limit})", flush=True)
    for name, p in procs:
        if p.poll() is None:
            print(f"stopping {name} at the deadline", flush=True)
            p.kill()
    # the QAT runs' summary first (no baselines yet), so a command stopped from outside while
    # the baselines run keeps every QAT result
    bench_rows = json.loads(bench_json.read_text()) if bench_json.is_file() else None
    meta["baselines"] = "pending"   # until the second write below
    write_summary(out, meta, settings, qat_dir, {}, args.qat_lr, bench_rows, t0)
    meta["baselines"] = "run"
    # the post-training baselines (RTN, GPTQ) after the QAT runs, so their memory never adds
    # to the QAT runs' on the device
    baseline_procs = []
    for weights in sorted({config.weights for config, *_ in settings}):
        log = open(out / f"baselines-{weights.replace(':', '')}.log", "w")
        baseline_procs.append(subprocess.Popen(
            lowbit(*common, "--lr", str(args.qat_lr), "--weights", weights, "--baselines-only", "--run-name",
                   f"baselines-{weights.replace(':', '')}"), env=env, stdout=log, stderr=subprocess.STDOUT))
    for p in baseline_procs:
        p.wait()

    # 4. the summary
    baselines = {}
    for path in qat_dir.glob("baselines-*/summary.json"):
        baselines.update(json.loads(path.read_text())["baselines"])
    summary, table, failed = write_summary(out, meta, settings, qat_dir, baselines, args.qat_lr, bench_rows, t0)
    print(table)
    try:   # a figure that fails to draw must not hide the runs' own outcome below
        plot(summary["rows"], baselines, out / "figure.png")
    except Exception as e:
        print(f"figure.png not drawn: {type(e).__name__}: {e}", flush=True)
    print(f"done in {time.time() - t0:.0f} s -> {out}")
    if failed:   # the table above says which; their logs are in the folder
        raise SystemExit(f"{len(failed)} run(s) failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
