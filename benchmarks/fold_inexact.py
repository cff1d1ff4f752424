"""Which operands of a real training run need more than one FP8 fold window (issue 4).

    python benchmarks/fold_inexact.py                      # 1b, Tiny Shakespeare bytes, H200
    python benchmarks/fold_inexact.py --v-proj-fp8         # v_proj on FP8 too (see the recipe)
    python benchmarks/fold_inexact.py --model tiny --seq-len 64 --steps 3 --device cpu  # smoke

Trains `stable-fp4-fp8` (lowbit.train's step, bf16 autocast on CUDA, its learning-rate
schedule and clipping) and counts, per step and per operand, the values that the sync-free
one-K-chunk fold rounds because the operand's row spans more than 14 binades of block scales
(what makes lowbit train redo a step, or with --fold-inexact round log it). Operands: X (the
layer input: fprop along features and, transposed, wgrad along tokens), W, dY (dgrad along
out features and, transposed, wgrad along tokens), keyed by module. --v-proj-fp8 puts the
v projections, which the recipe keeps emulated, on the FP8 path as well. Each count is read back per
operand (a host sync each): a diagnostic, not a timing. On the CPU every fold is exact (no
count): the smoke run tests the script only. Prints one table; with $OUT set writes
$OUT/fold_inexact.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import sys
from pathlib import Path

from dataclasses import replace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="1b")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--v-proj-fp8", action="store_true",
                        help="multiply v_proj on FP8 tensor cores too (the recipe emulates it)")
    args = parser.parse_args()

    import lowbit.kernels.fp8_gemm as fg
    import lowbit.train.loop as loop
    from lowbit.nn import QuantLinear
    from lowbit.recipes import Gemm
    from lowbit.train import TrainConfig
    from lowbit.train.config import resolve_device

    device = resolve_device(args.device)
    config = TrainConfig(model=args.model, corpus="tinyshakespeare", tokenizer="bytes",
                         seq_len=args.seq_len, batch_size=args.batch_size, max_steps=100,
                         warmup_steps=2, recipe="stable-fp4-fp8", device=str(device))
    loop._seed_everything(config.seed)
    data = loop._build_data(config)
    model = loop._build_model(config, data.vocab_size)
    loop._apply_recipe(model, loop._resolve_recipe(config.recipe), lambda m: None)
    current = ["?"]   # the QuantLinear whose forward is running, to label its folds
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            module.register_forward_pre_hook(
                lambda m, a, name=name.removeprefix("model."): current.__setitem__(0, name))
            if args.v_proj_fp8 and name.endswith("v_proj"):
                module.linear_recipe = replace(module.linear_recipe, gemm=Gemm.FP8)
    model.to(device).train()
    optimizer = torch.optim.AdamW(loop._param_groups(model, config.weight_decay), lr=config.lr,
                                  betas=config.betas, fused=device.type == "cuda")
    tokens = args.batch_size * args.seq_len
    counts: dict = collections.defaultdict(int)   # (step, module, operand) -> values rounded
    step_now = [0]
    fold = fg.quantize_fold
    layer_of_ctx: dict = {}   # id(autograd ctx) -> module name, from the forward

    def counting(x, spec, transpose_too=False, check=fg.ACTIVE):
        outer = fg.resolve_check(check, x.device)
        if outer is None:
            return fold(x, spec, transpose_too, check)
        mine = fg.FoldCheck(x.device)
        out = fold(x, spec, transpose_too, mine)
        # the caller is _QuantLinearFP8.forward / .backward: name the operand by its variable
        local = sys._getframe(1).f_locals
        ctx = local.get("ctx")
        if "dy" not in local:                                   # forward
            layer = layer_of_ctx[id(ctx)] = current[0]
            operand = "X" if x is local.get("x") else "W"
        else:
            layer = layer_of_ctx.get(id(ctx), "?")
            operand = "dY" if x is local.get("dy") else "other"
        counts[(step_now[0], layer, operand)] += int(mine.counter.item())
        outer.counter += mine.counter
        return out

    fg.quantize_fold = counting
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    rows = []
    for step in range(args.steps):
        step_now[0] = step + 1
        for group in optimizer.param_groups:
            group["lr"] = loop.learning_rate_at(step, config)
        inputs, targets = (t.to(device) for t in data.train_batch(step))
        optimizer.zero_grad(set_to_none=True)
        with fg.deferred_fold_check(device) as check:
            with autocast:
                loss = model(inputs, targets).loss
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        by_operand = {f"{layer} {op}": n
                      for (s, layer, op), n in sorted(counts.items()) if s == step + 1 and n}
        rows.append({"step": step + 1, "loss": loss.item(), "rounded": check.inexact_values(),
                     "by_operand": by_operand})
        print(f"step {step + 1}: loss {loss.item():.3f}, values rounded {rows[-1]['rounded']:,}"
              + "".join(f"\n    {k:24s} {v:12,d}" for k, v in by_operand.items()), flush=True)
    total = sum(r["rounded"] for r in rows)
    elements = sum(p.numel() for p in model.parameters())
    print(f"{total:,} values rounded over {args.steps} steps ({args.model}, "
          f"{elements / 1e6:.0f}M parameters, {tokens} tokens a step); loss finite: "
          f"{all(math.isfinite(r['loss']) for r in rows)}")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "fold_inexact.json").write_text(json.dumps(
            {"args": vars(args), "device": str(device), "steps": rows}, indent=1))


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError) as e:   # a bad flag, a missing corpus: one line
        sys.exit(f"fold_inexact: {e}")
