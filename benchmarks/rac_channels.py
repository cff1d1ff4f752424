"""RAC's channel choice: per token (lowbit's) against one static set per linear layer.

RAC compensates the NVFP4 quantization residual of a fraction of each linear's input channels
(lowbit.rl.precision). lowbit picks the channels per token, which keeps every token's numerics
its own but needs a selection per token and a second GEMM over all K channels. One static set
per layer, picked once (at a weight sync), would let a GEMM append just those channels'
columns (K + |S| instead of 2K) with no selection at all. What does it cost in the log-prob
gap RAC exists to close?

Per seed: `lowbit train` a `small` model (6 layers, dim 320, byte tokens) on Tiny
Shakespeare in bf16, then put every decoder linear's weight through the engine's NVFP4 weight
quantizer (lowbit.rl.precision.weight_spec; the head stays dense, as in the engine). The
reference is that model with unquantized activations (the trainer under asymmetric QAT); each
arm quantizes every decoder linear's input per token to NVFP4 and adds RAC's residual on
- `none`: no channels (naive W4A4);
- `per-token`: each token's top |residual| channels (lowbit's RAC);
- `static-calibrated`: the channels with the largest mean |residual| over calibration tokens
  (training-split batches, not the evaluated ones);
- `static-weight`: the channels whose weight columns have the largest L2 norm (no data);
- `static-random`: random channels (the control: a static set that knows nothing);
- `per-token-in-calibrated-half`: each token's top |residual| channels, chosen within the
  calibrated half of the channels (a second GEMM over K/2 columns instead of K);
- `per-token-per-G` (G = 16, 32, 64, 128): each token's top |residual| channels within every
  group of G channels, the ratio of each group (`rac_residual`'s `group`,
  lowbit.formats.activations.rac_group_channels): the same count as `per-token` where G
  divides K, chosen where a kernel finds them without a row-wide selection (16: one NVFP4
  block; 64 at RAC 25%: the channels whose compacted residual shares one NVFP4 block of 16).
The gap is |log p_arm(token) - log p_ref(token)| of each next token of the validation batches,
in float32: mean and max over tokens, per seed; and the validation loss change.

    python benchmarks/rac_channels.py --seeds 0,1,2 --steps 300 --out rac.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

from lowbit.bench import run_meta
from lowbit.formats.activations import (per_token_nvfp4, rac_channel_count, rac_residual,
                                        rac_residual_on, top_channels)
from lowbit.rl.precision import quantize_weight, Precision
from lowbit.train import train
from lowbit.train.build import build_data, build_model
from lowbit.train.run_dir import RunDir
from lowbit.train.compare import parse_seeds
from lowbit.train.config import TrainConfig

ARMS = ("none", "per-token", "static-calibrated", "static-weight", "static-random",
        "per-token-in-calibrated-half", "per-token-per-16", "per-token-per-32", "per-token-per-64",
        "per-token-per-128")
BLOCKWISE = {f"per-token-per-{g}": g for g in (16, 32, 64, 128)}


def linears(model: nn.Module) -> dict[str, nn.Linear]:
    """Every decoder linear (the head excluded, as the engine leaves it dense)."""
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"}


def token_logprobs(model: nn.Module, batches) -> torch.Tensor:
    """log p of each target token, every batch, flattened (float32)."""
    out = []
    with torch.no_grad():
        for x, y in batches:
            logp = torch.log_softmax(model(x).logits.float(), dim=-1)
            out.append(logp.gather(-1, y[..., None])[..., 0].flatten())
    return torch.cat(out)


class Hooks:
    """Forward pre-hooks on every decoder linear that make its input what an arm multiplies:
    x_hat + r_hat (per-token NVFP4 and RAC's residual on the arm's channels)."""

    def __init__(self, model: nn.Module, arm: str, ratio: float, static: dict[str, torch.Tensor]):
        self.handles = []
        for name, module in linears(model).items():
            self.handles.append(module.register_forward_pre_hook(
                lambda mod, args, name=name: (self.quantized(args[0], name, arm, ratio, static),)))

    @staticmethod
    def quantized(x, name, arm, ratio, static):
        x_hat = per_token_nvfp4(x)
        if arm == "none":
            return x_hat
        if arm == "per-token":
            return x_hat + rac_residual(x, x_hat, ratio)
        if arm in BLOCKWISE:
            return x_hat + rac_residual(x, x_hat, ratio, BLOCKWISE[arm])
        if arm == "per-token-in-calibrated-half":      # top channels of each row within the half
            half = static[name]                    # increasing, so half[...] stays increasing
            r = (x.float() - x_hat.float()).reshape(-1, x.shape[-1])[:, half]
            channels = half[top_channels(r.abs(), rac_channel_count(x.shape[-1], ratio))]
            return x_hat + rac_residual_on(x.reshape(-1, x.shape[-1]),
                                           x_hat.reshape(-1, x.shape[-1]), channels).reshape(x.shape)
        return x_hat + rac_residual_on(x, x_hat, static[name])

    def remove(self):
        for h in self.handles:
            h.remove()


def calibrated_channels(model, batches, ratio) -> dict[str, torch.Tensor]:
    """Per linear, the channels with the largest mean |x - per_token_nvfp4(x)| over the
    batches' tokens (the reference forward's inputs)."""
    sums: dict[str, torch.Tensor] = {}
    handles = []
    for name, module in linears(model).items():
        def hook(mod, args, name=name):
            x = args[0].reshape(-1, args[0].shape[-1])
            sums[name] = sums.get(name, 0) + (x - per_token_nvfp4(x)).abs().sum(0)
        handles.append(module.register_forward_pre_hook(hook))
    with torch.no_grad():
        for x, _ in batches:
            model(x)
    for h in handles:
        h.remove()
    return {n: _top(s, ratio) for n, s in sums.items()}


def _top(score: torch.Tensor, ratio: float) -> torch.Tensor:
    return top_channels(score, rac_channel_count(score.numel(), ratio))


def run_seed(seed: int, steps: int, ratio: float, out_dir: Path, say) -> dict:
    config = TrainConfig(model="small", corpus="tinyshakespeare", recipe="bf16", max_steps=steps,
                         warmup_steps=min(30, steps // 10),
                         seed=seed, out_dir=str(out_dir), run_name=f"rac-base-s{seed}",
                         progress=False, diagnostics=False, eval_batches=8)
    data = build_data(config)
    run = RunDir(out_dir / config.name)
    if not run.finished:
        say(f"seed {seed}: training the base ({steps} steps)")
        train(config, data=data, overwrite=True)
    model = build_model(config, data.vocab_size)
    model.load_state_dict(run.open().state["model"])
    model.float().eval()
    with torch.no_grad():                    # the engine's NVFP4 weights, for every arm
        for module in linears(model).values():
            module.weight.copy_(quantize_weight(module.weight, Precision.NVFP4).dequantize(torch.float32))
    evaluated = list(data.eval_batches())
    calibration = [data.train_batch(10_000 + i) for i in range(4)]
    ref = token_logprobs(model, evaluated)
    g = torch.Generator().manual_seed(seed)
    static = {
        "static-calibrated": calibrated_channels(model, calibration, ratio),
        "per-token-in-calibrated-half": calibrated_channels(model, calibration, 0.5),
        "static-weight": {n: _top(m.weight.norm(dim=0), ratio) for n, m in linears(model).items()},
        "static-random": {n: torch.sort(torch.randperm(m.in_features, generator=g)[
            :rac_channel_count(m.in_features, ratio)]).values for n, m in linears(model).items()},
    }
    result = {"seed": seed, "tokens": ref.numel(), "ref_val_loss": -ref.mean().item(), "arms": {}}
    for arm in ARMS:
        hooks = Hooks(model, arm, ratio, static.get(arm, {}))
        got = token_logprobs(model, evaluated)
        hooks.remove()
        gap = (got - ref).abs()
        result["arms"][arm] = {"gap_mean": gap.mean().item(), "gap_max": gap.max().item(),
                               "val_loss_change": -got.mean().item() + ref.mean().item()}
        say(f"seed {seed} {arm:18} mean gap {gap.mean().item():.5f}  max {gap.max().item():.4f}")
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--ratio", type=float, default=0.25)
    p.add_argument("--runs", default="runs/rac-channels", help="where the base runs go")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    t0 = time.time()
    try:
        seeds = parse_seeds(args.seeds)
        rac_channel_count(1, args.ratio)
    except ValueError as e:
        p.error(str(e))
    results = [run_seed(s, args.steps, args.ratio, Path(args.runs), print) for s in seeds]
    summary = {}
    for arm in ARMS:
        ratios = [r["arms"][arm]["gap_mean"] / r["arms"]["per-token"]["gap_mean"] for r in results]
        summary[arm] = {"gap_mean_per_seed": [r["arms"][arm]["gap_mean"] for r in results],
                        "gap_max_per_seed": [r["arms"][arm]["gap_max"] for r in results],
                        "gap_mean_over_per_token": ratios}
    for arm, s in summary.items():
        print(f"{arm:18} mean gap " + " / ".join(f"{v:.5f}" for v in s["gap_mean_per_seed"])
              + "  (x per-token: " + " / ".join(f"{v:.2f}" for v in s["gap_mean_over_per_token"]) + ")")
    if args.out:
        meta = run_meta("cpu")
        meta.update({"seconds": round(time.time() - t0, 1), "ratio": args.ratio,
                     "command": " ".join(["python benchmarks/rac_channels.py", *(sys.argv[1:] if argv is None
                                                                                  else argv)])})
        Path(args.out).write_text(json.dumps({"meta": meta, "results": {"seeds": results,
                                                                        "summary": summary}}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
