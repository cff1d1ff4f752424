"""A QAT run's export read back by transformers with compressed-tensors: its validation loss on
the run's own evaluation batches against the QAT model's (fake-quantized, every other parameter
rounded to BF16 as the export stores it), and the largest logit difference.

    python docs/results/jacquant/export-check-cpu-2026-12-05.py QAT_RUN EXPORT_DIR OUT.json
"""
import json
import sys
from pathlib import Path

import torch

from lowbit.bench import run_meta
from lowbit.qat import QATConfig, prepare
from lowbit.train.build import build_data, build_model
from lowbit.train.checkpoint import load_checkpoint
from lowbit.train.config import TrainConfig
from lowbit.train.job_record import JobRecord
from transformers import AutoModelForCausalLM, CompressedTensorsConfig

run, folder, out = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
checkpoint = load_checkpoint(run / "checkpoints" / "latest.pt")
config = TrainConfig.from_dict(checkpoint["config"])
data = build_data(config)
qat = build_model(config, data.vocab_size)
prepare(qat, QATConfig.from_dict(JobRecord.of_checkpoint(checkpoint).qat))
qat.load_state_dict(checkpoint["model"])
with torch.no_grad():
    for name, p in qat.named_parameters():
        if "parametrizations" not in name:
            p.copy_(p.bfloat16().float())
qat.eval()
from lowbit.export import load_exported

lowbit_read = load_exported(folder).model.float().eval()       # lowbit's reading of the folder
rounded = load_exported(folder).model.float().eval()           # ... its linear weights in BF16
with torch.no_grad():
    for name, p in rounded.named_parameters():
        if name.endswith("proj.weight"):
            p.copy_(p.bfloat16().float())
served = AutoModelForCausalLM.from_pretrained(
    folder, quantization_config=CompressedTensorsConfig(dequantize=True), dtype=torch.float32).eval()
sums, count, worst, worst_rounded = [0.0, 0.0, 0.0, 0.0], 0, 0.0, 0.0
with torch.no_grad():
    for idx, targets in data.eval_batches():
        a = qat(idx)
        a = (a.logits if hasattr(a, "logits") else a[0]).float()
        b = served(idx).logits.float()
        c, d = (m(idx) for m in (lowbit_read, rounded))
        c, d = ((x.logits if hasattr(x, "logits") else x[0]).float() for x in (c, d))
        for k, logits in enumerate((a, b, c, d)):
            sums[k] += torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                                         reduction="sum").item()
        count += targets.numel()
        worst = max(worst, (a - b).abs().max().item())
        worst_rounded = max(worst_rounded, (d - b).abs().max().item())
result = {"run": run.name, "export": Path(folder).name, "tokens": count,
          "val_loss_qat_model": sums[0] / count, "val_loss_transformers_export": sums[1] / count,
          "max_abs_logit_difference": worst,
          "val_loss_lowbit_reading_of_export": sums[2] / count,
          "val_loss_lowbit_reading_weights_in_bf16": sums[3] / count,
          "max_abs_logit_difference_transformers_vs_bf16_weights": worst_rounded}
meta = run_meta("cpu")
meta["command"] = f"python export-check-cpu-2026-12-05.py {run.name} {Path(folder).name} {out.name}"
out.write_text(json.dumps({"meta": meta, "results": result}, indent=1) + "\n")
print(json.dumps(result, indent=1))
