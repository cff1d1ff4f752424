"""`lowbit bench train`: the step time and peak memory of recipes on one model, as a table with
ratios to the first recipe (the baseline, normally bf16), measured in the same run.

    lowbit bench train --model 1b --seq-len 2048 --batch-size 4 --recipes bf16,nvfp4,stable-fp4-fp8
    lowbit bench train --model tiny --seq-len 64 --batch-size 2 --steps 2 --warmup 1   # CPU smoke

Each recipe gets a fresh model (same seed), built and converted as `lowbit train` builds a run,
and lowbit.train's own step (TrainStep) runs on its batches: the optimizer's groups, the
schedule, clipping, autocast, the FP8 fold policy (a redone step is timed and counted), and
with --compile / --cuda-graph the compiled model and the CUDA graph. The median step time over
--steps timed steps after --warmup untimed ones, and the peak allocated memory, are reported.
With --interleave R the recipes' timed blocks take turns R times (every model kept on the
device), so a slow drift of the machine cannot favour one recipe: what a 2% comparison needs.
Speed targets are checked here, in a benchmark, never in unit tests.

Under torchrun it benchmarks the step `lowbit train` runs there (lowbit.train.distributed):

    torchrun --nproc_per_node 2 -m lowbit.cli bench train --model 1b --seq-len 2048 \
        --batch-size 8 --recipes bf16,stable-fp4-fp8 --parallel ddp|fsdp

--batch-size is then the global batch (each process trains its rows r::N of it, as lowbit
train splits it), tokens/s counts the whole job's tokens, the step time is the slowest
process's median (the mean too), and the peak memory the largest of any process (one GPU's). Only rank 0
prints and writes --json. benchmarks/multi_gpu.py runs 1 and N processes and reports the
scaling.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import os
import re
import statistics
import time

import torch

from lowbit.bench.timing import profile_step, sync
from lowbit.recipes import quantizes

__all__ = ["bench_train", "format_rows", "training_flops_per_token", "BF16_PEAK_FLOPS"]

BF16_PEAK_FLOPS = {"H100": 989e12, "H200": 989e12}
"""Dense bf16 tensor-core peak by GPU (the vendor's figure, no sparsity): MFU's denominator."""


def training_flops_per_token(net: torch.nn.Module, seq_len: int) -> tuple[float, int]:
    """(FLOPs a training step spends per token, active matmul parameters): 6 per active
    parameter of every GEMM (the linears, the output head; an MoE layer's experts at k / E of
    theirs, its router), plus causal attention's 6 * layers * seq_len * (heads * head_dim)
    (PaLM's count, halved for the causal mask). Embeddings are lookups, not counted."""
    from lowbit.models.moe import Experts

    active = 0
    for module in net.modules():
        if isinstance(module, torch.nn.Linear):
            active += module.weight.numel()
        elif isinstance(module, Experts):
            share = net.config.experts_per_token / module.num_experts
            active += round((module.gate_up_proj.numel() + module.down_proj.numel()) * share)
        elif hasattr(module, "weight") and type(module).__name__ == "TopKRouter":
            active += module.weight.numel()
    cfg = net.config
    attention = 6 * cfg.n_layers * seq_len * cfg.n_heads * cfg.head_dim
    return 6.0 * active + attention, active


def bench_train(model: str = "tiny", recipes=("bf16", "stable-fp4"), *, seq_len: int = 128,
                batch_size: int = 4, steps: int = 10, warmup: int = 3, device: str = "auto",
                compile: bool | str | None = None, n_experts: int | None = None, profile: bool = False,
                cuda_graph: bool = False, corpus: str | None = None,
                progress=print, interleave: int = 1, parallel: str = "ddp",
                trace: str | None = None) -> list[dict]:
    """Each recipe's median step time and peak memory on the same model (seeded init) and the
    same batches, timing lowbit.train's own step (TrainStep: its optimizer groups, schedule,
    clipping, autocast, fold policy and CUDA graph), built as `lowbit train` builds a run.
    corpus None: one batch of random tokens, every step (the preset's vocabulary); a corpus
    name (lowbit.data, byte tokens, as `lowbit train --tokenizer bytes` reads it; the model's
    vocabulary is then 256): step i trains on that corpus's batch i, so the gradients are those
    of text (the FP8 folds' redo count depends on them). interleave R > 1: every model is built
    first and kept, and R blocks of `steps` timed steps take turns across the recipes; the
    median is over all R * steps, "block_ms" holds each block's median (the spread a repeat
    shows), and peak memory is not reported (the models share the device). parallel: "ddp"
    or "fsdp", how the model is spread over the processes when launched by torchrun (see the
    module doc); one process ignores it. trace: a folder; with profile, each recipe's profiled
    step is also written there as a Chrome trace, <recipe>.json.gz (characters other than
    letters, digits and . + - _ in the name as _). compile: "model" (or True) the whole model
    through torch.compile, as lowbit train --compile; "layers" each decoder layer on its own
    (Transformer.compile_layers, as lowbit rl --compile); None (or False) eager."""
    from lowbit.recipes import get_recipe
    from lowbit.train.config import resolve_device
    from lowbit.train.distributed import setup

    for flag, value, least in (("--steps", steps, 1), ("--warmup", warmup, 0), ("--interleave", interleave, 1),
                               ("--seq-len", seq_len, 1), ("--batch-size", batch_size, 1)):
        if value < least:
            raise ValueError(f"{flag} must be >= {least} (got {value})")
    compile = {True: "model", False: None}.get(compile, compile)
    if compile not in (None, "model", "layers"):
        raise ValueError(f"--compile must be model or layers (got {compile!r})")
    if parallel not in ("ddp", "fsdp"):
        raise ValueError(f"--parallel must be ddp or fsdp (got {parallel!r})")
    if trace and not profile:
        raise ValueError("--trace writes the profiled step: add --profile")
    if trace and os.path.exists(trace) and not os.path.isdir(trace):
        raise ValueError(f"--trace {trace} is a file; give a folder for the traces")
    for name in recipes:
        if qat_setting(name) is None:
            get_recipe(name)  # refuse an unknown recipe before building anything
    process = setup(resolve_device(device))   # torchrun's process group, if launched by it
    try:
        qat = [name for name in recipes if qat_setting(name) is not None]
        if process.enabled and parallel == "fsdp" and qat:   # every rank refuses alike
            raise ValueError(f"{qat[0]}: lowbit runs QAT settings under --parallel ddp; their "
                             "fake-quantized weights are not sharded with FSDP")
        if batch_size % process.world_size:
            raise ValueError(f"--batch-size ({batch_size}) is the global batch under torchrun and "
                             f"must be a multiple of the {process.world_size} processes")
        return _bench(process, model=model, recipes=recipes, seq_len=seq_len,
                      batch_size=batch_size, steps=steps, warmup=warmup, compile=compile,
                      n_experts=n_experts, profile=profile, cuda_graph=cuda_graph, corpus=corpus,
                      progress=progress if process.is_main else (lambda message: None),
                      interleave=interleave, parallel=parallel, trace=trace)
    finally:
        process.close()


def _bench(process, *, model, recipes, seq_len, batch_size, steps, warmup, compile, n_experts,
           profile, cuda_graph, corpus, progress, interleave, parallel, trace) -> list[dict]:
    from lowbit.models import is_model_folder
    from lowbit.train import TrainConfig
    from lowbit.train.build import (apply_recipe, build_data, build_model, build_optimizer,
                                    resolve_recipe)
    from lowbit.diagnostics.training import quantized_weights
    from lowbit.train.step import (StepConfig, TrainStep, next_token_loss, refuse_compile,
                                   refuse_cuda_graph)

    dev = process.device
    base = TrainConfig(model=model, seq_len=seq_len, batch_size=batch_size, n_experts=n_experts,
                       max_steps=warmup + steps * interleave + (1 if profile else 0),
                       warmup_steps=min(warmup, 1),
                       compile=compile == "model", cuda_graph=cuda_graph, device=str(dev),
                       corpus=corpus or "tinyshakespeare",
                       tokenizer="model" if is_model_folder(model) else "bytes", progress=False,
                       diagnostics=False, parallel=parallel)
    with process.main_first():   # rank 0 tokenizes and caches the corpus, the others read it
        data = build_data(base) if corpus is not None else None
    vocab_size = data.vocab_size if data is not None else None
    if cuda_graph:   # the device and processes; each model's MoE experts once it is built
        refuse_cuda_graph(process)
    if compile is not None:
        refuse_compile(dev)
    units = []

    def build(name: str) -> dict:
        qat = qat_setting(name)
        config = dataclasses.replace(base, recipe="bf16" if qat else name)
        torch.manual_seed(0)
        net = build_model(config, vocab_size).to(dev)   # QAT's first fit of scales runs there
        hook = note = None
        quantized_nothing = False
        loss_fn = next_token_loss
        if qat is not None:
            from lowbit.qat import distillation, prepare, refresh_hook

            if qat.distill:   # the teacher: the model as it was before QAT
                loss_fn = distillation(copy.deepcopy(net), qat)
            prepare(net, qat)
            hook = refresh_hook(net, qat, seed=0)
        else:
            summary = apply_recipe(net, resolve_recipe(name))
            if quantizes(name) and not quantized_weights(net):
                quantized_nothing = True
                note = (f"{name} quantized no module of this model ({summary}); its row is bf16 "
                        f"training")
        net.train()
        if compile == "layers":
            net.compile_layers()
        if cuda_graph:
            refuse_cuda_graph(process, net, base.bf16_autocast)
        if process.enabled and parallel == "fsdp":
            process.shard_model(net)   # before the optimizer takes the (sharded) parameters
        step_config = StepConfig.of(config)
        optimizer = build_optimizer(net, step_config, dev, sharded=process.fsdp)
        if hook is not None:
            hook.attach(optimizer)
        step_fn = TrainStep(net, optimizer, step_config, process, loss_fn=loss_fn)
        tokens = torch.randint(0, net.config.vocab_size, (batch_size, seq_len + 1), device=dev)
        unit = {"name": name, "net": net, "results": [], "blocks": [], "times": [],
                "note": note, "quantized_nothing": quantized_nothing,
                "optimizer": f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"}

        def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
            if data is not None:
                return data.train_batch(i)
            return tokens[:, :-1], tokens[:, 1:]

        def step():
            results = unit["results"]
            i = len(results)
            results.append(step_fn(i, batch(i)))
            if hook is not None:
                hook(i + 1)   # JacQuant's refit of B, on the steps the training loop runs it
            return results[-1]

        unit["step"] = step
        return unit

    def timed_block(unit: dict) -> None:
        times = []
        for _ in range(steps):
            sync(dev)
            t0 = time.perf_counter()
            result = unit["step"]()
            sync(dev)
            times.append(time.perf_counter() - t0 - result.capture_s)
        unit["times"] += times
        unit["blocks"].append(statistics.median(times) * 1e3)

    def finish(unit: dict) -> dict:
        times, results, net = unit["times"], unit["results"], unit["net"]
        # the job's step is its slowest process's (they meet at every all_reduce anyway)
        step_s = _across_ranks(process, statistics.median(times), max)
        redone = [i + 1 for i, r in enumerate(results)
                  if any(rec["event"] == "fold_redo" for rec in r.records)]
        mean_s = _across_ranks(process, statistics.fmean(times), max)
        flops_per_token, active = training_flops_per_token(_unwrapped(net), seq_len)
        tflops = flops_per_token * batch_size * seq_len / step_s / 1e12
        peak = next((v for k, v in BF16_PEAK_FLOPS.items()
                     if dev.type == "cuda" and k in torch.cuda.get_device_name(dev)), None)
        row = {"recipe": unit["name"], "step_ms": step_s * 1e3, "mean_ms": mean_s * 1e3,
               "tokens_per_s": batch_size * seq_len / step_s,
               "active_params": active, "model_tflops": tflops,
               "mfu": tflops * 1e12 / (peak * process.world_size) if peak else None,
               "peak_mem_gib": (_across_ranks(process, torch.cuda.max_memory_allocated(dev), max) / 2**30
                                if dev.type == "cuda" and interleave == 1 else None),
               "world_size": process.world_size,
               "parallel": parallel if process.enabled else None,
               "loss": results[-1].loss, "device": str(dev), "model": model,
               "params": sum(p.numel() for p in net.parameters()), "compile": compile,
               "cuda_graph": cuda_graph, "corpus": corpus, "note": unit["note"],
               "quantized_nothing": unit["quantized_nothing"],
               "fold_redo_steps": len(redone), "steps_run": len(results),
               "fold_redo_at": redone, "block_ms": unit["blocks"], "optimizer": unit["optimizer"]}
        if profile and dev.type == "cuda":
            if process.is_main:
                path = None
                if trace:
                    os.makedirs(trace, exist_ok=True)
                    # a QAT setting's name holds slashes: one file a recipe all the same
                    path = os.path.join(trace, re.sub(r"[^\w.+-]", "_", unit["name"]) + ".json.gz")
                row["profile"] = profile_step(unit["step"], dev, trace=path)
            else:
                unit["step"]()   # the other processes take the profiled step's collectives
        progress(f"{unit['name']}: {row['step_ms']:.1f} ms/step"
                 + (f" (blocks {', '.join(f'{b:.1f}' for b in unit['blocks'])})" if interleave > 1 else ""))
        return row

    rows = []
    if interleave == 1:   # one model alive at a time: its peak memory is its own
        for name in recipes:
            unit = build(name)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(dev)
            for _ in range(warmup):
                unit["step"]()
            timed_block(unit)
            rows.append(finish(unit))
            unit = None
            gc.collect()   # free this recipe's GPU memory (its step closure and unit form a cycle)
    else:                 # every model alive; the timed blocks take turns, so drift hits all alike
        units = [build(name) for name in recipes]
        for unit in units:
            for _ in range(warmup):
                unit["step"]()
        for _ in range(interleave):
            for unit in units:
                timed_block(unit)
        rows = [finish(unit) for unit in units]
        units = None
        gc.collect()
    base_row = rows[0]
    for row in rows:
        row["time_vs_base"] = row["step_ms"] / base_row["step_ms"]
        row["mean_vs_base"] = row["mean_ms"] / base_row["mean_ms"]
        row["mem_vs_base"] = (row["peak_mem_gib"] / base_row["peak_mem_gib"]
                              if row["peak_mem_gib"] and base_row["peak_mem_gib"] else None)
    return rows


def _unwrapped(net: torch.nn.Module) -> torch.nn.Module:
    """The model under torch.compile's wrapper (its config and modules)."""
    return getattr(net, "_orig_mod", net)


def _across_ranks(process, value: float, op) -> float:
    """max (op=max) of a number over the processes; the number itself in one process."""
    if not process.enabled:
        return value
    import torch.distributed as dist

    t = torch.tensor(float(value), dtype=torch.float64, device=process.device)
    dist.all_reduce(t, op={max: dist.ReduceOp.MAX}[op])
    return float(t)


def qat_setting(name: str):
    """'qat/<weights>/<estimator>[/<option>...]' -> its QATConfig (lowbit.qat.parse_qat_spec's
    spelling, e.g. qat/int2:g64/jacquant/k100/mse); any other name is a recipe (None)."""
    if not name.startswith("qat/"):
        return None
    from lowbit.qat import parse_qat_spec

    return parse_qat_spec(name[len("qat/"):])


def format_rows(rows: list[dict]) -> str:
    base = rows[0]["recipe"]
    head = ["recipe", "ms/step", "tokens/s", f"time vs {base}", "mean ms", f"mean vs {base}",
            "peak GiB", f"mem vs {base}", "TFLOP/s", "MFU"]
    lines = [head]
    for r in rows:
        # a recipe that quantized nothing trained bf16: its ratios would read as the recipe's
        bf16 = bool(r.get("quantized_nothing"))
        lines.append([r["recipe"] + (" (bf16: nothing quantized)" if bf16 else ""),
                      f"{r['step_ms']:.1f}", f"{r['tokens_per_s']:,.0f}",
                      "-" if bf16 else f"{r['time_vs_base']:.2f}x", f"{r['mean_ms']:.1f}",
                      "-" if bf16 else f"{r['mean_vs_base']:.3f}x",
                      "-" if r["peak_mem_gib"] is None else f"{r['peak_mem_gib']:.2f}",
                      "-" if r["mem_vs_base"] is None or bf16 else f"{r['mem_vs_base']:.2f}x",
                      f"{r['model_tflops']:.1f}",
                      "-" if r.get("mfu") is None else f"{100 * r['mfu']:.1f}%"])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = []
    for k, line in enumerate(lines):
        out.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                             for i, (c, w) in enumerate(zip(line, widths))))
        if k == 0:
            out.append("  ".join("-" * w for w in widths))
    for r in rows:
        if r.get("note"):
            out.append(f"{r['recipe']}: {r['note']}")
        if r.get("fold_redo_steps"):
            at = ", ".join(map(str, r.get("fold_redo_at", [])))
            out.append(f"{r['recipe']}: {r['fold_redo_steps']} of {r['steps_run']} steps (number "
                       f"{at}, warm-up included) had inexact one-chunk FP8 folds and were redone "
                       "with exact ones, as lowbit train does (in the times above)")
    r0 = rows[0]
    data = f"{r0['corpus']} bytes" if r0.get("corpus") else "random tokens"
    procs = (f" x {r0['world_size']} processes ({r0['parallel']}; peak GiB: the largest of any "
             "process)" if r0.get("world_size", 1) > 1 else "")
    return (f"model {r0['model']} ({r0['params'] / 1e6:.1f}M parameters, "
            f"{r0['active_params'] / 1e6:.1f}M active in GEMMs; TFLOP/s and MFU count 6 a "
            f"parameter a token plus causal attention, MFU against the dense bf16 peak) "
            f"on {r0['device']}{procs}, "
            f"compile={r0['compile']}, cuda_graph={r0.get('cuda_graph', False)}, {data}\n"
            + "\n".join(out))


