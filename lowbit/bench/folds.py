"""`lowbit bench folds`: which operands of a real training run the sync-free FP8 folds round.

    lowbit bench folds                                   # 1b, Tiny Shakespeare bytes, CUDA
    lowbit bench folds --v-proj-fp8                      # v_proj on FP8 too (see the recipe)
    lowbit bench folds --model tiny --seq-len 64 --steps 2 --device cpu   # CPU smoke

Trains `stable-fp4-fp8` as `lowbit train` does (lowbit.train.build's data, model, recipe and
optimizer; lowbit.train.step.TrainStep: bf16 autocast on CUDA, the schedule, clipping, and the
default fold policy, which redoes a step whose folds were inexact) and counts, per step, per
layer and per operand, the values that the sync-free one-K-chunk fold rounds because a row of
the operand spans more than 14 binades of block scales. Operands: X (the layer's input: fprop
along features and, transposed, wgrad along tokens), W (fprop; dgrad transposed) and dY
(dgrad along output features and, transposed, wgrad along tokens). --v-proj-fp8 puts the v
projections, which the recipe keeps emulated, on the FP8 path as well.

How the counts are attributed: each QuantLinear is given its module name as its `layer` (MoE
experts on the grouped FP8 GEMM: "<module>.gate_up_proj" and "<module>.down_proj"), and
lowbit.ops.gemms names each operand it folds; an observer (lowbit.dispatch.fold_check.
observe_folds) is told (layer, operand, count) for every fold, in the forward and in the
backward alike (the layer's Function carries the observer to autograd's thread). The counts
stay on the device and are read once per step; their sum is checked against the step's own
count (the deferred fold check's). A redone step's exact folds count nothing. On the CPU
every fold is exact (the reference fold): the counts are 0 there, and a smoke run checks the
tool itself. Measured counts: docs/results/ (the FP8 GEMM's fold-inexact file).
"""

from __future__ import annotations

import math

import torch

__all__ = ["FoldCounts", "count_inexact_folds", "format_fold_counts"]

OPERANDS = ("X", "W", "dY")


class FoldCounts:
    """A fold observer (observe_folds) that adds up, per (layer, operand), the inexact values
    it is told of, on the device (no host sync until `read`)."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], torch.Tensor] = {}

    def __call__(self, layer: str, operand: str, inexact_values: torch.Tensor) -> None:
        key = (layer, operand)
        self.counts[key] = (self.counts[key] + inexact_values if key in self.counts
                            else inexact_values.clone())

    def read(self) -> dict[tuple[str, str], int]:
        """{(layer, operand): inexact values}, read back in one transfer."""
        if not self.counts:
            return {}
        values = torch.cat([c.reshape(1).cpu() for c in self.counts.values()]).tolist()
        return dict(zip(self.counts, values))


def count_inexact_folds(model: str = "1b", *, seq_len: int = 2048, batch_size: int = 4,
                        steps: int = 8, device: str = "auto", v_proj_fp8: bool = False,
                        corpus: str = "tinyshakespeare", progress=print) -> list[dict]:
    """Train stable-fp4-fp8 for `steps` steps (see the module doc) and return one row per
    step: {"step", "loss", "rounded": the step's count of inexact values (its deferred fold
    check's), "redone": whether the step was redone with exact folds, "by_operand": {"<layer>
    <operand>": count} for every FP8 layer and operand, zeros included, "device"}."""
    from lowbit.dispatch.fold_check import observe_folds
    from lowbit.nn import QuantExperts, QuantLinear
    from lowbit.recipes import Gemm
    from lowbit.train import TrainConfig
    from lowbit.train.build import (apply_recipe, build_data, build_model, build_optimizer,
                                    resolve_recipe, seed_everything)
    from lowbit.train.config import resolve_device
    from lowbit.train.distributed import Distributed
    from lowbit.train.step import StepConfig, TrainStep

    if steps < 1 or seq_len < 1 or batch_size < 1:
        raise ValueError("--steps, --seq-len and --batch-size must be >= 1")
    dev = resolve_device(device)
    config = TrainConfig(model=model, corpus=corpus, tokenizer="bytes", seq_len=seq_len,
                         batch_size=batch_size, max_steps=max(steps, 100), warmup_steps=2,
                         recipe="stable-fp4-fp8", device=str(dev), progress=False,
                         diagnostics=False)
    seed_everything(config.seed)
    data = build_data(config)
    net = build_model(config, data.vocab_size)
    apply_recipe(net, resolve_recipe(config.recipe))
    fp8_layers = []
    for name, module in net.named_modules():
        if isinstance(module, QuantLinear) and module.linear_recipe is not None:
            module.layer_name = name   # what the fold observer is told
            if v_proj_fp8 and name.endswith("v_proj"):
                module.linear_recipe = module.linear_recipe.with_gemm(Gemm.FP8)
            if module.linear_recipe.gemm is Gemm.FP8:
                fp8_layers.append(name)
        elif isinstance(module, QuantExperts) and module.linear_recipe is not None:
            module.layer_name = name   # its grouped FP8 GEMMs' folds: name.gate_up_proj, .down_proj
            if module.linear_recipe.gemm is Gemm.FP8:
                fp8_layers += [f"{name}.gate_up_proj", f"{name}.down_proj"]
    net.to(dev).train()
    step_config = StepConfig.of(config)
    step = TrainStep(net, build_optimizer(net, step_config, dev), step_config,
                     Distributed(device=dev))
    rows = []
    for i in range(steps):
        counts = FoldCounts()
        with observe_folds(counts):
            result = step(i, data.train_batch(i))
        observed = counts.read()
        rounded = sum(r["inexact_values"] for r in result.records
                      if r["event"] in ("fold_redo", "fold_rounded"))
        if sum(observed.values()) != rounded:
            raise RuntimeError(f"step {i + 1}: the observed folds rounded {sum(observed.values())} "
                               f"values, the step's fold check counted {rounded}")
        by_operand = {f"{layer} {operand}": observed.get((layer, operand), 0)
                      for layer in fp8_layers for operand in OPERANDS}
        rows.append({"step": i + 1, "loss": result.loss, "rounded": rounded,
                     "redone": any(r["event"] == "fold_redo" for r in result.records),
                     "by_operand": by_operand, "device": dev.type})
        progress(f"   step {i + 1}/{steps} done")
    return rows


def format_fold_counts(rows: list[dict]) -> str:
    """Per step the total, then every layer and operand whose folds rounded values; the last
    line sums the steps."""
    lines = []
    for r in rows:
        lines.append(f"step {r['step']}: loss {r['loss']:.3f}, {r['rounded']:,} values rounded"
                     + (" (step redone with exact folds)" if r["redone"] else ""))
        lines += [f"    {key:40s} {n:14,d}" for key, n in r["by_operand"].items() if n]
    total = sum(r["rounded"] for r in rows)
    finite = all(math.isfinite(r["loss"]) for r in rows)
    layers = len({key.rsplit(" ", 1)[0] for r in rows for key in r["by_operand"]})
    lines.append(f"{total:,} values rounded over {len(rows)} steps in the folds of {layers} FP8 "
                 f"layers x (X, W, dY); losses finite: {finite}")
    return "\n".join(lines)
