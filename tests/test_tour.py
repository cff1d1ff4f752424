"""README's tour, run as written and in its order on the CPU, each command shortened by flags
appended to it (tests/doc_commands.py; argparse takes the last value): a command that needs the
run an earlier one left (`--resume`, `lowbit plot`, `lowbit export`) finds it where the tour
says. The commands marked "one GPU" are skipped; the tour's placeholders (model.safetensors,
path/to/hf-model) are made first: a random tensor and a tiny random Llama folder."""

import re

import torch
from doc_commands import run_documented
from hf_models import save_hf_model
from test_readme import README, lowbit_arguments, shell_commands


def tour() -> list[str]:
    section = README.split("## A tour", 1)[1]
    (block,) = re.findall(r"```bash\n(.*?)```", section.split("\n## ", 1)[0], flags=re.S)
    return [line for line in block.splitlines() if line.strip()]


def test_the_readme_tour_runs_in_order_on_the_cpu(tmp_path, monkeypatch, capsys, corpus_env):
    from safetensors.torch import save_file

    monkeypatch.chdir(tmp_path)
    save_file({"layers.0.weight": torch.randn(64, 64)}, "model.safetensors")
    save_hf_model("llama", tmp_path / "path" / "to" / "hf-model")
    ran, skipped = [], []
    for line in tour():
        if "one GPU" in line:
            skipped.append(line)
            continue
        (argv,) = shell_commands(f"```bash\n{line}\n```")
        arguments = lowbit_arguments(argv)
        assert arguments is not None, line
        run_documented(capsys, arguments, line)
        ran.append(arguments[0])
    assert ran.count("train") >= 4 and {"qat", "rl", "export", "plot", "inspect"} <= set(ran)
    assert len(skipped) == 3
    assert (tmp_path / "curves.png").is_file() and (tmp_path / "model-nvfp4").is_dir()
