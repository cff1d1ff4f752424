"""Every `lowbit ...` command of the docs pages' ```bash blocks, run as written and in the
page's order on the CPU, one test per page, each command shortened by flags appended to it
(tests/doc_commands.py), as tests/test_tour.py runs the README's tour: a command that needs
what an earlier one left (`lowbit export RUN` after the run, `lowbit plot` after `--compare`)
finds it where the page says. What a page names but never makes (a Hugging Face folder, a
safetensors file, a run to start from) is made first; where a page writes a placeholder (RUN,
QAT_RUN), the command gets the path an earlier command of the page made. Commands that need a
GPU (a line marked "one GPU", --device cuda, --compile, --cuda-graph) or several processes
(torchrun) are skipped, and each page's skipped commands are checked, so a new one is noticed;
shell lines that are not lowbit (python benchmarks/..., pip) are not run. A page's ```python
blocks run after its commands where PYTHON says what they need here (a path, the CPU)."""

import re
import shlex
from pathlib import Path

import pytest
import torch
from doc_commands import run_documented
from hf_models import VOCAB, randomize, tokenizer
from test_readme import ROOT, lowbit_arguments, shell_commands

HF = "path/to/Qwen3-0.6B"                            # the pages' Hugging Face folder
QAT_RUN = "runs/qat-Qwen3-0.6B-int4-g128-jacquant"   # what `lowbit qat --model HF --weights int4:g128` makes


def save_qwen3(path: str) -> None:
    """A tiny random Qwen3 folder whose linears are 128 and 256 wide, so that int4:g128's groups
    fit them as they fit Qwen3-0.6B's (tests/hf_models.py's models are 64 and 96 wide)."""
    import transformers

    config = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
        tie_word_embeddings=False)
    model = transformers.Qwen3ForCausalLM(config)
    randomize(model)
    model.save_pretrained(path)
    tokenizer().save(str(Path(path) / "tokenizer.json"))


# --- what a page names but never makes ----------------------------------------------------------

def setup_qat(capsys) -> None:
    save_qwen3(HF)
    # `--from runs/my-bf16-run`: the user's finished bf16 run, 64 wide (int2:g64's groups must
    # divide its linears' widths, and the tiny preset's 96 they do not)
    run_documented(capsys, ["train", "--recipe", "bf16", "--dim", "64", "--run-name", "my-bf16-run"], "setup")


def setup_rl(capsys) -> None:
    save_qwen3(HF)
    # `--model model-qat`: a QAT run's low-bit export, made as docs/models.md makes it
    run_documented(capsys, ["qat", "--model", HF, "--weights", "int4:g128"], "setup")
    run_documented(capsys, ["export", QAT_RUN, "--out", "model-qat"], "setup")


def setup_numerics(capsys) -> None:
    # `lowbit inspect model.safetensors` and `lowbit inspect ./Qwen3-0.6B/`
    from safetensors.torch import save_file

    save_file({"layers.0.weight": torch.randn(64, 64)}, "model.safetensors")
    save_qwen3("Qwen3-0.6B")


# per page: what it names but never makes, made before its first command
SETUP = {
    "training": lambda capsys: None,
    "qat": setup_qat,
    "rl": setup_rl,
    "models": lambda capsys: save_qwen3(HF),
    "numerics": setup_numerics,
    "benchmarks": lambda capsys: None,
}

# per page: a placeholder argument -> the path an earlier command of the page made
PLACEHOLDERS = {
    "models": {"RUN_OR_MODEL": HF,                                 # a Hugging Face folder
               "QAT_RUN": QAT_RUN,                                 # its `lowbit qat --model`
               "RUN": "runs/Qwen3-0.6B-wikitext2-stable-fp4"},     # its `lowbit train --model`
}

# per page: what its ```python blocks name that this machine lacks -> what they run with here;
# the blocks run after the page's commands, in its order
PYTHON = {
    "models": {'"path/to/folder"': repr(HF), 'device="cuda"': 'device="cpu"'},
}
# per page whose ```python blocks do not run here: why (a new block elsewhere is noticed)
PYTHON_NOT_RUN = {
    "rl": "a sketch of a TRL script (model, reward and dataset are the user's): "
          "examples/trl_grpo.py is its running form",
}

# per page: the commands skipped, "why: the start of lowbit's arguments", in the page's order
SKIPPED = {
    "training": ["a GPU: train --compare bf16,nvfp4,stable-fp4 --seeds 0,1,2 --parallel-runs 9",
                 "a GPU: train --model 1b --seq-len 2048 --batch-size 4 --recipe stable-fp4-fp8",
                 "torchrun: train --model 1b ...",
                 "torchrun: train --model 1b --parallel fsdp ...",
                 "torchrun: bench train --model 1b --seq-len 2048 --batch-size 8"],
    "qat": [],
    "rl": [],
    "models": [],
    "numerics": [],
    "benchmarks": ["a GPU: bench train --model 1b --seq-len 2048 --batch-size 4"],
}

# per page: what its commands say they write
OUTPUTS = {
    "training": ["curves.png", "runs/small-wikitext2-nvfp4/final.json"],
    "qat": ["qwen3-int4/config.json"],
    "rl": ["policy/config.json", "runs/compare/compare-add"],
    "models": [f"{name}/config.json" for name in ("model-nvfp4", "model-nvfp4-ct", "model-mxfp4",
                                                  "model-w4a4", "model-w4a16", "model-qat", "model-bf16")],
    "numerics": [],
    "benchmarks": [],
}


def bash_lines(markdown: str) -> list[str]:
    """The lines of the markdown's ```bash blocks, backslash continuations joined."""
    blocks = re.findall(r"^```bash\n(.*?)^```", markdown, flags=re.S | re.M)
    return [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]


def skip_reason(line: str, argv: list[str], arguments: list[str]) -> str | None:
    """Why this command does not run here, or None."""
    if Path(argv[0]).name == "torchrun":
        return "torchrun"
    device = arguments[arguments.index("--device") + 1] if "--device" in arguments else ""
    if "one GPU" in line or {"--compile", "--cuda-graph"} & set(arguments) or device.startswith("cuda"):
        return "a GPU"
    return None


@pytest.mark.parametrize("page", list(SETUP))
def test_docs_page_commands_run_in_order_on_the_cpu(page, tmp_path, monkeypatch, capsys, corpus_env):
    monkeypatch.chdir(tmp_path)
    SETUP[page](capsys)
    placeholders = PLACEHOLDERS.get(page, {})
    ran, skipped = 0, []
    for line in bash_lines((ROOT / "docs" / f"{page}.md").read_text()):
        for argv in shell_commands(f"```bash\n{line}\n```"):
            arguments = lowbit_arguments(argv)
            if arguments is None:
                continue
            reason = skip_reason(line, argv, arguments)
            if reason is not None:
                skipped.append(f"{reason}: {shlex.join(arguments)}")
                continue
            arguments = [placeholders.get(a, a) for a in arguments]
            run_documented(capsys, arguments, f"docs/{page}.md: {shlex.join(argv)}")
            ran += 1
    assert ran, f"docs/{page}.md runs no `lowbit ...` command"
    markdown = (ROOT / "docs" / f"{page}.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", markdown, flags=re.S | re.M)
    assert (page in PYTHON) == bool(blocks) or page in PYTHON_NOT_RUN, (
        f"docs/{page}.md: its python blocks run here only with a PYTHON entry")
    if page in PYTHON:
        assert blocks, f"docs/{page}.md has no python block left to run"
        for block in blocks:
            for name, here in PYTHON[page].items():
                block = block.replace(name, here)
            exec(compile(block, f"docs/{page}.md", "exec"), {})
    assert len(skipped) == len(SKIPPED[page]) and all(
        command.startswith(start) for command, start in zip(skipped, SKIPPED[page])), skipped
    assert [path for path in OUTPUTS[page] if not Path(path).exists()] == []
