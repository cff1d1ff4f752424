"""Tests of lowbit.train on the CPU: exact resume, invariances, failure handling, files.

Most tests train a stand-in model on stand-in data defined here (milliseconds per step),
so they test the loop, not lowbit.models or lowbit.data; one integration test at the end
runs the real ones.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shutil
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import lowbit.train.loop as loop
import lowbit.train.step as step_module
from lowbit.train import (NonFiniteLossError, TrainConfig, compare, learning_rate_at,
                          plot_runs, train)
from lowbit.train.build import param_groups
from lowbit.train.checkpoint import checkpoint_path, load_checkpoint, save_checkpoint
from lowbit.train.cli_args import (add_plot_arguments, add_train_arguments, config_from_args,
                                   run_plot, run_train)

VOCAB = 32


class StandInLM(nn.Module):
    """Embedding -> Linear+tanh -> (dropout) -> LayerNorm -> head: every parameter kind the
    optimizer groups (embedding, matrix, bias, norm), and dropout to exercise the RNG."""

    def __init__(self, dropout: float = 0.0, dim: int = 16):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.mix = nn.Linear(dim, dim)
        self.drop = nn.Dropout(dropout)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, idx, targets):
        h = self.drop(torch.tanh(self.mix(self.embed(idx))))  # (B, T, C)
        logits = self.head(self.norm(h))  # (B, T, V)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return SimpleNamespace(logits=logits, loss=loss, aux_loss=torch.zeros(()))


class StandInData:
    """A fixed token stream with learnable structure; step i's rows depend on (seed, i) only."""

    vocab_size = VOCAB

    def __init__(self, config: TrainConfig):
        g = torch.Generator().manual_seed(1234)
        noise = torch.randint(0, VOCAB, (4096,), generator=g)
        pattern = (torch.arange(4096) * 7) % VOCAB
        keep = torch.rand(4096, generator=g) < 0.8
        self.tokens = torch.where(keep, pattern, noise)
        self.rows = config.batch_size * config.grad_accum_steps
        self.seq_len, self.seed, self.eval_rows = config.seq_len, config.seed, config.batch_size
        self.n_eval = config.eval_batches

    def _rows(self, generator, n):
        starts = torch.randint(0, len(self.tokens) - self.seq_len - 1, (n,), generator=generator)
        x = torch.stack([self.tokens[s:s + self.seq_len] for s in starts])
        y = torch.stack([self.tokens[s + 1:s + 1 + self.seq_len] for s in starts])
        return x, y

    def train_batch(self, step):
        return self._rows(torch.Generator().manual_seed(self.seed * 1_000_003 + step), self.rows)

    def eval_batches(self):
        g = torch.Generator().manual_seed(-1 & 0xFFFF)
        return [self._rows(g, self.eval_rows) for _ in range(self.n_eval)]


def make_config(tmp_path, **overrides) -> TrainConfig:
    fields = dict(out_dir=str(tmp_path), run_name="run", max_steps=8, warmup_steps=2,
                  batch_size=4, seq_len=16, lr=1e-2, eval_every=4, eval_batches=2,
                  log_every=1, checkpoint_every=4, progress=False, device="cpu", recipe="bf16")
    return TrainConfig(**{**fields, **overrides})


def run(config, dropout=0.0, init_seed=0, **kwargs):
    torch.manual_seed(init_seed)
    return train(config, model=StandInLM(dropout), data=StandInData(config), **kwargs)


def records(run_dir, event):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == event]


class Crash(Exception):
    pass


# --- exact resume ---------------------------------------------------------------------------

def test_resume_reproduces_the_uninterrupted_run_bit_for_bit(tmp_path):
    whole = run(make_config(tmp_path, run_name="whole", max_steps=12, checkpoint_every=6),
                dropout=0.2)

    def crash_at_step_8(model, batch, step):
        if step == 8:
            raise Crash()
        return {}

    cut = make_config(tmp_path, run_name="cut", max_steps=12, checkpoint_every=6, diag_every=1)
    with pytest.raises(Crash):
        run(cut, dropout=0.2, diagnostics_fn=crash_at_step_8)
    assert load_checkpoint(checkpoint_path(tmp_path / "cut"))["step"] == 6
    # A differently initialized model: every weight must come from the checkpoint.
    resumed = run(cut, dropout=0.2, init_seed=99, resume=True)

    assert len(whole.train_losses) == 12
    assert resumed.train_losses == whole.train_losses  # exact float equality
    assert resumed.val_loss == whole.val_loss
    # metrics.jsonl was cut back to the checkpoint: steps 7 and 8 of the crashed session
    # appear once, from the resumed session.
    steps = [r["step"] for r in records(tmp_path / "cut", "train")]
    assert steps == list(range(1, 13))
    assert [r["loss"] for r in records(tmp_path / "cut", "train")] == whole.train_losses


def test_a_step_hook_can_end_the_run_early(tmp_path):
    # the hook's "stop" ends the run after that step: evaluated and checkpointed as the last
    # step; the other keys are logged; the LR schedule stays max_steps'
    config = make_config(tmp_path, max_steps=10, eval_every=0, checkpoint_every=0)
    result = run(config, on_step=lambda step: {"seen": step, "stop": step == 3})
    assert result.steps == 3
    run_dir = tmp_path / "run"
    assert [r["step"] for r in records(run_dir, "eval")] == [3]
    assert [r["seen"] for r in records(run_dir, "hook")] == [1, 2, 3]
    assert "stop" not in records(run_dir, "hook")[0]
    assert load_checkpoint(checkpoint_path(run_dir))["step"] == 3
    assert json.loads((run_dir / "final.json").read_text())["steps"] == 3
    lrs = [r["lr"] for r in records(run_dir, "train")]
    assert lrs == [learning_rate_at(s, config) for s in range(3)]


def test_resume_refuses_a_changed_config_and_a_folder_without_checkpoint(tmp_path):
    config = make_config(tmp_path, max_steps=4)
    with pytest.raises(ValueError, match="has no checkpoint"):
        run(config, resume=True)
    run(config)
    with pytest.raises(ValueError, match=r"lr: 0\.01 -> 0\.02"):
        run(make_config(tmp_path, max_steps=4, lr=2e-2), resume=True)
    with pytest.raises(ValueError, match="already holds a run"):
        run(config)
    # Fields that only change what is observed may differ.
    run(make_config(tmp_path, max_steps=4, log_every=2, eval_batches=1), resume=True)


def test_diagnostics_are_logged_and_do_not_perturb_the_run(tmp_path):
    plain = run(make_config(tmp_path, run_name="plain"), dropout=0.2)
    calls = []

    def diagnostics(model, batch, step):
        calls.append(step)
        torch.rand(100)  # draws from the global RNG, as a sampling diagnostic might
        model.eval()
        return {"weight_rms": model.mix.weight.pow(2).mean().sqrt().item()}

    observed = run(make_config(tmp_path, run_name="observed", diag_every=3), dropout=0.2,
                   diagnostics_fn=diagnostics)
    assert calls == [3, 6]
    assert observed.train_losses == plain.train_losses
    logged = records(tmp_path / "observed", "diagnostics")
    assert [r["step"] for r in logged] == [3, 6] and all("weight_rms" in r for r in logged)


# --- invariances ------------------------------------------------------------------------------

def test_gradient_accumulation_matches_one_big_batch(tmp_path):
    big = make_config(tmp_path, run_name="big", batch_size=8, grad_accum_steps=1, max_steps=6)
    accumulated = make_config(tmp_path, run_name="acc", batch_size=4, grad_accum_steps=2,
                              max_steps=6)
    assert big.tokens_per_step == accumulated.tokens_per_step
    a, b = run(big), run(accumulated)
    torch.testing.assert_close(torch.tensor(a.train_losses), torch.tensor(b.train_losses),
                               rtol=1e-5, atol=1e-6)
    weights_a = load_checkpoint(checkpoint_path(a.run_dir))["model"]
    weights_b = load_checkpoint(checkpoint_path(b.run_dir))["model"]
    for name in weights_a:
        torch.testing.assert_close(weights_a[name], weights_b[name], rtol=1e-4, atol=1e-6)


def test_weight_decay_spares_norms_biases_and_embeddings():
    model = StandInLM()
    groups = param_groups(model, weight_decay=0.1)
    decayed = {id(p) for p in groups[0]["params"]}
    assert decayed == {id(model.mix.weight), id(model.head.weight)}
    # The rest: the embedding, two biases and the LayerNorm's weight and bias.
    assert groups[1]["weight_decay"] == 0.0 and len(groups[1]["params"]) == 5


# --- non-finite losses ------------------------------------------------------------------------

class PoisonedLM(StandInLM):
    """Returns a NaN loss on the training forwards (1-based) listed in `poisoned`."""

    def __init__(self, poisoned):
        super().__init__()
        self.poisoned, self.calls = poisoned, 0

    def forward(self, idx, targets):
        out = super().forward(idx, targets)
        if self.training:
            self.calls += 1
            if self.calls in self.poisoned:
                out.loss = out.loss * float("nan")
        return out


def test_a_nonfinite_step_is_skipped_and_logged(tmp_path):
    config = make_config(tmp_path)
    torch.manual_seed(0)
    result = train(config, model=PoisonedLM({3}), data=StandInData(config))
    assert result.steps == 8 and math.isnan(result.train_losses[2])
    assert math.isfinite(result.val_loss)
    skipped = records(tmp_path / "run", "nonfinite_skip")
    assert [(r["step"], r["loss"], r["in_a_row"]) for r in skipped] == [(3, "nan", 1)]


def test_consecutive_nonfinite_steps_stop_the_run_and_keep_the_checkpoint(tmp_path):
    config = make_config(tmp_path, max_steps=20, max_consecutive_nonfinite=3)
    torch.manual_seed(0)
    with pytest.raises(NonFiniteLossError, match="3 steps in a row") as stopped:
        train(config, model=PoisonedLM(set(range(6, 100))), data=StandInData(config))
    assert stopped.value.step == 8
    assert "\n" not in str(stopped.value)
    saved = load_checkpoint(stopped.value.checkpoint)
    assert saved["step"] == 4
    assert all(torch.isfinite(t).all() for t in saved["model"].values())
    assert len(records(tmp_path / "run", "nonfinite_skip")) == 3


# --- checkpoints ------------------------------------------------------------------------------

def test_a_crash_while_writing_a_checkpoint_leaves_the_previous_one_intact(tmp_path, monkeypatch):
    real_save = torch.save

    def save_then_crash(obj, f, *args, **kwargs):
        if obj["step"] >= 4:
            f.write(b"half a checkpoint")
            raise OSError("disk full (simulated)")
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save_then_crash)
    with pytest.raises(OSError, match="simulated"):
        run(make_config(tmp_path, checkpoint_every=2))
    folder = checkpoint_path(tmp_path / "run").parent
    assert [p.name for p in folder.iterdir()] == ["latest.pt"]  # no temp file left behind
    assert load_checkpoint(folder / "latest.pt")["step"] == 2


def test_save_checkpoint_replaces_atomically(tmp_path):
    path = tmp_path / "c.pt"
    save_checkpoint({"version": 1, "step": 1}, path)
    save_checkpoint({"version": 1, "step": 2}, path)
    assert load_checkpoint(path)["step"] == 2 and len(list(tmp_path.iterdir())) == 1


# --- config, schedule, CLI --------------------------------------------------------------------

@pytest.mark.parametrize("overrides, message", [
    (dict(lr=0.0), "lr must be a positive number"),
    (dict(batch_size=0), "batch_size must be a positive integer"),
    (dict(max_steps=10, warmup_steps=20), r"warmup_steps \(20\) exceeds the run's 10 steps"),
    (dict(betas=(0.9, 1.0)), "betas must be two numbers in"),
    (dict(grad_clip=-1.0), "grad_clip must be >= 0"),
    (dict(device="tpu"), "device must be auto, cpu, cuda or cuda:N"),
    (dict(run_name="a/b"), "must be a plain folder name"),
    (dict(max_tokens=0), "max_tokens must be a positive integer"),
    (dict(min_lr_ratio=2.0), r"min_lr_ratio must be in \[0, 1\]"),
    (dict(n_experts=-1), "n_experts must be >= 0"),
])
def test_config_rejects_bad_values_with_one_line(overrides, message):
    with pytest.raises(ValueError, match=message) as error:
        TrainConfig(**overrides)
    assert "\n" not in str(error.value)


def test_config_round_trips_and_counts_tokens():
    config = TrainConfig(batch_size=4, grad_accum_steps=2, seq_len=8, max_tokens=100,
                         warmup_steps=1)
    assert config.tokens_per_step == 64 and config.total_steps == 2  # 100 tokens, rounded up
    assert TrainConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    with pytest.raises(ValueError, match="unknown TrainConfig field"):
        TrainConfig.from_dict({"learning_rate": 1.0})


def test_learning_rate_schedule():
    config = TrainConfig(lr=1.0, min_lr_ratio=0.1, warmup_steps=10, max_steps=111)
    lr = [learning_rate_at(step, config) for step in range(111)]
    assert lr[0] == pytest.approx(0.1) and lr[4] == pytest.approx(0.5)  # linear warmup
    assert lr[9] == 1.0 and lr[10] == 1.0  # peak: end of warmup, start of the cosine
    assert lr[60] == pytest.approx(0.55)  # halfway down the cosine
    assert lr[110] == pytest.approx(0.1)  # min_lr on the last step
    assert all(a >= b for a, b in zip(lr[10:], lr[11:]))


def parse_train(*argv):
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    return parser.parse_args(list(argv))


def test_cli_flags_build_the_config():
    config = config_from_args(parse_train("--steps", "20", "--lr", "3e-4", "--betas", "0.8,0.9",
                                          "--no-progress", "--run-name", "x"))
    assert (config.max_steps, config.lr, config.betas) == (20, 3e-4, (0.8, 0.9))
    assert config.warmup_steps == 2 and not config.progress  # warmup shrinks to fit --steps
    assert config_from_args(parse_train()) == TrainConfig()
    with pytest.raises(ValueError, match="--betas must be two comma-separated numbers"):
        config_from_args(parse_train("--betas", "0.9"))
    with pytest.raises(ValueError, match="--compare needs two or more distinct"):
        config_from_args(parse_train("--compare", "bf16"))
    with pytest.raises(ValueError, match="lr must be a positive number"):
        config_from_args(parse_train("--lr", "-1"))
    with pytest.raises(SystemExit) as bad_type:
        parse_train("--steps", "many")
    assert bad_type.value.code == 2


def test_unknown_recipe_is_refused_before_the_run_folder_is_made(tmp_path):
    with pytest.raises(ValueError, match="recipe 'no-such-recipe'") as error:
        run(make_config(tmp_path, recipe="no-such-recipe"))
    assert "\n" not in str(error.value) and not (tmp_path / "run").exists()


def test_resume_is_exact_under_a_stochastic_rounding_recipe(tmp_path):
    # nvfp4 rounds gradients stochastically and draws random Hadamard signs, all from torch's
    # default generator, which the checkpoint must carry.
    whole = run(make_config(tmp_path, run_name="whole", recipe="nvfp4"), dropout=0.2)

    def crash_at_step_6(model, batch, step):
        if step == 6:
            raise Crash()
        return {}

    cut = make_config(tmp_path, run_name="cut", recipe="nvfp4", diag_every=1)
    with pytest.raises(Crash):
        run(cut, dropout=0.2, diagnostics_fn=crash_at_step_6)
    assert run(cut, dropout=0.2, init_seed=7, resume=True).train_losses == whole.train_losses


def force_inexact_folds(monkeypatch, count: int = 1, at=(2, 5)) -> list:
    """Make the loop's deferred fold checks count `count` inexact values at the checks numbered
    `at` (1-based: one check per step, so steps 2 and 5 of a fresh run; CPU folds are exact).
    Returns the list of checks made, for counting them."""
    from lowbit.dispatch.fold_check import deferred_fold_check

    calls = []

    @contextlib.contextmanager
    def flagging(device):
        with deferred_fold_check(device) as check:
            calls.append(check)
            if len(calls) in at:
                check.counter += count
            yield check

    monkeypatch.setattr(step_module, "deferred_fold_check", flagging)
    return calls


def test_an_inexact_sync_free_fold_redoes_the_step_from_the_same_rng_state(tmp_path, monkeypatch):
    """A step whose deferred fold check counts inexact blocks is redone (exact folds) from the
    RNG state it started with, so the run equals one where no fold was inexact. The count is
    forced here at steps 2 and 5 (CPU folds are exact); dropout and stochastic rounding make a
    redo that drew from a moved RNG give other losses."""
    whole = run(make_config(tmp_path, run_name="whole", recipe="stable-fp4-fp8"), dropout=0.2)
    calls = force_inexact_folds(monkeypatch)
    redone = run(make_config(tmp_path, run_name="redone", recipe="stable-fp4-fp8"), dropout=0.2)
    assert len(calls) == 8                  # one per step; the redos run outside a check
    assert [(r["step"], r["inexact_values"]) for r in records(tmp_path / "redone", "fold_redo")] \
        == [(2, 1), (5, 1)]
    assert redone.train_losses == whole.train_losses
    assert redone.val_loss == whole.val_loss


# --- run folder, plots, compare ---------------------------------------------------------------

def test_run_folder_holds_config_metrics_events_plot_and_final(tmp_path, figures):
    config = make_config(tmp_path, log_every=2)
    result = run(config)
    folder = tmp_path / "run"
    assert result.run_dir == folder
    assert json.loads((folder / "config.json").read_text()) == config.to_dict()
    strict = [json.loads(line, parse_constant=pytest.fail)
              for line in (folder / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in strict if r["event"] == "train"]
    assert [r["step"] for r in train_records] == [2, 4, 6, 8]
    fields = {"loss", "lr", "grad_norm", "tokens", "tokens_per_s", "step_time_s"}
    assert fields <= set(train_records[0])
    assert [r["step"] for r in strict if r["event"] == "eval"] == [0, 4, 8]
    assert list(folder.glob("events.out.tfevents.*"))
    assert (folder / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    final = json.loads((folder / "final.json").read_text())
    assert final["val_loss"] == result.val_loss and final["tokens_seen"] == 8 * 64
    assert final["val_ppl"] == pytest.approx(math.exp(final["val_loss"]))
    assert result.train_losses[-1] < result.train_losses[0]  # it learns


def test_with_figures_off_a_run_draws_none_and_lowbit_plot_draws_it_later(tmp_path, monkeypatch):
    from lowbit.cli import main

    monkeypatch.setenv("LOWBIT_FIGURES", "0")
    run(make_config(tmp_path, run_name="quiet"))
    assert (tmp_path / "quiet" / "final.json").is_file() and not (tmp_path / "quiet" / "loss.png").exists()
    assert main(["plot", str(tmp_path / "quiet"), "--out", str(tmp_path / "later.png")]) in (0, None)
    assert (tmp_path / "later.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_tensorboard_the_run_logs_jsonl_only(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import now fails
    run(make_config(tmp_path, progress=True))
    assert "tensorboard is not installed" in capsys.readouterr().out
    assert not list((tmp_path / "run").glob("events.out.tfevents.*"))
    assert records(tmp_path / "run", "train")


def test_plot_runs_writes_one_png_for_several_runs(tmp_path):
    run(make_config(tmp_path, run_name="a"))
    run(make_config(tmp_path, run_name="b", lr=3e-3))
    out = plot_runs([tmp_path / "a", tmp_path / "b"], tmp_path / "both.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    parser = argparse.ArgumentParser()
    add_plot_arguments(parser)
    run_plot(parser.parse_args([str(tmp_path / "a"), "--out", str(tmp_path / "p.png")]))
    assert (tmp_path / "p.png").is_file()
    with pytest.raises(ValueError, match="no metrics.jsonl"):
        plot_runs([tmp_path / "missing"], tmp_path / "x.png")


def test_a_long_plot_title_is_wrapped_not_cut(tmp_path, monkeypatch):
    # a title naming many runs breaks into lines that fit the figure (it was cut at its edge)
    import matplotlib.axes

    run(make_config(tmp_path, run_name="a"))
    titles = []
    real = matplotlib.axes.Axes.set_title
    monkeypatch.setattr(matplotlib.axes.Axes, "set_title",
                        lambda self, label, *a, **k: titles.append(label) or real(self, label, *a, **k))
    title = ", ".join(f"tiny-tinyshakespeare-stable-fp4-seed-{i}" for i in range(6))
    plot_runs([tmp_path / "a"], tmp_path / "t.png", title=title)
    (shown,) = titles
    assert shown.replace("\n", " ") == title and max(map(len, shown.splitlines())) <= 80


def test_the_legend_of_many_runs_is_beside_the_curves(tmp_path, monkeypatch):
    # two entries a run: past three runs the legend goes to the right of the axes (it covered
    # the curves of an 8-run comparison); up to three it stays inside
    import matplotlib.figure

    run(make_config(tmp_path, run_name="a"))
    for name in "bcd":
        shutil.copytree(tmp_path / "a", tmp_path / name)
    boxes = []
    real = matplotlib.figure.Figure.savefig

    def savefig(fig, *args, **kwargs):
        ax = fig.axes[0]
        legend = ax.get_legend().get_window_extent(fig.canvas.get_renderer())
        boxes.append((legend.x0 >= ax.get_window_extent().x1, len(ax.get_legend().get_texts())))
        return real(fig, *args, **kwargs)
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    plot_runs([tmp_path / n for n in "abcd"], tmp_path / "four.png")
    plot_runs([tmp_path / n for n in "abc"], tmp_path / "three.png")
    assert boxes == [(True, 8), (False, 6)]


@pytest.fixture
def stand_in_builders(monkeypatch):
    """Make train() build the stand-ins, as it builds lowbit.models / lowbit.data for real."""
    monkeypatch.setattr(loop, "build_data", StandInData)
    monkeypatch.setattr(loop, "build_model", lambda config, vocab_size: StandInLM())


def test_compare_tabulates_runs_on_the_same_data(tmp_path, stand_in_builders):
    base = make_config(tmp_path, run_name="a")
    configs = [base, TrainConfig(**{**base.to_dict(), "run_name": "b", "recipe": "mxfp4"})]
    comparison = compare(configs, name="cmp", progress=False)
    assert [row.status for row in comparison.rows] == ["ok", "ok"]
    assert comparison.rows[0].gap_pct == 0.0  # the baseline against itself
    # the gap is the final validation losses' (the two runs' own final.json)
    a, b = (json.loads((tmp_path / n / "final.json").read_text())["val_loss"] for n in "ab")
    assert comparison.rows[1].gap_pct == pytest.approx((b - a) / a * 100, rel=1e-12)
    assert comparison.arms[0].verdict == "one seed"
    assert comparison.figure.is_file() and "gap vs bf16" in comparison.table.read_text()
    assert (tmp_path / "cmp" / "loss.png").is_file()
    with pytest.raises(ValueError, match="differ only in recipe and seed"):
        compare([base, TrainConfig(**{**base.to_dict(), "run_name": "o", "recipe": "mxfp4",
                                      "lr": 1e-3})])
    with pytest.raises(ValueError, match="missing: mxfp4 at seed 1"):
        compare([base, configs[1], TrainConfig(**{**base.to_dict(), "run_name": "c", "seed": 1})])


def test_cli_train_runs_and_turns_nonfinite_stop_into_exit_1(tmp_path, stand_in_builders,
                                                             monkeypatch, capsys):
    common = ("--out-dir", str(tmp_path), "--steps", "4", "--batch-size", "4", "--seq-len",
              "16", "--eval-batches", "1", "--no-progress", "--device", "cpu")
    run_train(parse_train(*common))  # the default recipe, stable-fp4
    assert (tmp_path / "tiny-tinyshakespeare-stable-fp4" / "final.json").is_file()
    run_train(parse_train(*common, "--compare", "bf16,mxfp4", "--run-name", "cmp"))
    table = capsys.readouterr().out
    assert "| cmp-mxfp4 | mxfp4 | 0 |" in table and (tmp_path / "cmp" / "loss.png").is_file()
    monkeypatch.setattr(loop, "build_model",
                        lambda config, vocab_size: PoisonedLM(set(range(1, 100))))
    stop_early = ("--run-name", "nan", "--max-consecutive-nonfinite", "2", "--recipe", "bf16")
    with pytest.raises(SystemExit) as stopped:
        run_train(parse_train(*common, *stop_early))
    assert stopped.value.code == 1
    error = capsys.readouterr().err.strip()
    assert error.startswith("lowbit: error: stopped at step 2") and "\n" not in error


# --- integration with lowbit.models and lowbit.data -------------------------------------------

def test_real_model_and_corpus_train_and_resume_exactly(tmp_path, corpus_env):
    config = make_config(tmp_path, run_name="real", model="tiny", dropout=0.1,
                         corpus="tinyshakespeare", tokenizer="bytes", max_steps=6,
                         checkpoint_every=3, eval_every=3, seq_len=32, lr=3e-3)
    whole = train(config)
    assert whole.train_losses[-1] < whole.train_losses[0] and math.isfinite(whole.val_loss)
    assert whole.val_loss < math.log(256)  # better than uniform over the byte alphabet

    def crash_at_step_4(model, batch, step):
        if step == 4:
            raise Crash()
        return {}

    cut = make_config(tmp_path, **{**config.to_dict(), "run_name": "real-cut", "diag_every": 1})
    with pytest.raises(Crash):
        train(cut, diagnostics_fn=crash_at_step_4)
    assert train(cut, resume=True).train_losses == whole.train_losses


# --- --cuda-graph -----------------------------------------------------------------------------

def test_a_run_saved_before_fold_inexact_existed_resumes_as_redo(tmp_path):
    """Checkpoints written before the fold_inexact field have no such key: they resumed with
    what the field's "redo" now names, and resume refuses only a different value."""
    saved = make_config(tmp_path).to_dict()
    del saved["fold_inexact"]
    assert make_config(tmp_path).changed_fields(saved) == []
    assert make_config(tmp_path, fold_inexact="round").changed_fields(saved) == [
        "fold_inexact: 'redo' -> 'round'"]


def test_sgd_with_momentum_trains_resumes_exactly_and_builds_torch_sgd(tmp_path):
    # --optimizer sgd: torch.optim.SGD with heavy-ball momentum over the same parameter groups
    # (weight decay on matrices only, as an L2 term); its momentum buffers are checkpointed, so
    # a crash and resume gives the uninterrupted run's losses exactly; runs saved before the
    # field existed were AdamW's and resume as such
    from lowbit.train.build import build_optimizer

    whole = run(make_config(tmp_path, run_name="whole", max_steps=8, checkpoint_every=4,
                            optimizer="sgd", momentum=0.9, lr=0.05))
    assert whole.train_losses[-1] < whole.train_losses[0]

    def crash_at_step_6(model, batch, step):
        if step == 6:
            raise Crash()
        return {}

    cut = make_config(tmp_path, run_name="cut", max_steps=8, checkpoint_every=4, diag_every=1,
                      optimizer="sgd", momentum=0.9, lr=0.05)
    with pytest.raises(Crash):
        run(cut, diagnostics_fn=crash_at_step_6)
    assert "momentum_buffer" in str(load_checkpoint(checkpoint_path(tmp_path / "cut"))["optimizer"])
    assert run(cut, init_seed=99, resume=True).train_losses == whole.train_losses

    config = make_config(tmp_path, optimizer="sgd", momentum=0.5, weight_decay=0.1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt = build_optimizer(model, config, torch.device("cpu"))
    assert isinstance(opt, torch.optim.SGD) and opt.defaults["momentum"] == 0.5
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    saved = make_config(tmp_path).to_dict()
    del saved["optimizer"], saved["momentum"]
    assert make_config(tmp_path).changed_fields(saved) == []
    assert config.changed_fields(saved)[-2:] == ["momentum: 0.9 -> 0.5", "optimizer: 'adamw' -> 'sgd'"]


@pytest.mark.parametrize("flags, message", [
    (["--optimizer", "sgd", "--momentum", "1.5"], "momentum must be in [0, 1)"),
    (["--optimizer", "adam"], "invalid choice: 'adam'"),
])
def test_bad_optimizer_settings_are_refused_in_one_line(tmp_path, flags, message, capsys):
    from lowbit.cli import main
    try:
        code = main(["train", "--steps", "1", "--out-dir", str(tmp_path), *flags])
    except SystemExit as e:          # argparse's own refusals
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
    assert not any(tmp_path.iterdir())


def test_a_step_takes_any_batch_of_rows_in_its_own_type():
    """TrainStep's batch is a tuple of tensors sharing their rows (RL passes a NamedTuple of
    token ids, log-probs and advantages): micro-batches keep the batch's type and its None
    entries, and two of them update the model exactly as one accumulation by hand."""
    from typing import NamedTuple

    from lowbit.train.build import build_optimizer
    from lowbit.train.distributed import Distributed
    from lowbit.train.step import StepConfig, TrainStep

    class Rows(NamedTuple):
        x: torch.Tensor
        y: torch.Tensor
        weight: torch.Tensor
        unused: torch.Tensor | None

    seen = []

    def loss_fn(model, batch):
        seen.append((type(batch), batch.x.shape[0], batch.unused))
        return ((model(batch.x).squeeze(-1) - batch.y) ** 2 * batch.weight).mean()

    torch.manual_seed(0)
    batch = Rows(torch.randn(4, 3), torch.randn(4), torch.rand(4), None)
    config = StepConfig(batch_size=2, grad_accum_steps=2, lr=0.1, total_steps=3, grad_clip=0.0)
    stepped, by_hand = nn.Linear(3, 1), nn.Linear(3, 1)
    by_hand.load_state_dict(stepped.state_dict())
    step = TrainStep(stepped, build_optimizer(stepped, config, torch.device("cpu")), config,
                     Distributed(device=torch.device("cpu")), loss_fn=loss_fn)
    result = step(0, batch)
    assert seen == [(Rows, 2, None)] * 2
    optimizer = build_optimizer(by_hand, config, torch.device("cpu"))
    for group in optimizer.param_groups:
        group["lr"] = result.lr
    losses = [loss_fn(by_hand, Rows(*(None if t is None else t[i:i + 2] for t in batch))) / 2
              for i in (0, 2)]
    for loss in losses:
        loss.backward()
    optimizer.step()
    assert result.loss == pytest.approx(sum(loss.item() for loss in losses))
    assert all(torch.equal(a, b) for a, b in zip(stepped.parameters(), by_hand.parameters()))
    with pytest.raises(ValueError, match="the data gave 2 sequences for step 1"):
        step(1, Rows(*(None if t is None else t[:2] for t in batch)))


def test_graphed_gradients_keep_their_buffers_and_leave_unused_parameters_alone():
    """GraphedGradients (its CPU form: the body at each call) gives the gradients of the eager
    micro-batch loop; a parameter the loss does not use keeps .grad None (AdamW then skips it,
    as eagerly); a .grad that someone replaced is pointed back at the buffer before a step."""
    from lowbit.train.graphs import GraphedGradients

    torch.manual_seed(0)
    model = StandInLM()
    model.unused = nn.Parameter(torch.ones(3))
    x = torch.randint(0, VOCAB, (4, 8))
    y = torch.randint(0, VOCAB, (4, 8))

    def loss_fn(batch):
        return model(*batch).loss

    model.zero_grad(set_to_none=True)
    for a, b in zip(x.chunk(2), y.chunk(2)):
        (loss_fn((a, b)) / 2).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    eager = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    graphed = GraphedGradients(model, loss_fn, (x, y), accum=2, max_norm=0.5)
    assert model.unused.grad is None
    model.mix.weight.grad = torch.zeros_like(model.mix.weight)       # replaced: pointed back
    loss, graph_norm, inexact = graphed((x, y))
    assert model.unused.grad is None and int(inexact) == 0
    assert torch.equal(graph_norm, norm)
    for name, grad in eager.items():
        assert torch.equal(dict(model.named_parameters())[name].grad, grad), name
    assert model.mix.weight.grad is graphed.grads[[id(p) for p in graphed.params].index(
        id(model.mix.weight))]
    with pytest.raises(ValueError, match="the shapes it was captured with"):
        graphed((x[:2], y[:2]))


def test_cuda_graph_is_refused_where_a_step_cannot_be_captured(tmp_path):
    from lowbit.train.graphs import cuda_graph_refusal

    with pytest.raises(ValueError, match="captures the step on a CUDA GPU; this run is on cpu"):
        run(make_config(tmp_path, cuda_graph=True))
    assert not (tmp_path / "run").exists()          # refused before the run folder is made
    cuda = torch.device("cuda", 0)
    assert "under torchrun (2 processes)" in cuda_graph_refusal(cuda, world_size=2)
    assert cuda_graph_refusal(cuda) is None
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    assert config_from_args(parser.parse_args(["--cuda-graph"])).cuda_graph
    assert not config_from_args(parser.parse_args([])).cuda_graph


def _moe(vocab: int = VOCAB, dim: int = 64):
    from lowbit.models import ModelConfig, Transformer

    return Transformer(ModelConfig(vocab_size=vocab, dim=dim, n_layers=4, n_heads=2,
                                   max_seq_len=32, n_experts=4))


@pytest.mark.parametrize("recipe", ["bf16", "mxfp4", "stable-fp4", "nvfp4", "stable-fp4-fp8"])
def test_moe_experts_allow_a_cuda_graph_where_they_run_grouped(recipe):
    """An MoE step can be captured when every expert layer runs grouped (no host read-back of
    the token counts): bf16 experts and every emulated recipe (nvfp4's tensor scales taken per
    expert), and the FP8 recipes on the grouped FP8 GEMM; a layer that would run expert by
    expert is refused by name. On the CPU the grouped GEMM runs too, so the rule is checked
    here (the device check, which comes first for users, is left out)."""
    from lowbit.train.build import apply_recipe, resolve_recipe
    from lowbit.train.graphs import experts_refusal

    model = _moe()
    apply_recipe(model, resolve_recipe(recipe))
    cpu = torch.device("cpu")
    assert experts_refusal(model, cpu, bf16_autocast=True) is None
    # without bf16 autocast (float32 weights) no expert layer groups: the first is named
    refusal = experts_refusal(model, cpu, bf16_autocast=False)
    assert refusal.startswith("--cuda-graph needs MoE experts on the grouped GEMM") and (
        "model.layers.0.mlp.experts would run expert by expert" in refusal), refusal
    assert experts_refusal(StandInLM(), cpu, bf16_autocast=False) is None   # dense: nothing to say


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["bf16", "stable-fp4", "stable-fp4-fp8"])
def test_an_moe_step_captured_in_a_cuda_graph_equals_the_eager_step(tmp_path, recipe):
    """MoE routing reads nothing back to the host on the grouped path, so --cuda-graph captures
    an MoE model's step: its losses equal the eager run's, bit for bit."""
    fields = dict(recipe=recipe, device="cuda", max_steps=6)
    losses = []
    for name, graphed in (("eager", False), ("graphed", True)):
        torch.manual_seed(0)
        config = make_config(tmp_path, run_name=name, cuda_graph=graphed, **fields)
        losses.append(train(config, model=_moe(), data=StandInData(config)).train_losses)
    assert losses[1] == losses[0] and all(math.isfinite(x) for x in losses[0])


@pytest.mark.parametrize("device,compile", [
    ("cpu", False),
    pytest.param("cuda", False, marks=pytest.mark.gpu),
    # a GPU other than the current one: the capture and the replays must follow the inputs
    pytest.param("cuda:1", False, marks=pytest.mark.gpu(count=2)),
    # the compiled model captured (inductor on the CPU would be too slow for CI)
    pytest.param("cuda", True, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("recipe", ["bf16", "stable-fp4-fp8"])
def test_cuda_graph_run_equals_the_eager_run_and_resumes_and_redoes_exactly(tmp_path, recipe,
                                                                           compile, device,
                                                                           monkeypatch):
    """--cuda-graph replays the eager step: the same losses bit for bit (dropout and stochastic
    rounding draw the same numbers), with gradient accumulation; a graphed run that crashes
    resumes exactly (a new graph, captured on the resumed batch); a step whose graphed folds
    were inexact (forced at steps 2 and 5, with the graph's gradients spoiled) is redone
    eagerly with exact folds, and the run stays the same. On the CPU, where --cuda-graph is
    refused to users, GraphedGradients runs its body at each call: the bookkeeping around the
    graph (buffers, zeroing, the redo, resume) is checked without the capture. With compile,
    the compiled model is captured (its folds' count included) and equals the compiled eager
    run."""
    import lowbit.train.step as train_step
    from lowbit.train.graphs import GraphedGradients

    if device == "cpu":
        monkeypatch.setattr(train_step, "cuda_graph_refusal", lambda *args, **kwargs: None)
    fields = dict(recipe=recipe, device=device, grad_accum_steps=2, compile=compile)
    eager = run(make_config(tmp_path, run_name="eager", **fields), dropout=0.2)
    graphed = run(make_config(tmp_path, run_name="graphed", cuda_graph=True, **fields),
                  dropout=0.2)
    assert graphed.train_losses == eager.train_losses
    assert graphed.val_loss == eager.val_loss
    assert [r["step"] for r in records(tmp_path / "graphed", "cuda_graph_captured")] == [1]

    def crash_at_step_6(model, batch, step):
        if step == 6:
            raise Crash()
        return {}

    cut = make_config(tmp_path, run_name="cut", cuda_graph=True, diag_every=1, **fields)
    with pytest.raises(Crash):
        run(cut, dropout=0.2, diagnostics_fn=crash_at_step_6)
    assert run(cut, dropout=0.2, init_seed=7, resume=True).train_losses == eager.train_losses

    replays = []
    replay = GraphedGradients.__call__

    def flagging(self, batch):   # and spoils the gradients: the redo must redo
        loss, norm, count = replay(self, batch)
        replays.append(1)
        flagged = len(replays) in (2, 5)
        if flagged:
            torch._foreach_add_(self.grads, 1.0)
        return loss, norm, count + flagged

    monkeypatch.setattr(GraphedGradients, "__call__", flagging)
    redone = run(make_config(tmp_path, run_name="redone", cuda_graph=True, **fields), dropout=0.2)
    assert [r["step"] for r in records(tmp_path / "redone", "fold_redo")] == [2, 5]
    assert redone.train_losses == eager.train_losses


def test_fold_inexact_round_keeps_the_step_and_logs_the_count(tmp_path, monkeypatch):
    """--fold-inexact round: a step whose one-chunk folds were inexact (forced at steps 2 and
    5, as above) is not redone; the count is logged as a fold_rounded record. On the CPU the
    folds are exact either way, so the run equals the default one; a bad value is refused."""
    whole = run(make_config(tmp_path, run_name="whole", recipe="stable-fp4-fp8"))
    calls = force_inexact_folds(monkeypatch, count=3)
    kept = run(make_config(tmp_path, run_name="kept", recipe="stable-fp4-fp8",
                           fold_inexact="round"))
    assert len(calls) == 8
    assert [(r["step"], r["inexact_values"]) for r in records(tmp_path / "kept", "fold_rounded")] \
        == [(2, 3), (5, 3)]
    assert records(tmp_path / "kept", "fold_redo") == []
    assert kept.train_losses == whole.train_losses
    with pytest.raises(ValueError, match="fold_inexact must be redo, adapt or round"):
        make_config(tmp_path, fold_inexact="ignore")


def test_fold_inexact_adapt_moves_chunked_layers_off_the_fp8_path_and_resumes(tmp_path,
                                                                              monkeypatch):
    """--fold-inexact adapt: a redone step's layers whose exact folds needed K-chunks (here the
    watch reports `mix` at the forced redos of steps 2 and 5) move to the emulated path once
    (a fold_adapted record, kept in the checkpoint), the same FP4 values; a run that crashes
    after the step-4 checkpoint resumes with `mix` emulated and continues bit for bit."""
    from lowbit.dispatch.fold_check import watch_chunked_folds
    from lowbit.recipes import Gemm

    models = []
    calls = force_inexact_folds(monkeypatch)

    @contextlib.contextmanager
    def mix_is_chunked():
        with watch_chunked_folds() as seen:
            yield seen
            seen.add("mix")

    monkeypatch.setattr(step_module, "watch_chunked_folds", mix_is_chunked)

    def adapt_run(name, **kwargs):
        calls.clear()
        torch.manual_seed(kwargs.pop("init_seed", 0))
        models.append(StandInLM(0.2))
        config = make_config(tmp_path, run_name=name, recipe="stable-fp4-fp8",
                             fold_inexact="adapt", **kwargs.pop("fields", {}))
        return train(config, model=models[-1], data=StandInData(config), **kwargs)

    whole = adapt_run("whole")
    assert [(r["step"], r["layers"]) for r in records(tmp_path / "whole", "fold_adapted")] == [
        (2, ["mix"])]
    # the layers report chunked folds under their module names (adapt only: see QuantLinear)
    assert (models[-1].mix.layer_name, models[-1].head.layer_name) == ("mix", "head")
    assert models[-1].mix.linear_recipe.gemm is Gemm.EMULATED
    assert models[-1].head.linear_recipe.gemm is Gemm.FP8
    assert load_checkpoint(checkpoint_path(tmp_path / "whole"))["fold_emulated_layers"] == ["mix"]

    def crash_at_step_6(model, batch, step):
        if step == 6:
            raise Crash()
        return {}

    with pytest.raises(Crash):
        adapt_run("cut", fields=dict(diag_every=1), diagnostics_fn=crash_at_step_6)
    resumed = adapt_run("cut", init_seed=7, resume=True)   # its forced redo: its 2nd step, 6
    # mix came back emulated from the checkpoint, so the redo moved nothing more
    assert [r["step"] for r in records(tmp_path / "cut", "fold_adapted")] == [2]
    assert models[-1].mix.linear_recipe.gemm is Gemm.EMULATED
    assert resumed.train_losses == whole.train_losses


def test_compile_without_a_cpp_compiler_is_refused_in_one_line_before_anything(tmp_path, monkeypatch, capsys):
    # torch.compile writes C++ on the CPU: with no working compiler, lowbit train, lowbit rl and
    # lowbit bench train say so in one line (exit 2) before they build or write anything
    from torch._inductor import cpp_builder

    from lowbit.cli import main

    def no_compiler():
        raise RuntimeError("no working C++ compiler")

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", no_compiler)
    for argv in (["train", "--steps", "1", "--out-dir", str(tmp_path), "--device", "cpu", "--compile"],
                 ["rl", "--steps", "1", "--out-dir", str(tmp_path), "--device", "cpu", "--compile"],
                 ["bench", "train", "--device", "cpu", "--steps", "1", "--compile", "layers"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "--compile on the CPU needs a C++ compiler" in err and len(err.strip().splitlines()) == 1, err
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]
