"""Does stable FP4 hold up over seeds? The 10.2M-parameter English comparison of
docs/results/stable-fp4.md ("Multi-seed comparison"), every recipe at every seed, all runs as
parallel processes on one GPU, with per-layer diagnostics on one seed.

    PYTHONPATH=. python benchmarks/stable_fp4_seeds.py --out /tmp/seeds      # one H200, < 9 min
    PYTHONPATH=. python benchmarks/stable_fp4_seeds.py --out /tmp/s --smoke  # CPU, tiny, ~1 min
    PYTHONPATH=. python benchmarks/stable_fp4_seeds.py --out /tmp/p --setup pycode-100m \
        --recipes bf16,nvfp4,stable-fp4,stable-nvfp4-16x16 --batch-size 8 --steps 800 --diag-seed -1

--setup picks the model, corpus and schedule (SETUPS below: english-small, pycode-100m,
pycode-1b); --steps and --batch-size override the setup's. With english-small each run is
`lowbit train --model small --corpus english --tokenizer bpe --seq-len 512
--batch-size 32 --steps 450 --warmup-steps 30 --eval-every 50 --eval-batches 16` with one
recipe and one seed (the seed fixes the init and the data order, so the runs of one seed are
paired), run by lowbit.train.compare (`lowbit train --compare R1,... --seeds ...
--parallel-runs N` is the same thing). The runs of --diag-seed log, every 50 steps,
lowbit.diagnostics.training's per-layer diagnostics: dW and dX cosine against BF16 on the same
batch, the fraction of X, W and dY values clipped and flushed to zero by each GEMM's quantizer;
the other seeds skip diagnostics (they cost time and change nothing). Runs still going at
--deadline-min are stopped, and the comparison then uses the last evaluation step every run
reached (said in the table).

Writes to --out: one run folder per recipe and seed (config, metrics.jsonl with the
diagnostics, final.json, loss.png; the checkpoints are deleted unless --keep-checkpoints),
compare/ (lowbit.train.compare's summary.md, summary.json, seeds.png, loss.png, logs/),
summary.md (every table below, ready to paste into docs/results/stable-fp4.md) and
results.json (the machine, date and command, the comparison and the diagnostics tables).
summary.md is printed at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

RECIPES = ("bf16,nvfp4,mxfp4,stable-fp4,stable-fp4-b16,stable-fp4-dy1d,stable-nvfp4-16x16,"
           "stable-nvfp4-dy1d,stable-fp4-dy16,stable-fp4-dy8")
SETUPS = {
    # Experiment 2 of docs/results/stable-fp4.md: 10.2M parameters, evaluated on WikiText-2
    "english-small": dict(model="small", corpus="english", tokenizer="bpe", seq_len=512,
                          batch_size=32, max_steps=450, warmup_steps=30, eval_every=50,
                          eval_batches=16, diag_every=50, checkpoint_every=0, device="cuda"),
    # Experiment 1's: 97.5M parameters on pycode (Python sources), 16k tokens a step
    "pycode-100m": dict(model="100m", corpus="pycode", tokenizer="bpe", bpe_vocab_size=8192,
                        corpus_max_bytes=100_000_000, seq_len=1024, batch_size=16, lr=1e-3,
                        max_steps=700, warmup_steps=50, eval_every=50, eval_batches=16,
                        diag_every=100, checkpoint_every=0, device="cuda"),
    # the 1B preset (20 layers, width 2048) at sequence 2048: a short run, 64k tokens a step
    "pycode-1b": dict(model="1b", corpus="pycode", tokenizer="bpe", bpe_vocab_size=8192,
                      corpus_max_bytes=100_000_000, seq_len=2048, batch_size=32, lr=5e-4,
                      max_steps=400, warmup_steps=40, eval_every=25, eval_batches=8,
                      diag_every=100, checkpoint_every=0, device="cuda"),
}
SMOKE = dict(model="tiny", corpus="tinyshakespeare", tokenizer="bytes", seq_len=32,
             batch_size=2, max_steps=2, warmup_steps=1, eval_every=2, eval_batches=1,
             diag_every=2, checkpoint_every=0, device="cpu")
# the diagnostics tables: (key in the records, column title)
OPERAND_STATS = (("dw_cos", "dW cos"), ("dx_cos", "dX cos"), ("flush_x", "X flushed"),
                 ("flush_w", "W flushed"), ("flush_dy", "dY flushed (dgrad)"),
                 ("flush_dy_wgrad", "dY flushed (wgrad)"), ("clip_x", "X clipped"),
                 ("clip_w", "W clipped"), ("clip_dy", "dY clipped"),
                 ("w_fwd_bwd_rel_diff", "W fwd/bwd diff"))
LAYER_KINDS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, as lowbit's CLI
        print(f"lowbit: error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="stable_fp4_seeds.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, metavar="DIR", help="folder for every result")
    p.add_argument("--recipes", default=RECIPES,
                   help="comma-separated, the first is the baseline (default: %(default)s)")
    p.add_argument("--setup", default="english-small", choices=sorted(SETUPS),
                   help="model, corpus and schedule (default: %(default)s)")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated (default: %(default)s)")
    p.add_argument("--diag-seed", type=int, default=0,
                   help="the seed whose runs log per-layer diagnostics, -1 for none (default: "
                        "%(default)s)")
    p.add_argument("--parallel-runs", type=int, default=None, metavar="N",
                   help="runs at once (default: all of them; --smoke: 1)")
    p.add_argument("--deadline-min", type=float, default=8.5,
                   help="stop runs still going after this many minutes (default: %(default)s)")
    p.add_argument("--steps", type=int, default=None,
                   help="optimizer steps a run (default: the setup's; --smoke: 2)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="sequences a step (default: the setup's); fewer fit more runs at once")
    p.add_argument("--data-dir", default=None, metavar="DIR",
                   help="folder of the corpora (default: lowbit.data's, e.g. $LOWBIT_DATA)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="replay each step from one CUDA graph (lowbit train --cuda-graph): less "
                        "host time a step, for when the parallel runs are CPU-bound")
    p.add_argument("--keep-checkpoints", action="store_true",
                   help="keep each run's final checkpoint (~120 MB a run)")
    p.add_argument("--smoke", action="store_true",
                   help="the tiny model on Tiny Shakespeare for 2 steps on the CPU")
    return p


def run_configs(args) -> list:
    from lowbit.train import TrainConfig

    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.diag_seed != -1 and args.diag_seed not in seeds:
        raise ValueError(f"--diag-seed {args.diag_seed} is not one of --seeds {args.seeds} "
                         "(-1: no diagnostics)")
    setup = dict(SMOKE if args.smoke else SETUPS[args.setup])
    if args.steps is not None:
        setup["max_steps"] = args.steps
    if args.batch_size is not None:
        setup["batch_size"] = args.batch_size
    setup["cuda_graph"] = args.cuda_graph
    configs = []
    for seed in seeds:
        for recipe in recipes:
            configs.append(TrainConfig(**setup, recipe=recipe, seed=seed,
                                       diagnostics=seed == args.diag_seed,
                                       data_dir=args.data_dir, out_dir=args.out,
                                       run_name=f"{setup['model']}-{recipe}-s{seed}"))
    return configs


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _run(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"lowbit: error: {e}", file=sys.stderr)
        return 2


def _run(args) -> int:
    from lowbit.bench import run_meta
    from lowbit.diagnostics.training import per_layer_training_diagnostics
    from lowbit.train.compare import compare
    from lowbit.train.metrics import read_metrics

    t0 = time.time()
    configs = run_configs(args)
    if not args.smoke:
        import torch
        if not torch.cuda.is_available():
            raise ValueError("this comparison runs on a CUDA GPU; use --smoke on the CPU")
    parallel = args.parallel_runs or (1 if args.smoke else len(configs))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline_s = args.deadline_min * 60 - (time.time() - t0)
    comparison = compare(configs, name="compare", overwrite=True, parallel_runs=parallel,
                         deadline_s=deadline_s, diagnostics_fn=per_layer_training_diagnostics)
    if not args.keep_checkpoints:
        for c in configs:
            shutil.rmtree(out / c.name / "checkpoints", ignore_errors=True)
    diag_runs = {c.recipe: out / c.name for c in configs
                 if c.diagnostics and c.recipe != "bf16" and (out / c.name / "metrics.jsonl").is_file()}
    diagnostics = {r: [x for x in read_metrics(d) if x["event"] == "diagnostics"]
                   for r, d in diag_runs.items()}
    meta = run_meta("cpu" if args.smoke else "cuda")
    tables = diagnostics_tables(diagnostics)
    text = summary_markdown(comparison, configs, args, meta, tables, time.time() - t0, parallel)
    (out / "summary.md").write_text(text)
    (out / "results.json").write_text(json.dumps({
        "meta": meta, "setup": configs[0].to_dict() | {"recipe": None, "seed": None},
        "comparison": json.loads((out / "compare" / "summary.json").read_text()),
        "diagnostics_seed": args.diag_seed, "diagnostics": tables,
        "wall_s": time.time() - t0}, indent=2) + "\n")
    print(text)
    return 0


# ---- the diagnostics tables ---------------------------------------------------------------

def _number(v):
    if isinstance(v, (int, float)):
        return float(v)
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _mean(values):
    values = [v for v in values if v is not None and math.isfinite(v)]
    return sum(values) / len(values) if values else None


def diagnostics_tables(diagnostics: dict[str, list[dict]]) -> dict:
    """From each recipe's diagnostics records (one seed): {"operands": recipe -> stat -> mean
    over steps, "by_step": recipe -> step -> {dw_cos, flush_dy}, "by_kind": recipe -> stat ->
    layer kind -> mean over blocks and steps, "by_block": recipe -> block -> dW cos mean,
    "worst_layers": recipe -> the 3 layers of lowest mean dW cos}."""
    tables = {"operands": {}, "by_step": {}, "by_kind": {}, "by_block": {}, "worst_layers": {}}
    for recipe, records in diagnostics.items():
        tables["operands"][recipe] = {k: _mean(_number(r.get(f"diag/{k}")) for r in records)
                                      for k, _ in OPERAND_STATS}
        tables["by_step"][recipe] = {r["step"]: {k: _number(r.get(f"diag/{k}"))
                                                 for k in ("dw_cos", "dx_cos", "flush_dy")}
                                     for r in records}
        per_layer: dict[str, dict[str, list]] = {}
        for r in records:
            for key, value in r.items():
                if key.startswith("diag/layer/"):
                    layer, stat = key[len("diag/layer/"):].rsplit("/", 1)
                    per_layer.setdefault(layer, {}).setdefault(stat, []).append(_number(value))
        by_kind = {}
        for stat in ("dw_cos", "dx_cos", "flush_dy", "flush_dy_wgrad", "flush_x"):
            by_kind[stat] = {kind: _mean(v for layer, s in per_layer.items()
                                         if layer.endswith(kind) for v in s.get(stat, []))
                             for kind in LAYER_KINDS}
        tables["by_kind"][recipe] = by_kind
        blocks = {}
        for layer, s in per_layer.items():
            parts = layer.split(".")
            block = next((parts[i + 1] for i, p in enumerate(parts[:-1]) if p == "layers"), "other")
            blocks.setdefault(block, []).extend(s.get("dw_cos", []))
        tables["by_block"][recipe] = {b: _mean(v) for b, v in sorted(
            blocks.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else 10**9)}
        mean_cos = {layer: _mean(s.get("dw_cos", [])) for layer, s in per_layer.items()}
        worst = sorted((v, k) for k, v in mean_cos.items() if v is not None)[:3]
        tables["worst_layers"][recipe] = [[k, v] for v, k in worst]
    return tables


def _fmt(v, spec=".3f"):
    return "—" if v is None else format(v, spec)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |",
            "| --- | " + " | ".join("---:" for _ in header[1:]) + " |",
            *("| " + " | ".join(r) + " |" for r in rows)]


def summary_markdown(c, configs, args, meta, tables, wall_s: float, parallel: int) -> str:
    """Every table of the comparison, as Markdown to paste into docs/results/stable-fp4.md."""
    seeds = list(dict.fromkeys(cfg.seed for cfg in configs))
    base = c.baseline
    value = {(row.arm, row.seed): row for row in c.rows}
    setup = configs[0]
    lines = [f"Measured {meta['date'][:10]} on {meta['device']} (torch {meta['torch']}, triton "
             f"{meta.get('triton', '—')}), {len(configs)} runs, {parallel} at a time as "
             f"processes of their own ({wall_s / 60:.1f} min in all). Command: `PYTHONPATH=. "
             f"python benchmarks/stable_fp4_seeds.py {' '.join(args.argv)}`.", "",
             f"Validation loss at step {c.step} of {setup.total_steps} "
             f"({(c.step or 0) * setup.tokens_per_step / 1e6:.2f}M tokens), and each recipe's "
             f"gap to the same seed's {base}:", ""]
    header = ["recipe", *(f"seed {s}" for s in seeds), "mean ± sd", "95% CI", "verdict",
              f"within {base}'s spread on every seed"]
    rows = [[base, *(_fmt(value[base, s].value, ".4f") for s in seeds),
             f"spread {_fmt(c.baseline_spread_pct, '.2f')}%", "", "", ""]]
    for a in c.arms:
        per_seed = [(f"{value[a.arm, s].gap_pct:+.2f}%" if value[a.arm, s].gap_pct is not None
                     else value[a.arm, s].status) for s in seeds]
        mean = "—" if a.mean_pct is None else f"{a.mean_pct:+.2f}%" + (
            "" if a.std_pct is None else f" ± {a.std_pct:.2f}%")
        ci = "—" if a.ci95_pct is None else f"[{a.ci95_pct[0]:+.2f}%, {a.ci95_pct[1]:+.2f}%]"
        within = {None: "—", True: "yes", False: "no"}[a.within_spread_every_seed]
        rows.append([a.arm, *per_seed, mean, ci, a.verdict, within])
    lines += _table(header, rows)
    lines += ["", f"Verdict: \"worse\"/\"better\" when a two-sided paired t-test over the "
              f"{len(seeds)} seeds rejects a zero mean gap at 95% (|mean| > t(0.975, n−1)·sd/√n), "
              f"else \"within noise\". {base}'s spread: the sample standard deviation of its "
              f"validation loss over the seeds, in % of their mean. Runs that did not finish: "
              f"{', '.join(f'{r.run} ({r.status})' for r in c.rows if r.status != 'ok') or 'none'}.",
              ""]
    ops = tables["operands"]
    if ops:
        lines += [f"Diagnostics of seed {args.diag_seed} (means over the layers and over the "
                  f"diagnostics every {setup.diag_every} steps):", ""]
        lines += _table(["recipe", *(t for _, t in OPERAND_STATS)],
                        [[r, *(_fmt(ops[r][k], ".4f") for k, _ in OPERAND_STATS)] for r in ops])
        for stat, title in (("dw_cos", "dW cosine"), ("flush_dy", "dY flushed in dgrad"),
                            ("flush_dy_wgrad", "dY flushed in wgrad")):
            lines += ["", f"{title} per layer kind (mean over blocks and steps, seed "
                      f"{args.diag_seed}):", ""]
            lines += _table(["recipe", *LAYER_KINDS],
                            [[r, *(_fmt(tables["by_kind"][r][stat][k]) for k in LAYER_KINDS)]
                             for r in ops])
        blocks = sorted({b for r in ops for b in tables["by_block"][r]},
                        key=lambda b: int(b) if b.isdigit() else 10**9)
        lines += ["", "dW cosine per transformer block (mean over its layers and the steps):", ""]
        lines += _table(["recipe", *(f"block {b}" for b in blocks)],
                        [[r, *(_fmt(tables["by_block"][r].get(b)) for b in blocks)] for r in ops])
        steps = sorted({s for r in ops for s in tables["by_step"][r]})
        for stat, title in (("dw_cos", "dW cosine"), ("flush_dy", "dY flushed in dgrad")):
            lines += ["", f"{title} by step (mean over the layers):", ""]
            lines += _table(["recipe", *(f"step {s}" for s in steps)],
                            [[r, *(_fmt(tables["by_step"][r].get(s, {}).get(stat)) for s in steps)]
                             for r in ops])
        lines += ["", "Layers of lowest mean dW cosine: " + "; ".join(
            f"{r}: " + ", ".join(f"{k} {v:.3f}" for k, v in tables["worst_layers"][r])
            for r in ops if tables["worst_layers"][r]) + "."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
