"""nvfp4's grouped MoE layer against bf16's, forward and backward of one layer on the CPU, the
quantize kernels under Triton's interpreter (lowbit.dispatch patched to hand CPU tensors to the
kernels, as on CUDA): the Triton launches and the top-level PyTorch operations outside them,
split into those that launch a kernel on a GPU and those that do not (views, allocations)."""
import collections, json, sys, torch
import triton.runtime.interpreter as ti
from lowbit.kernels import supports
import lowbit.dispatch._quantizers as dq
from lowbit.models.moe import Experts
from lowbit.nn import QuantExperts
from lowbit.recipes import get_recipe
from torch.profiler import profile, ProfilerActivity
dq.use_kernels = lambda x, spec, codes=True: supports(spec, codes)
real_run = ti.InterpretedFunction.run
triton_calls = collections.Counter()
def run(self, *a, **k):
    triton_calls[self.fn.__name__] += 1
    with torch.profiler.record_function("TRITON"):
        return real_run(self, *a, **k)
ti.InterpretedFunction.run = run
NO_LAUNCH = {"aten::reshape", "aten::view", "aten::unsqueeze", "aten::mT", "aten::transpose", "aten::expand",
             "aten::slice", "aten::chunk", "aten::select", "aten::empty", "aten::empty_like", "aten::t",
             "aten::permute", "aten::squeeze", "aten::split", "aten::as_strided", "aten::detach", "aten::alias",
             "aten::_unsafe_view", "aten::narrow", "aten::unflatten", "aten::flatten", "aten::lift_fresh"}
E, C, F, N, k = 8, 64, 32, 64, 2
torch.manual_seed(0)
base = Experts(E, C, F).to(torch.bfloat16)

def census(module):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, C, generator=g).to(torch.bfloat16).requires_grad_(True)
    index = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    w = torch.rand(N, k, generator=g).to(torch.bfloat16)
    module(x, index, w).float().square().sum().backward()
    triton_calls.clear()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        module(x, index, w).float().square().sum().backward()
    launch, other = collections.Counter(), collections.Counter()
    for e in prof.events():
        if not e.name.startswith("aten::"):
            continue
        p, inside, top = e.cpu_parent, False, True
        while p is not None:
            inside |= p.name == "TRITON"
            top &= not p.name.startswith("aten::")
            p = p.cpu_parent
        if not top or inside:
            continue
        if e.name == "aten::to":      # a copy only where it has an _to_copy below it
            copies = any(c.name == "aten::_to_copy" for c in e.cpu_children)
            (launch if copies else other)[e.name] += 1
        else:
            (other if e.name in NO_LAUNCH else launch)[e.name] += 1
    return {"triton_launches": dict(triton_calls), "triton_total": sum(triton_calls.values()),
            "torch_ops_that_launch": dict(launch.most_common()), "torch_launching_total": sum(launch.values()),
            "torch_ops_without_a_kernel": dict(other.most_common()), "torch_other_total": sum(other.values())}

out = {"bf16 (Experts, grouped)": census(base),
       "nvfp4 (QuantExperts, grouped)": census(QuantExperts(base, get_recipe("nvfp4").linear_for("model.layers.1.mlp.experts", 4)))}
for kk, v in out.items():
    print(kk, v["triton_total"], v["torch_launching_total"], v["torch_other_total"])
    print("  ", v["torch_ops_that_launch"])
json.dump(out, open(sys.argv[1], "w"), indent=1)
