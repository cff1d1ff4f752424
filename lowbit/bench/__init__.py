"""`lowbit bench`: speed and numerics measured in benchmarks, printed as tables with ratios
against a baseline measured in the same run (never in unit tests).

    lowbit bench train      step time and peak memory of recipes on one model (lowbit.bench.train)
    lowbit bench kernels    the quantize kernels' GB/s against a copy and torchao; --check: bit
                            for bit against the reference first (lowbit.bench.kernels)
    lowbit bench fp8        the exact MXFP4 GEMM on FP8 tensor cores: fold checks, error against
                            fp64, GEMM and fold timings (lowbit.bench.fp8)
    lowbit bench folds      which layers' operands the sync-free FP8 folds round, per training
                            step (lowbit.bench.folds)
    lowbit bench recipes    several `lowbit train` runs side by side on one GPU, one table and
                            plots (lowbit.bench.recipes)
    lowbit bench rollout    the RL rollout engine's decode speed in every precision mode against
                            transformers' generate, and the bandwidth limit (lowbit.bench.rollout)

Every subcommand runs on the CPU too, as a smoke test of itself (small shapes; the Triton
kernels under TRITON_INTERPRET=1, or `--smoke`), which CI runs; its numbers mean something on
a GPU only. Each takes --json PATH to write its rows (recipes: --out DIR for its folder).
Measured results go in docs/results/, with the command that produced them.

The subcommands' flags and runs live in _cli, the results-file helpers in _records, the
device choice of the kernel benchmarks in _devices.
"""

from lowbit.bench._cli import add_arguments, parse_shapes, run
from lowbit.bench._devices import kernel_device, smoke_or_gpu
from lowbit.bench._records import git_commit, run_meta, write_json
from lowbit.bench.kernels import bench_kernels, format_kernel_rows
from lowbit.bench.timing import format_profiles
from lowbit.bench.train import bench_train, format_rows

__all__ = ["bench_train", "bench_kernels", "format_rows", "format_kernel_rows",
           "format_profiles", "add_arguments", "run", "write_json", "parse_shapes",
           "kernel_device", "smoke_or_gpu", "run_meta", "git_commit"]
