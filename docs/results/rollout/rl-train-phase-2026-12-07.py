"""lowbit rl's train phase alone: GRPOLoss through TrainStep, on-policy, as GRPOTrainer.train_on
runs it, on a random Qwen3-0.6B-shaped policy (vocabulary 151,936) and one step of 128 random
completions of 128 tokens after prompts of 90-100 tokens, in micro-batches of 32 (what lowbit rl
picks for the RL-step benchmark). Per arm: the wall time of steps 2-5 (median), then one
profiled step: its kernels' summed time, the 25 longest kernels by name, the CPU ops' table,
and the peak GPU memory.

Arms (any of them, in order, each in a fresh model):
    bf16-full-ref   the code before 2026-12-07's change: the lm_head over every position, the
                    completion positions gathered, the log-probs and entropies in torch's form
                    (log-softmax in float32, checkpointed row chunks; lowbit.dispatch forced to
                    the reference)
    bf16            as lowbit rl runs now: logits at the completion positions only (logits_at),
                    the log-prob kernel (lowbit.dispatch.token_logprobs)
    bf16-mbN        the same in micro-batches of N
    bf16-norm-ops   bf16 with RMSNorm's operations written out (x * rsqrt(mean(x^2) + eps)), as
                    before it went through F.rms_norm (75c5677)
    qat             asymmetric QAT (QUADS's trainer side), as lowbit rl runs it
    qat-ste         asymmetric QAT as plain autograd: F.linear(x, W_f) with W_f's gradient passed
                    straight to W (an experiment; dX then uses W_f)
    ARM-compiled    bf16 or qat with each decoder layer compiled (lowbit rl --compile since
                    3774726: Transformer.compile_layers(dynamic=True)); the first step compiles
    ARM-shared      with each prompt run once for its group of 8 (lowbit rl --share-prompts);
                    with such an arm every arm's rows come in groups of 8 sharing a prompt

    PYTHONPATH=. python docs/results/rollout/rl-train-phase-2026-12-07.py --out DIR bf16-full-ref bf16
    PYTHONPATH=. python docs/results/rollout/rl-train-phase-2026-12-07.py --smoke --out /tmp/x bf16   # CPU

Writes DIR/rl-train-phase.json after each arm (an arm that fails leaves the ones before)."""

import argparse
import collections
import contextlib
import json
import os
import re
import statistics
import time

import torch
import torch.nn.functional as F

import lowbit.nn._layers as layers_module
from lowbit import dispatch
from lowbit.bench.rollout import hf_config
from lowbit.models import build_model
from lowbit.models.hf import config_from_hf
from lowbit.models.transformer import RMSNorm
from lowbit.nn import reuse_weight_operands
from lowbit.ops.gemms import operand
from lowbit.ops.linear import quant_linear
from lowbit.rl import grpo
from lowbit.rl.trainer import GRPOBatch, GRPOLoss
from lowbit.rl.trainer_side import apply_asymmetric_qat
from lowbit.train.build import build_optimizer
from lowbit.train.distributed import Distributed
from lowbit.train.step import StepConfig, TrainStep


class FullLogitsLoss(GRPOLoss):
    """GRPOLoss as it ran before logits_at: the lm_head over every position, then the
    completion positions gathered from the (B, T, V) logits."""

    def __call__(self, model, batch):
        full = model(batch.input_ids).logits
        positions = grpo.completion_positions(batch.prompt_lengths, batch.completions.shape[1], full.shape[1])
        picked = full.gather(1, positions[:, :, None].expand(-1, -1, full.shape[-1]))
        return super().__call__(lambda ids, logits_at=None: type("Out", (), {"logits": picked}), batch)


class StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, w_f):
        ctx.dtype = weight.dtype
        return w_f.view_as(w_f)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype), None


def straight_through_linear(x, weight, bias, recipe, layer="", cache=None, weight_operand=None):
    """Weight-only QAT as plain autograd (the qat-ste arm)."""
    if recipe is None or not recipe.is_quantized:
        return F.linear(x, weight, bias)
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else weight.dtype
    w_f = cache.get(weight, dtype, recipe.fprop_w,
                    lambda: operand(weight.detach().to(dtype), recipe.fprop_w, reduce_dim=1))
    return F.linear(x, StraightThrough.apply(weight, w_f), bias)


fused_rms_norm = RMSNorm.forward


def rms_norm_written_out(self, x):
    """lowbit's RMSNorm before 75c5677 (the bf16-norm-ops arm)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
    return self.weight * x32.to(x.dtype)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("arms", nargs="+")
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", action="store_true", help="a one-layer model on the CPU")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dev = torch.device("cpu" if args.smoke else "cuda")
    hf, _ = hf_config("qwen3-0.6b")
    if args.smoke:
        hf.num_hidden_layers, hf.vocab_size = 1, 512
    cfg = config_from_hf(hf.to_dict(), "qwen3-0.6b")
    B, P, Tc, micro = (8, 12, 16, 4) if args.smoke else (128, 100, 128, 32)
    vocab = 500 if args.smoke else 4000
    g = torch.Generator().manual_seed(0)
    prompt_lengths = torch.randint(P - 10, P + 1, (B,), generator=g)
    T = int(prompt_lengths.max()) + Tc
    ids = torch.randint(0, vocab, (B, T), generator=g)
    completions = torch.randint(0, vocab, (B, Tc), generator=g)
    G = 8 if any("-shared" in arm for arm in args.arms) else 0
    if G:   # GRPO's groups: each prompt (row b - b % G's) sampled G times, for every arm
        prompt_lengths = prompt_lengths[torch.arange(B) // G * G]
        ids = ids[torch.arange(B) // G * G]
    prompt_ids = ids[:, :int(prompt_lengths.max())].clone()
    for b in range(B):
        ids[b, prompt_lengths[b]:prompt_lengths[b] + Tc] = completions[b]
    lengths = torch.randint(Tc // 2, Tc + 1, (B,), generator=g)
    mask = (torch.arange(Tc)[None, :] < lengths[:, None]).float()
    advantages = torch.randn(B, generator=g)
    out = {}
    for arm in args.arms:
        torch.manual_seed(0)
        model = build_model(cfg).to(dev)
        if arm.startswith("qat"):
            apply_asymmetric_qat(model)
        if "-compiled" in arm:
            model.compile_layers(dynamic=True)
        layers_module.quant_linear = straight_through_linear if arm == "qat-ste" else quant_linear
        RMSNorm.forward = rms_norm_written_out if arm == "bf16-norm-ops" else fused_rms_norm
        mb = int(re.search(r"-mb(\d+)", arm)[1]) if "-mb" in arm else micro
        sc = StepConfig(batch_size=mb, grad_accum_steps=B // mb, lr=1e-6, total_steps=100)
        opt = build_optimizer(model, sc, dev)
        loss_class = FullLogitsLoss if "full" in arm else GRPOLoss
        loss_fn = loss_class(model, grpo.LossConfig("dapo", 0.2, 0.28, 0.0, Tc), 1.0,
                             shared_group=G if "-shared" in arm else 0)
        step = TrainStep(model, opt, sc, Distributed(device=dev), loss_fn=loss_fn)
        tokens = (mask.sum() / (B // mb)).expand(B)
        batch = GRPOBatch(*(t.to(dev) if t is not None else None for t in (
            ids, prompt_lengths, completions, mask, None, advantages, None, None, None, tokens,
            torch.full((B, Tc), -1.0), None, prompt_ids)))
        forced = dispatch.force_reference() if arm.endswith("ref") else contextlib.nullcontext()
        times = []

        def one_step(i):
            loss_fn.metrics = []
            result = step(i, batch)
            float(result.loss)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            return result

        with forced, reuse_weight_operands(model, opt):
            for i in range(5):
                t = time.perf_counter()
                one_step(i)
                times.append(time.perf_counter() - t)
            activities = [torch.profiler.ProfilerActivity.CPU]
            if dev.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            with torch.profiler.profile(activities=activities) as prof:
                t = time.perf_counter()
                result = one_step(5)
                wall = time.perf_counter() - t
        by_name, launches = collections.Counter(), collections.Counter()
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                by_name[e.name[:90]] += e.device_time
                launches[e.name[:90]] += 1
        out[arm] = {
            "loss": result.loss, "grad_norm": result.grad_norm,
            "median_s": statistics.median(times[1:]), "all_s": times, "profiled_wall_s": wall,
            "kernel_ms": sum(by_name.values()) / 1e3,
            "top_kernels": [(k, round(v / 1e3, 3), launches[k]) for k, v in by_name.most_common(25)],
            "cpu_ops": prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25),
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None}
        print(arm, json.dumps({k: v for k, v in out[arm].items() if k not in ("top_kernels", "cpu_ops")}),
              flush=True)
        with open(os.path.join(args.out, "rl-train-phase.json"), "w") as f:
            json.dump(out, f, indent=1)
        model = opt = step = loss_fn = None   # the arm's GPU memory freed before the next
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()


if __name__ == "__main__":
    main()
