"""Exported bytes against the BF16 folder: a random lowbit preset saved as a Hugging Face
folder in BF16, then `lowbit export` in each layout, sizes read from the files on disk.

    PYTHONPATH=. python benchmarks/export_sizes.py --preset small --json out.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import tempfile
from pathlib import Path

import torch


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--n-experts", type=int, default=0)
    p.add_argument("--json", required=True)
    a = p.parse_args()
    from lowbit.bench import git_commit
    from lowbit.export import export_model
    from lowbit.models import ModelConfig, build_model, save_hf

    config = ModelConfig.preset(a.preset, n_experts=a.n_experts, qk_norm=a.n_experts > 0)
    torch.manual_seed(0)
    model = build_model(config).eval()
    work = Path(tempfile.mkdtemp())
    save_hf(model, work / "bf16", dtype=torch.bfloat16)
    bf16 = folder_bytes(work / "bf16")
    rows = []
    for fmt, layout in (("nvfp4", "modelopt"), ("nvfp4", "compressed-tensors"),
                        ("mxfp4", "compressed-tensors")):
        r = export_model(model, work / f"{fmt}-{layout}", format=fmt, layout=layout, progress=False)
        on_disk = folder_bytes(work / f"{fmt}-{layout}")
        rows.append({"format": fmt, "layout": layout, "bf16_folder_bytes": bf16,
                     "export_folder_bytes": on_disk, "folder_ratio": on_disk / bf16,
                     "quantized_weight_bytes": r.quantized_bytes,
                     "quantized_weight_bf16_bytes": r.quantized_bf16_bytes,
                     "quantized_weight_ratio": r.weight_ratio,
                     "packed_weights": len(r.quantized)})
        print(f"{fmt:6} {layout:19} folder {on_disk / bf16:.3f}x, quantized weights {r.weight_ratio:.4f}x")
    commit = git_commit()
    Path(a.json).write_text(json.dumps({"meta": {
        "date": datetime.date.today().isoformat(), "commit": commit, "machine": "2-core CPU",
        "command": f"PYTHONPATH=. python benchmarks/export_sizes.py --preset {a.preset}"
                   + (f" --n-experts {a.n_experts}" if a.n_experts else "") + " --json PATH",
        "model": f"lowbit preset {a.preset}" + (f" with {a.n_experts} experts" if a.n_experts else "")
                 + f", random init, {model.num_parameters() / 1e6:.1f}M parameters, vocab "
                 f"{config.vocab_size}, untied lm_head"},
        "results": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
