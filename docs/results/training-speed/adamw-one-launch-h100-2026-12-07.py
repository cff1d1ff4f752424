"""AdamW over moe-120m's parameters: torch fused AdamW, the clip, lowbit's one-launch kernel."""
import json, statistics, sys, time
import torch
from lowbit.train.config import TrainConfig
from lowbit.train.build import build_model, param_groups

dev = torch.device("cuda")
torch.manual_seed(0)
which = sys.argv[1] if len(sys.argv) > 1 else "moe-120m"
net = build_model(TrainConfig(model=which)).to(dev)
params = [p for p in net.parameters() if p.requires_grad]
n = sum(p.numel() for p in params)
for p in params:
    p.grad = torch.randn_like(p) * 1e-3
print(which, "params", n, "tensors", len(params), flush=True)

def timed(fn, reps=10, warm=3):
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)

out = {}
big = torch.empty(n, device=dev)
big2 = torch.empty(n, device=dev)
out["copy_ms"] = timed(lambda: big2.copy_(big))
out["copy_GBps"] = 2 * 4 * n / out["copy_ms"] / 1e6
del big, big2
opt = torch.optim.AdamW(param_groups(net, 0.1), lr=3e-4, fused=True)
out["torch_fused_adamw_ms"] = timed(lambda: opt.step())
out["torch_fused_adamw_GBps"] = 28 * n / out["torch_fused_adamw_ms"] / 1e6
out["clip_ms"] = timed(lambda: torch.nn.utils.clip_grad_norm_(params, 1e9))
out["norm_only_ms"] = timed(lambda: torch.linalg.vector_norm(torch.stack(torch._foreach_norm([p.grad for p in params]))))
inv = torch.tensor(1.0, device=dev)
opt.grad_scale = inv
out["torch_fused_adamw_grad_scale_ms"] = timed(lambda: opt.step())
del opt.grad_scale
found = torch.tensor(0.0, device=dev)
opt.found_inf = found
out["torch_fused_adamw_found_inf_ms"] = timed(lambda: opt.step())
del opt.found_inf
from lowbit.kernels.optimizer import adamw_step_triton as adamw_times_b_triton
from lowbit.formats.optimizer import adamw_step_scalars
ms = [torch.zeros_like(p) for p in params]; vs = [torch.zeros_like(p) for p in params]
steps = [torch.zeros((), device=dev) + 1 for _ in params]
lr = torch.tensor(3e-4, device=dev)
ss, cc, dd = adamw_step_scalars(steps, lr, 0.9, 0.95, 0.1)
for dt in (torch.bfloat16, torch.uint8):
    bs = [torch.ones_like(p, dtype=dt) for p in params]
    out[f"lowbit_kernel_b_{dt}_ms"] = timed(lambda: adamw_times_b_triton(params, [p.grad for p in params], ms, vs, bs, ss, cc, dd, 0.9, 0.95, 1e-8, None, checked=True))
    out[f"lowbit_kernel_b_{dt}_GBps"] = (28 + dt.itemsize) * n / out[f"lowbit_kernel_b_{dt}_ms"] / 1e6
    del bs
coef = torch.tensor(0.5, device=dev)
out["lowbit_kernel_no_b_ms"] = timed(lambda: adamw_times_b_triton(params, [p.grad for p in params], ms, vs, None, ss, cc, dd, 0.9, 0.95, 1e-8, None, checked=True))
out["lowbit_kernel_no_b_GBps"] = 28 * n / out["lowbit_kernel_no_b_ms"] / 1e6
out["lowbit_kernel_no_b_coef_ms"] = timed(lambda: adamw_times_b_triton(params, [p.grad for p in params], ms, vs, None, ss, cc, dd, 0.9, 0.95, 1e-8, None, checked=True, grad_coef=coef))
from lowbit import dispatch
st = [torch.zeros((), device=dev) for _ in params]
out["lowbit_dispatch_no_b_coef_ms"] = timed(lambda: dispatch.adamw_step(params, [p.grad for p in params], ms, vs, st, None, lr, 0.9, 0.95, 1e-8, 0.1, None, grad_coef=coef))
out["torch_clip_plus_fused_ms"] = out["clip_ms"] + out["torch_fused_adamw_ms"]
out["lowbit_norm_plus_kernel_ms"] = out["norm_only_ms"] + out["lowbit_dispatch_no_b_coef_ms"]
print(json.dumps(out, indent=1), flush=True)
