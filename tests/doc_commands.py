"""The README's and docs' `lowbit ...` commands run as written, in this process on the CPU, each
shortened by flags appended to it: argparse takes the last value, so `--steps 2000` then
`--steps 4` trains 4 steps and every other flag of the command stays as written."""

import glob

from run_helpers import cli

# per command (`bench` with its subcommand): what shortens it
SHORT = {
    "train": ["--steps", "4", "--eval-every", "2", "--eval-batches", "1", "--checkpoint-every",
              "2", "--corpus-max-bytes", "30000", "--bpe-vocab-size", "300", "--no-diagnostics",
              "--no-progress"],
    "qat": ["--steps", "2", "--base-steps", "4", "--eval-every", "2", "--no-baselines",
            "--no-progress"],
    "rl": ["--quick", "--steps", "2", "--no-progress"],
    "export": ["--no-progress"],
    "inspect": ["--no-progress"],
    "plot": [],
    "bench train": ["--steps", "1", "--warmup", "0", "--seq-len", "16", "--batch-size", "2"],
    "bench kernels": ["--shapes", "32x64", "--no-torchao"],
}
# train and rl of a preset model (not a folder): one narrow layer; rl's warm start, a few steps
PRESET = {"train": ["--n-layers", "1", "--dim", "64"],
          "rl": ["--n-layers", "1", "--dim", "64", "--warmstart-steps", "4"]}
FOLDER_DATA = ["--corpus-max-bytes", "30000", "--seq-len", "32"]   # qat --model FOLDER: less text
RANDOM = ["--random", "256x256"]              # inspect --random SHAPE: a smaller tensor


def command_name(arguments: list[str]) -> str:
    """"train", "qat", ... or, for `bench`, "bench train", "bench kernels", ..."""
    return " ".join(arguments[:2]) if arguments[0] == "bench" else arguments[0]


def shortening(arguments: list[str]) -> list[str]:
    """The flags that shorten `lowbit ARGUMENTS`."""
    from lowbit.models import is_model_folder

    name = command_name(arguments)
    models = [value for flag, value in zip(arguments, arguments[1:]) if flag == "--model"]
    folder = bool(models) and is_model_folder(models[-1])
    short = list(SHORT[name])
    if name in PRESET and not folder:   # a Hugging Face folder keeps its own size
        short += PRESET[name]
    if name == "qat" and folder:
        short += FOLDER_DATA
    if "--random" in arguments:
        short += RANDOM
    return short


def run_documented(capsys, arguments: list[str], line: str) -> None:
    """Run `lowbit ARGUMENTS` shortened; the command's exit status must be 0 (line names the
    command in the failure)."""
    # the shell's part: a pattern becomes the paths it matches
    arguments = [path for a in arguments for path in (sorted(glob.glob(a)) if "*" in a else [a])]
    code, err = cli(capsys, *arguments, *shortening(arguments))
    assert code == 0, f"{line}\n{err}"
