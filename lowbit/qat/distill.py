"""QAT's distillation from the model it quantizes (`lowbit qat --distill [ALPHA]`).

The teacher is the high-precision source model, frozen; the student is the fake-quantized
model being trained. Per micro-batch, over the positions that have a target (not -100),

    loss = (1 - alpha) * CE(student) + alpha * (T^2 * KL(p_teacher^T || p_student^T) + aux)

where p^T = softmax(logits / T), the KL is summed over the vocabulary and averaged over the
positions, T^2 keeps the gradient's size independent of T (Hinton et al., 2015), and aux is
the student's MoE load-balancing term (the part of its .loss that is not cross-entropy), so
alpha = 1 (pure distillation, as LLM-QAT and ParetoQ train) still balances the experts.
Validation stays cross-entropy on the data: the number QAT is judged by.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from lowbit.qat.config import QATConfig

__all__ = ["Distillation", "distillation", "distillation_kl"]


def distillation_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                    targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """T^2 * KL(softmax(teacher / T) || softmax(student / T)), summed over the vocabulary and
    averaged over the positions whose target is not -100 (0 when there are none), in float32."""
    # a mask, not boolean indexing: no host sync, so a CUDA graph can capture it
    keep = (targets.reshape(-1) != -100).float()
    vocab = student_logits.shape[-1]
    s = F.log_softmax(student_logits.reshape(-1, vocab).float() / temperature, dim=-1)
    t = F.log_softmax(teacher_logits.reshape(-1, vocab).float() / temperature, dim=-1)
    per_position = F.kl_div(s, t, log_target=True, reduction="none").sum(-1)   # (positions,)
    kl = (per_position * keep).sum() / keep.sum().clamp(min=1)
    return kl * temperature ** 2


class Distillation:
    """The training loss of a distilled QAT run: loss_fn(model, (inputs, targets)) for
    lowbit.train (lowbit.train.step.LossFn); see the module docstring."""

    def __init__(self, teacher: nn.Module, alpha: float = 1.0, temperature: float = 1.0,
                 aux_loss_coef: float = 0.0) -> None:
        if not (0 < alpha <= 1 and 0 < temperature < float("inf")):
            raise ValueError(f"distillation takes 0 < alpha <= 1 and a positive finite "
                             f"temperature (got alpha {alpha}, temperature {temperature})")
        self.teacher = teacher.eval().requires_grad_(False)
        self.alpha, self.temperature, self.aux_loss_coef = alpha, temperature, aux_loss_coef

    def __call__(self, model, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, targets = batch
        output = model(inputs, targets)
        with torch.no_grad():
            teacher_logits = self.teacher(inputs).logits
        kd = distillation_kl(output.logits, teacher_logits, targets, self.temperature)
        kd = kd + self.aux_loss_coef * output.aux_loss
        if self.alpha == 1:
            return kd
        return (1 - self.alpha) * output.loss + self.alpha * kd


def distillation(teacher: nn.Module, qat: QATConfig) -> Distillation:
    """The loss function of a QAT run with qat.distill > 0 whose high-precision model is `teacher`
    (a frozen copy of the model before lowbit.qat.prepare)."""
    coef = getattr(getattr(teacher, "config", None), "moe_aux_loss_coef", 0.0)   # x 0 if dense
    return Distillation(teacher, qat.distill, qat.distill_temperature, aux_loss_coef=coef)
