"""What the run tests share: stand-in training data (rows from (seed, step) alone), the
`lowbit` command run in this process, the one-line error it must print, and a finished source
run to start from, and a benchmarks/ script loaded as a module."""

import importlib.util
from pathlib import Path

import torch

from lowbit.cli import main

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 32

SMALL = ["--n-layers", "1", "--dim", "64", "--seq-len", "8", "--batch-size", "2"]
"""A one-layer model on short sequences: the flags every run test shares."""
RL = ["rl", "--n-layers", "1", "--dim", "64", "--warmstart-steps", "0", "--rollout", "bf16",
      "--align", "none", "--steps", "4", "--prompts-per-step", "2", "--num-generations", "2",
      "--max-completion-length", "4", "--eval-problems", "4", "--eval-every", "0",
      "--checkpoint-every", "2", "--device", "cpu", "--no-progress", "--run-name", "rl"]
"""A four-step `lowbit rl` that checkpoints every two steps."""


class PatternData:
    """Step i's rows depend on (seed, i) only; `shift` makes other data (another fingerprint)."""

    vocab_size = VOCAB

    def __init__(self, config, shift: int = 0):
        self.tokens = (torch.arange(2048) * 7 + shift) % VOCAB
        self.rows, self.seq_len, self.seed = config.batch_size, config.seq_len, config.seed
        self.fingerprint = f"pattern-{shift}"

    def _rows(self, g):
        starts = torch.randint(0, len(self.tokens) - self.seq_len - 1, (self.rows,), generator=g)
        return (torch.stack([self.tokens[s:s + self.seq_len] for s in starts]),
                torch.stack([self.tokens[s + 1:s + 1 + self.seq_len] for s in starts]))

    def train_batch(self, step):
        return self._rows(torch.Generator().manual_seed(self.seed * 1_000_003 + step))

    def eval_batches(self):
        return [self._rows(torch.Generator().manual_seed(7))]


def use_pattern_data(monkeypatch) -> None:
    """`lowbit train` and `lowbit qat` read PatternData instead of a corpus."""
    import lowbit.qat.run as qat_run
    import lowbit.train.loop as loop

    monkeypatch.setattr(loop, "build_data", lambda c: PatternData(c))
    monkeypatch.setattr(qat_run, "build_data", lambda c: PatternData(c))


def cli(capsys, *argv) -> tuple[int, str]:
    """Run `lowbit ARGV` in this process; (exit code, stderr)."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def one_line_error(code, err, *fragments, exit_code=2) -> str:
    """The exit code, and stderr's one `lowbit: error:` line (warnings aside) holding every
    fragment; returns the line."""
    assert code == exit_code, err
    lines = [line for line in err.strip().splitlines() if not line.startswith("lowbit: warning")]
    assert len(lines) == 1 and lines[0].startswith("lowbit: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def finished_run(tmp_path, name: str = "src", seed: int = 0):
    """A finished two-step `lowbit train` run on PatternData (a QAT --from or an export)."""
    from lowbit.train import TrainConfig, train

    config = TrainConfig(model="tiny", n_layers=1, dim=64, seq_len=8, batch_size=2, max_steps=2,
                         warmup_steps=0, eval_every=0, eval_batches=1, recipe="bf16", seed=seed,
                         device="cpu", progress=False, diagnostics=False,
                         out_dir=str(tmp_path), run_name=name)
    return train(config, data=PatternData(config)).run_dir


def script_module(path):
    """A benchmarks/ script loaded as a module, to run its main() in this process."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
