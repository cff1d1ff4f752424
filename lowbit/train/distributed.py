"""Multi-process training through torchrun: DDP over torch.distributed, nothing home-made.

Launch (one host, one process per GPU; the flags are `lowbit train`'s, unchanged):

    torchrun --nproc_per_node 8 -m lowbit.cli train --model 1b ...
    python -m torch.distributed.run --standalone --nproc_per_node 2 -m lowbit.cli train \\
        --device cpu ...                       # CPU processes, gloo (what the tests run)

`train()` sees torchrun's RANK / WORLD_SIZE / LOCAL_RANK and calls `init_process_group`
(nccl on CUDA, each process on `cuda:LOCAL_RANK`; gloo on the CPU). Without them it runs
as one process, exactly as before. What changes under N processes:

- The batch. The global batch of step i is still `data.train_batch(i)`, a pure function of
  (seed, i), with batch_size * grad_accum_steps rows; rank r trains on rows r::N of it.
  Micro-batch k of the global batch is rows [k*B, (k+1)*B), and with B = batch_size a multiple
  of N, the k-th chunk of rank r's rows is exactly rows r::N of that micro-batch. DDP averages
  the gradients, so each update is the single-process update on the same global batch, up to
  the order of the float additions; batch_size must be a multiple of N. tokens_per_step,
  the LR schedule and the checkpoint's step count are global and do not depend on N.
- The model. Built and seeded identically on every rank (DDP also broadcasts rank 0's
  weights when it wraps), the recipe's `convert` applied before wrapping; then
  `DistributedDataParallel`. Gradients are synchronized on the last micro-batch only.
- Logging. The step loss is averaged over the ranks (an all_reduce) before it is logged or
  checked for NaN/Inf; the gradient norm is computed after DDP's all_reduce, so it is the
  same on every rank. Every rank therefore skips the same non-finite steps.
- Files. Only rank 0 writes the run folder (config, metrics.jsonl, TensorBoard events,
  checkpoints, loss.png, final.json) and prints progress. Every rank reads the checkpoint
  on resume.
- Evaluation. Every rank evaluates all eval_batches (the same batches, identical weights,
  so the same number); simple and collective-safe, at N-fold redundant eval compute.
- Randomness. Every rank draws from one random stream seeded by `seed` (the same dropout
  masks and stochastic-rounding noise positions on every rank, applied to different rows),
  which is what lets rank 0's saved RNG state resume every rank exactly. Resuming with a
  different N is allowed (N is not in the config) but exact only without dropout and
  stochastic rounding, since the per-rank tensor shapes change how many numbers are drawn.

Not here: FSDP2 (`fully_shard`); the model is replicated on every rank.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel


@dataclass
class Distributed:
    """This process's place in the job; rank 0 of world 1 when not launched by torchrun."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    owns_group: bool = False
    """True when setup() created the process group, so close() destroys it."""
    ddp: DistributedDataParallel | None = None

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that writes the run folder and reports progress."""
        return self.rank == 0

    def wrap(self, model: nn.Module) -> nn.Module:
        """`model` in DDP when distributed (after any recipe conversion), else as it is."""
        if not self.enabled:
            return model
        # An MoE expert that gets no token on one rank has no gradient there; DDP must look
        # for such parameters or it waits forever for their all_reduce.
        is_moe = getattr(getattr(model, "config", None), "is_moe", False)
        self.ddp = DistributedDataParallel(
            model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
            find_unused_parameters=is_moe)
        return self.ddp

    def shard(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a global batch: rows rank::world_size."""
        return rows[self.rank::self.world_size] if self.enabled else rows

    def sync_gradients(self, sync: bool):
        """Context for one micro-batch's backward: DDP all_reduces only when `sync`."""
        if self.ddp is None or sync:
            return contextlib.nullcontext()
        return self.ddp.no_sync()

    def average(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of `value` over the ranks (gloo has no ReduceOp.AVG: sum, then divide)."""
        if not self.enabled:
            return value
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        return value / self.world_size

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    @contextlib.contextmanager
    def main_first(self):
        """Rank 0 runs the block first, the others after it: one process fills a cache
        (the tokenized corpus) and the rest read it instead of racing to write it."""
        if not self.is_main:
            self.barrier()
        yield
        if self.is_main:
            self.barrier()

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self.owns_group = False


def setup(device: torch.device) -> Distributed:
    """Join torchrun's process group if this process was launched by it.

    `device` is the config's resolved device; under torchrun "cuda" becomes this process's
    GPU, cuda:LOCAL_RANK, and an explicit cuda:N is refused (torchrun picks the GPU)."""
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return Distributed(device=device)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        if device.index is not None and world_size > 1:
            raise ValueError(f"under torchrun each process uses cuda:LOCAL_RANK; use --device "
                             f"cuda or auto, not {device}")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo",
                                device_id=device if device.type == "cuda" else None)
    return Distributed(rank=rank, world_size=world_size, local_rank=local_rank, device=device,
                       owns_group=owns_group)


def set_own_cuda_rng_state(state: dict, process: Distributed) -> None:
    """After checkpoint.set_rng_state on rank r > 0: rank 0 saved the CUDA generators of its
    process, where only cuda:0 ever drew; every rank draws the same numbers (see the module
    docstring), so this rank's own GPU takes cuda:0's saved state."""
    if process.enabled and process.device.type == "cuda" and state["cuda"]:
        torch.cuda.set_rng_state(state["cuda"][0].cpu(), process.device)


__all__ = ["Distributed", "setup", "set_own_cuda_rng_state"]
