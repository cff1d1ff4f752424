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

With `--parallel fsdp` (TrainConfig.parallel) the model is sharded instead of replicated:
FSDP2's `fully_shard` on every transformer block (each child of a ModuleList named `layers`,
`h` or `blocks`: lowbit's and Hugging Face's decoder layers), then on the whole model, over a
1-D mesh of all ranks. Parameters, gradients and AdamW state live 1/N on each rank; each
block's weights are all-gathered for its forward and backward, and gradients reduce-scattered
(averaged, as DDP does). The batch split, logging, files, evaluation and randomness are the
ones above. A quantized layer sees the all-gathered full weight, so its quantization is the
single-process one. Checkpoints hold the full (unsharded) model and optimizer state in the
same format as without FSDP (optimizer state keyed by parameter name), so a run saved under
one mode resumes under the other, or on one process. Not supported under FSDP: MoE models (an
expert that gets no token on one rank has no gradient there, and FSDP2's reduce-scatter needs
the same parameters on every rank; use ddp) and the training diagnostics (they run extra
forward/backward passes through the model outside the training step; they are skipped with
a note).
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
    fsdp: bool = False
    """True once shard_model() applied FSDP2 to the model."""

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that writes the run folder and reports progress."""
        return self.rank == 0

    def shard_model(self, model: nn.Module) -> None:
        """FSDP2: shard `model` in place over all ranks (after any recipe conversion and the
        move to this rank's device, before the optimizer is built on its parameters)."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if getattr(getattr(model, "config", None), "is_moe", False):
            raise ValueError("--parallel fsdp does not support MoE models yet (an expert that gets "
                             "no token on one rank has no gradient for FSDP2 to reduce-scatter); "
                             "use --parallel ddp")
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        for name, module in model.named_modules():
            if isinstance(module, nn.ModuleList) and name.rsplit(".", 1)[-1] in ("layers", "h", "blocks"):
                for block in module:
                    fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.fsdp = True

    def state_dicts(self, model: nn.Module, optimizer) -> tuple[dict, dict]:
        """The full model and optimizer state, for a checkpoint. Every rank must call it
        (under FSDP it gathers the shards); only rank 0's result is complete and saved. The
        optimizer state is keyed by parameter name in every mode."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=self.fsdp)
        model_state = get_model_state_dict(model, options=options) if self.fsdp else model.state_dict()
        return model_state, get_optimizer_state_dict(model, optimizer, options=options)

    def load_state_dicts(self, model: nn.Module, optimizer, model_state: dict,
                         optimizer_state: dict) -> None:
        """Load a checkpoint's full state on every rank (each rank has read the file). Takes
        optimizer state keyed by parameter name, or by index (checkpoints written before
        FSDP support; converted through the optimizer's parameter order)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions, set_model_state_dict, set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True)
        if self.fsdp:
            set_model_state_dict(model, model_state, options=options)
        else:
            model.load_state_dict(model_state)
        if any(isinstance(key, int) for key in optimizer_state["state"]) or any(
                isinstance(i, int) for g in optimizer_state["param_groups"] for i in g["params"]):
            optimizer_state = _by_name(model, optimizer, optimizer_state)
        set_optimizer_state_dict(model, optimizer, optimizer_state, options=options)

    def wrap(self, model: nn.Module) -> nn.Module:
        """`model` in DDP when distributed (after any recipe conversion), else as it is
        (also when shard_model() made it an FSDP2 module already)."""
        if not self.enabled or self.fsdp:
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

    def sync_gradients(self, sync: bool, model: nn.Module | None = None):
        """Context for one micro-batch's backward: DDP all_reduces (FSDP reduce-scatters)
        only when `sync`."""
        if self.fsdp and model is not None:
            model.set_requires_gradient_sync(sync)
            return contextlib.nullcontext()
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

    def union(self, names: list[str]) -> list[str]:
        """The sorted union of every rank's `names` (one all_gather_object; every rank calls it)."""
        if not self.enabled:
            return sorted(set(names))
        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, list(names))
        return sorted(set().union(*gathered))

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


def _by_name(model: nn.Module, optimizer, state: dict) -> dict:
    """An optimizer state dict keyed by index (torch.optim's own format: the order of the
    parameters in the optimizer's groups) re-keyed by parameter name."""
    names = {id(p): name for name, p in model.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    groups = [{**g, "params": [order[i] for i in g["params"]]} for g in state["param_groups"]]
    return {"state": {order[i]: v for i, v in state["state"].items()}, "param_groups": groups}


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
