"""What a training step does when its sync-free FP8 folds were inexact (TrainConfig.fold_inexact).

FP8-GEMM recipes (stable-fp4-fp8) fold their MXFP4 operands into E4M3 without host syncs:
one power-of-two factor per row, under a deferred fold check that counts on the device the
values this leaves inexact (lowbit.dispatch.fold_check). The count comes back with the step's
loss. When it is nonzero:
- "redo" (the default): the step's gradients are computed again from the same RNG state with
  exact, K-chunked folds, so the step is the one an all-exact run takes;
- "adapt": redo, and move the layers whose exact folds needed K-chunks to the emulated path
  for the rest of the run (the same FP4 values, a bf16 GEMM), so they stop costing redos;
  the moved layers are kept in checkpoints. An MoE layer's experts (lowbit.nn.QuantExperts,
  whose grouped GEMMs report their folds as "<module>.gate_up_proj" / ".down_proj") move as
  one module, both projections: they share one recipe;
- "round": keep the step, and log the count.
"""

from __future__ import annotations

import torch.nn as nn

__all__ = ["FoldPolicy"]


class FoldPolicy:
    """The run's fold_inexact mode and the layers it moved off the FP8 GEMMs."""

    def __init__(self, mode: str, model: nn.Module) -> None:
        if mode not in ("redo", "adapt", "round"):
            raise ValueError(f"fold_inexact must be redo, adapt or round (got {mode!r})")
        self.mode, self.model = mode, model
        self.emulated_layers: list[str] = []
        if mode == "adapt":
            self._name_layers()

    @property
    def redoes(self) -> bool:
        """An inexact step is computed again (redo and adapt); "round" keeps it."""
        return self.mode != "round"

    @property
    def watches(self) -> bool:
        """A redone step records which layers needed K-chunks (adapt)."""
        return self.mode == "adapt"

    def restore(self, names: list[str]) -> None:
        """On resume: the layers a checkpoint says were moved, moved again."""
        self.emulated_layers = sorted(self.emulated_layers + self.emulate(names))

    def adapt(self, chunked: list[str]) -> list[str]:
        """After a redone step: move the layers whose exact folds needed K-chunks; returns
        those that moved (were still on the FP8 path)."""
        moved = self.emulate(chunked)
        self.emulated_layers = sorted(self.emulated_layers + moved)
        return moved

    def emulate(self, names: list[str]) -> list[str]:
        """Move these quantized linears (or experts modules: a projection's name stands for its
        module) from the FP8 GEMMs to the emulated ones (the same FP4 operands); returns the
        module names that were on the FP8 path."""
        from lowbit.nn import QuantExperts
        from lowbit.recipes import Gemm

        moved = []
        for name in names:
            parent, _, leaf = name.rpartition(".")
            if leaf in ("gate_up_proj", "down_proj") and isinstance(
                    self.model.get_submodule(parent), QuantExperts):
                name = parent
            module = self.model.get_submodule(name)
            if (name not in moved and module.linear_recipe is not None
                    and module.linear_recipe.gemm is Gemm.FP8):
                module.linear_recipe = module.linear_recipe.with_gemm(Gemm.EMULATED)
                moved.append(name)
        return moved

    def _name_layers(self) -> None:
        """Each quantized linear reports its chunked FP8 folds under its name in this model,
        the name emulate() and checkpoints use. Only under adapt: torch.compile reads the name
        as a constant, so blocks with other names would each compile again."""
        from lowbit.nn import QuantExperts, QuantLinear

        for name, m in self.model.named_modules():
            if isinstance(m, (QuantLinear, QuantExperts)):
                m.layer_name = name
