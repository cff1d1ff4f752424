"""`lowbit qat`: quantization-aware training from a trained model, with its baselines.

A QAT run is a `lowbit.train` run (the same loop, run folder, checkpoints, exact resume,
JSONL/TensorBoard logs and plots) whose model starts from a trained run's weights with
`lowbit.qat.prepare` applied, and whose job record (job.json, lowbit.train.job_record.JobRecord)
holds the QAT settings and the source it started from, so that resume refuses a change of
either. JacQuant's B is refit in the loop's `on_step` hook.

The source is a finished `lowbit train` run folder (`--from`: its checkpoint's model and config,
both checksummed; a run without final.json only with `--allow-unfinished`, and never one another
process holds), a Hugging Face model folder (`--model PATH`: its weights are the trained model,
its tokenizer.json the tokenizer; no base training), or neither (a tiny BF16 model trained
first, cached; its final.json marks the cache complete, and a base run a kill left without one
is resumed or trained again).

`run_qat(job)` runs one QAT run per (estimator, seed) on the same data order, steps and
tokens, evaluates BF16 (the source model), RTN and GPTQ on the same validation batches, and
writes a table (`table.md`), `summary.json` and one figure of validation loss over steps with
the baselines as horizontal lines into `<out_dir>/<name>-<weights>-<arms>[-s<seeds>]-summary/`
(named by the setting, so another format, comparison or set of seeds on the same source does
not overwrite it; <name> is --run-name, default qat-<source>; -s0-1-2 for --seeds 0,1,2, none
for the default seed 0); with several estimators, also the
paired-seed statistics of `lowbit train --compare` against the first one (`seeds/summary.md`,
`seeds/seeds.png`: lowbit.train.compare.write_comparison). Each QAT run folder also gets
`quantized.safetensors`: its trained weights packed (`convert` + `packed_weights`, keyed by
Hugging Face weight names), which `lowbit export RUN` writes as they are.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lowbit.config import call_started, check_stop_after_minutes, flag, stop_after_minutes_field
from lowbit.qat.config import QATConfig
from lowbit.qat.distill import distillation
from lowbit.qat.gptq import gptq
from lowbit.formats import save_qtensors
from lowbit.qat.layers import check_model, convert, packed_weights, prepare, refresh_hook
from lowbit.recipes import RECIPES, quantizes
from lowbit.train.build import build_data, build_model, seed_everything
from lowbit.files import write_text_atomic
from lowbit.train.checkpoint import CheckpointError, content_digest, write_json_atomic
from lowbit.train.compare import (RunOutcome, RunSpec, check_run_folders, check_specs, val_curve,
                                  write_comparison)
from lowbit.train.config import FINE_TUNE_LR, OPTIMIZERS, TrainConfig, require_optimizer, resolve_device
from lowbit.train.job_record import JobRecord
from lowbit.train.loop import evaluate, train
from lowbit.train.run_dir import RunDir
from lowbit.train.step import next_token_loss

__all__ = ["QATJob", "run_qat", "source_run", "train_base", "load_source", "check_config_file",
           "source_fingerprint", "save_packed", "BASE_STEPS", "PACKED_FILE", "MODEL_FIELDS"]

PRETRAINED_BASE_LR = 1e-3
"""QAT's learning rate from a lowbit train run of a preset (the cached tiny base, say), when
--lr is not given; a trained Hugging Face model is fine-tuned at FINE_TUNE_LR instead."""

BASE_STEPS = 300   # the BF16 model `lowbit qat` trains first when given no --from
PACKED_FILE = "quantized.safetensors"   # a QAT run's packed weights (what lowbit export reads)


@dataclass
class QATJob:
    configs: list[QATConfig]
    """One QAT run per entry (and seed); `--compare ste,jacquant` gives two."""
    lr_multipliers: tuple[float, ...] = ()
    """Each entry of configs trains at lr times its multiplier (`--compare ste,ste/lrx1.5`);
    empty: 1 for all."""
    source: str | None = field(default=None, metadata=flag(
        "--from", "a finished `lowbit train` run folder to quantize (default: train a BF16 tiny "
        f"model on Tiny Shakespeare first, {BASE_STEPS} steps, cached)", metavar="RUN_DIR"))
    """A `lowbit train` run folder; None (and no model): train (once, cached) a BF16 model on
    the defaults."""
    model: str | None = field(default=None, metadata=flag(
        "--model", "a Hugging Face model folder to quantize (Llama, Qwen2, Qwen3, Qwen3-MoE): QAT "
        "starts from its weights, with its own tokenizer (instead of --from)", metavar="PATH"))
    """A Hugging Face model folder to quantize (its weights and tokenizer); excludes source."""
    corpus: str | None = field(default=None, metadata=flag(
        "--corpus", "with --model: the corpus to fine-tune on (default: tinyshakespeare)"))
    """With model: the corpus to fine-tune on (default: TrainConfig's)."""
    seq_len: int | None = field(default=None, metadata=flag(
        "--seq-len", "with --model: tokens per sequence (default: 128)"))
    """With model: tokens per sequence (default: TrainConfig's, at most the model's context)."""
    corpus_max_bytes: int | None = field(default=None, metadata=flag(
        "--corpus-max-bytes", "with --model: cut each split of the corpus to this many bytes"))
    """With model: cut each split of the corpus to this many bytes."""
    seeds: tuple[int, ...] = field(default=(0,), metadata=flag(
        "--seeds", "comma-separated seeds, one run each (default: %(default)s)", type=str))
    """One run per seed and config (the flag's text: lowbit.train.compare.parse_seeds)."""
    steps: int = field(default=200, metadata=flag("--steps", "QAT steps (default: %(default)s)"))
    lr: float | None = field(default=None, metadata=flag(
        "--lr", "peak learning rate (default: 2e-5 from a trained Hugging Face model, --model or a "
        "--from run trained from one; else 1e-3)"))
    """Peak learning rate; None: FINE_TUNE_LR (2e-5) when the source model is a trained Hugging
    Face model (--model, or a --from run trained from one), else PRETRAINED_BASE_LR (1e-3, the
    tiny bases lowbit trains itself, still learning)."""
    warmup_steps: int = field(default=10, metadata=flag("--warmup-steps", "default: %(default)s"))
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    optimizer: str = field(default="adamw", metadata=flag(
        "--optimizer", "adamw, or sgd with --momentum (where JacQuant's B on the gradient, "
        "jacquant/grad, scales each weight's step; AdamW divides it out) (default: %(default)s)",
        choices=OPTIMIZERS))
    momentum: float = field(default=0.9, metadata=flag(
        "--momentum", "SGD's momentum (default: %(default)s)", metavar="X"))
    batch_size: int | None = field(default=None, metadata=flag(
        "--batch-size", "default: the source run's"))
    eval_every: int = field(default=50, metadata=flag("--eval-every", "default: %(default)s"))
    checkpoint_every: int = field(default=100, metadata=flag(
        "--checkpoint-every", "default: %(default)s"))
    device: str = field(default="auto", metadata=flag("--device", "auto, cpu, cuda or cuda:N"))
    compile: bool = field(default=False, metadata=flag(
        "--compile", "torch.compile each run's training step and evaluations, as lowbit train "
        "--compile (JacQuant's refits run the model eagerly)", action="store_true"))
    """Each run's TrainConfig.compile: the QAT training step under torch.compile."""
    out_dir: str = field(default="runs", metadata=flag(
        "--out-dir", "parent folder of run folders (default: %(default)s)", metavar="DIR"))
    name: str = field(default="", metadata=flag(
        "--run-name", "prefix of the run folders (default: qat-<source>)", metavar="RUN_NAME"))
    stop_after_minutes: float | None = stop_after_minutes_field()
    """Wall-clock minutes after which the job stops: the run training then stops at its step's
    end, checkpointed (lowbit train's --stop-after-minutes), no later run starts, and no table
    is written; the same command with --resume continues. None: no limit."""
    base_steps: int = field(default=BASE_STEPS, metadata=flag(
        "--base-steps", "without --from: steps of the BF16 model trained first "
        "(default: %(default)s)"))
    baselines: bool = True
    baselines_only: bool = False
    """Evaluate BF16, RTN and GPTQ and train nothing."""
    gptq_batches: int = 8
    progress: bool = True
    allow_unfinished: bool = False
    """Start from a source run that has no final.json (it stopped, or its end was never
    written): from its last checkpoint."""
    resume: bool = False
    overwrite: bool = False
    rows: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.configs:
            raise ValueError("name at least one estimator, e.g. --estimator jacquant")
        self.lr_multipliers = tuple(self.lr_multipliers) or (1.0,) * len(self.configs)
        if len(self.lr_multipliers) != len(self.configs):
            raise ValueError(f"{len(self.lr_multipliers)} lr_multipliers for {len(self.configs)} "
                             "configs; give one per config, or none")
        if not all(math.isfinite(m) and m > 0 for m in self.lr_multipliers):
            raise ValueError(f"lr multipliers must be positive numbers (got {self.lr_multipliers})")
        keys = list(zip(self.configs, self.lr_multipliers))
        if len(set(keys)) != len(keys):
            raise ValueError("--compare names the same estimator twice; list each once")
        require_optimizer(self.optimizer, self.momentum)
        if not self.seeds or len(set(self.seeds)) != len(self.seeds) or min(self.seeds) < 0:
            raise ValueError(f"--seeds must be distinct non-negative integers, e.g. 0,1,2 (got {self.seeds})")
        for name in ("steps", "eval_every", "base_steps", "gptq_batches"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer (got {value!r})")
        if self.lr is not None and not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"--lr must be a positive number (got {self.lr})")
        check_stop_after_minutes(self.stop_after_minutes)
        if self.baselines_only and not self.baselines:
            raise ValueError("--baselines-only and --no-baselines exclude each other")
        if self.resume and self.overwrite:
            raise ValueError("--resume and --overwrite exclude each other; pick one")
        if self.model is not None and self.source is not None:
            raise ValueError("--model PATH and --from RUN_DIR both name the model to quantize; "
                             "give one")
        if self.model is None and (self.corpus, self.seq_len, self.corpus_max_bytes) != (None,) * 3:
            raise ValueError("--corpus, --seq-len and --corpus-max-bytes go with --model PATH "
                             "(a --from run brings its own data)")


def source_run(job: QATJob) -> Path:
    """The trained model QAT starts from: job.model (a Hugging Face folder, checked), job.source
    (a run folder, checked), or the cached default BF16 run."""
    if job.model is not None:
        from lowbit.models.hf import read_config
        read_config(job.model)   # a missing or unsupported folder: one line
        return Path(job.model)
    if job.source is not None:
        path = Path(job.source)
        RunDir(path).check_readable(job.allow_unfinished, use="start QAT from")
        return path
    config = TrainConfig(recipe="bf16", max_steps=job.base_steps, device=job.device,
                         warmup_steps=min(TrainConfig.warmup_steps, job.base_steps // 10),
                         out_dir=job.out_dir, run_name=f"base-bf16-tiny-{job.base_steps}",
                         progress=job.progress, diagnostics=False)
    run = RunDir(Path(config.out_dir) / config.name)
    if not run.finished:   # final.json: the cache is complete
        check_before_training(config, job)
        run.check_free()   # another lowbit qat training it now: refused, not taken as killed
        if job.progress:
            print(f"lowbit qat: no --from given: training the BF16 model to quantize first "
                  f"({run.path}, {job.base_steps} steps; cached for later runs)")
        train_base(config, run)
    return run.path


def train_base(config: TrainConfig, run: RunDir) -> None:
    """Train the cached base run, or finish one a killed `lowbit qat` left without final.json:
    resumed from its last checkpoint, or trained again where it has none that resumes (killed
    before its first, or all damaged); a line on stderr says which."""
    if run.checkpoints.exists():
        print(f"lowbit: warning: the cached base run {run.path} was stopped before its end; "
              f"resuming it", file=sys.stderr)
        try:
            train(config, resume=True, overwrite=False)
            return
        except CheckpointError:
            print(f"lowbit: warning: no checkpoint of {run.path} resumes (damaged, or made from "
                  f"other data); training the base run again", file=sys.stderr)
    elif any(p.exists() for p in run.produced_files()):
        print(f"lowbit: warning: the cached base run {run.path} was stopped before its first "
              f"checkpoint; training it again", file=sys.stderr)
    else:
        train(config, resume=False, overwrite=False)
        return
    train(config, resume=False, overwrite=True)


def check_before_training(base: TrainConfig, job: QATJob) -> None:
    """Refuse a weight format the base model's layers cannot take before the base trains
    (checked on a meta-device copy: no memory, no time)."""
    from lowbit.models import Transformer
    from lowbit.train.build import model_config

    with torch.device("meta"):
        model = Transformer(model_config(base))
    for qat in job.configs:
        if qat.format.grid != "bf16":
            check_model(model, qat)


def load_source(path: Path, job: QATJob | None = None) -> tuple[TrainConfig, dict | None]:
    """The source's TrainConfig and its model weights: a run's config and last checkpoint, or
    for a Hugging Face folder (job.model) a config of that model on job's data and None
    (lowbit.train.build.build_model loads the folder's weights)."""
    if job is not None and job.model is not None:
        fields = {k: v for k, v in (("corpus", job.corpus), ("seq_len", job.seq_len),
                                    ("corpus_max_bytes", job.corpus_max_bytes)) if v is not None}
        config = TrainConfig(model=str(path), tokenizer="model", recipe="bf16", **fields)
        from lowbit.train.build import model_config
        model_config(config)   # refuses a seq_len past the model's context, before any work
        return config, None
    saved = RunDir(path).open_train_run(allow_unfinished=True, use="start QAT from")
    checkpoint, config = saved.state, saved.config
    check_config_file(path, checkpoint["config"])
    if saved.job.kind == "qat":
        raise ValueError(f"{path} is a QAT run; start QAT from the high-precision run it came "
                         f"from ({saved.job.init_from})")
    # a recipe this process does not know (registered by the script that trained the source)
    # is named too: what matters here is only that it was not plain bf16
    if config.recipe not in RECIPES or quantizes(config.recipe):
        print(f"lowbit qat: note: {path} was trained with recipe {config.recipe}; QAT starts "
              "from its high-precision master weights")
    return config, checkpoint["model"]


# The fields of a source run's config that change the model QAT starts from, or the tokens it
# reads (its vocabulary and context come from them).
MODEL_FIELDS = ("model", "n_layers", "dim", "n_experts", "dropout", "seq_len", "corpus",
                "corpus_max_bytes", "tokenizer", "bpe_vocab_size")


def check_config_file(path: Path, saved: dict) -> None:
    """QAT reads a source run's config from its checkpoint (checksummed); its config.json, which
    anyone may edit, is refused where it says another model (MODEL_FIELDS), naming the fields."""
    file = path / "config.json"
    if not file.is_file():   # nothing to contradict the checkpoint's own config
        return
    try:
        written = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError):
        raise ValueError(f"{file} is not JSON; restore it, or write the config of its "
                         f"checkpoint back (lowbit.train.checkpoint.load_checkpoint)") from None
    if not isinstance(written, dict):
        written = {}
    changed = [f"{key} ({written[key]!r}; the checkpoint's {saved.get(key)!r})"
               for key in MODEL_FIELDS if key in written and written[key] != saved.get(key)]
    if changed:
        raise ValueError(f"{file} disagrees with its checkpoint in {', '.join(changed)}, which "
                         f"changes the model; QAT starts from the checkpoint's model: restore "
                         f"config.json, or train a run with those settings")


def source_fingerprint(path: Path, state: dict | None) -> str:
    """SHA-256 of the weights QAT starts from: a source run's (content_digest of its state
    dict), or a Hugging Face folder's safetensors files, byte for byte. A resumed QAT run
    checks it (lowbit.train.checkpoint.check_same_start): the same source moved elsewhere
    resumes, another one is refused."""
    if state is not None:
        return content_digest(state)
    digest = hashlib.sha256()
    for file in sorted(Path(path).glob("*.safetensors")):
        digest.update(file.name.encode())
        with open(file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                digest.update(chunk)
    return digest.hexdigest()


def run_config(source: TrainConfig, seed: int, job: QATJob, name: str,
               lr_multiplier: float = 1.0) -> TrainConfig:
    """The TrainConfig of one QAT run: the source's model and data, QAT's schedule at
    job.lr (or its default for this source) * lr_multiplier. (Its QAT settings and source are
    its job record's: job_record.)"""
    lr = job.lr
    if lr is None:
        # a Hugging Face model's tokenizer is "model" (TrainConfig checks it), saved with the run
        lr = FINE_TUNE_LR if source.tokenizer == "model" else PRETRAINED_BASE_LR
    fields = dict(
        recipe="bf16", seed=seed, max_steps=job.steps, max_tokens=None, lr=lr * lr_multiplier,
        warmup_steps=min(job.warmup_steps, job.steps),
        min_lr_ratio=job.min_lr_ratio, weight_decay=job.weight_decay, optimizer=job.optimizer,
        momentum=job.momentum,
        eval_every=job.eval_every, checkpoint_every=job.checkpoint_every, diagnostics=False,
        device=job.device, out_dir=job.out_dir, run_name=name, progress=job.progress,
        compile=job.compile, cuda_graph=False, dropout=0.0)
    if job.batch_size is not None:
        fields["batch_size"] = job.batch_size
    return dataclasses.replace(source, **fields)


def job_record(qat: QATConfig, source_path: Path, fingerprint: str | None) -> JobRecord:
    """What made one QAT run: its settings, and the source it starts from with that source's
    weights' fingerprint (source_fingerprint), which a resume checks."""
    return JobRecord(kind="qat", qat=qat.to_dict(), init_from=str(source_path),
                     init_fingerprint=fingerprint)


def _label(qat: QATConfig, lr_multiplier: float = 1.0, optimizer: str = "adamw") -> str:
    """The arm's name in tables and run folders: the estimator and what sets it apart."""
    suffix = "" if not qat.distill else "+kd" if qat.distill == 1 else f"+kd{qat.distill:g}"
    suffix += "" if optimizer == "adamw" else f"+{optimizer}"
    suffix += "" if lr_multiplier == 1 else f"+lrx{lr_multiplier:g}"
    if qat.format.grid == "bf16":
        return "control" + suffix
    label = qat.estimator
    if qat.learn_scales is not None and qat.learn_scales != (qat.estimator == "lsq"):
        label += "+learned" if qat.learn_scales else "+fixed"
    if qat.scale_init != "absmax":
        label += f"+{qat.scale_init}"
    if qat.estimator == "jacquant":
        label += ("" if qat.jacquant.per_element else "+group") + ("+grad" if qat.jacquant.b_on == "grad" else "")
        label += "+shuffled" if qat.jacquant.shuffle_b else ""
        label += {"bfloat16": "+bf16b", "uint8": "+u8b"}.get(qat.jacquant.b_dtype, "")
        label += "" if qat.jacquant.b_in_adamw else "+around"
    return label + suffix


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "._+-" else "-" for c in text)


def run_qat(job: QATJob) -> dict:
    """Run the job (see the module docstring); returns the summary it writes (a job stopped by
    stop_after_minutes writes none: its summary says where it stopped, under "stopped")."""
    source_path = source_run(job)
    source, state = load_source(source_path, job)
    fingerprint = source_fingerprint(source_path, state)
    base_name = job.name or _slug(f"qat-{source_path.name}")
    # Every run's config is built (and so validated) before the first one trains.
    plans = []   # (qat, seed, its TrainConfig, its label)
    for qat, multiplier in zip(job.configs, job.lr_multipliers):
        label = _label(qat, multiplier, job.optimizer)
        for seed in job.seeds:
            # a seed other than the default names its run (two commands' seeds keep their folders)
            name = _slug(f"{base_name}-{qat.weights}-{label}") + (f"-s{seed}" if tuple(job.seeds) != (0,) else "")
            plans.append((qat, seed, run_config(source, seed, job, name, multiplier), label))
    specs = [RunSpec(label, seed, config.name) for _, seed, config, label in plans]
    if len(job.configs) > 1:
        check_specs(specs)   # two estimators of one label would not pair: refused before training
    # every run's folder is checked before the first run trains; with resume, a finished run
    # is taken as it is, an unfinished one resumes, one not begun starts (lowbit.train.compare)
    todo = [] if job.baselines_only else check_run_folders(
        [(RunDir(Path(c.out_dir) / c.name), c, job_record(qat, source_path, fingerprint))
         for qat, _, c, _ in plans],
        resume=job.resume, overwrite=job.overwrite)
    device = resolve_device(job.device)
    data = build_data(source)

    def fresh_model():
        seed_everything(source.seed)
        model = build_model(source, data.vocab_size)
        if state is not None:
            model.load_state_dict(state)
        return model.to(device)

    deadline = (None if job.stop_after_minutes is None   # from the command's start, as each run's
                else call_started() + 60 * job.stop_after_minutes)
    trained = False   # a run trained in this call
    summary = {"source": str(source_path), "baselines": {}, "notes": [], "runs": []}
    if job.baselines:
        summary["baselines"] = _baselines(job, fresh_model, data, device, summary["notes"])
    for (qat, seed, config, label), state_of_run in zip(plans, todo):
        run_dir = Path(config.out_dir) / config.name
        if state_of_run == "done" and (qat.format.grid == "bf16" or (run_dir / PACKED_FILE).is_file()):
            summary["runs"].append(_finished_row(qat, seed, run_dir, label))
            continue
        if deadline is not None:   # every run stops at the job's deadline (lowbit.train's limit)
            if trained and time.time() >= deadline:
                return _stopped(summary, job, f"{run_dir} is next, not started")
            # the first run of a call takes at least a step, so every call moves the job on
            config = dataclasses.replace(config, stop_after_minutes=job.stop_after_minutes)
        trained = True
        model = fresh_model()
        hook = None
        if qat.format.grid != "bf16":   # bf16: the control, fine-tuned the same way unquantized
            report = prepare(model, qat)
            if job.progress:
                print(report if len(report.prepared) <= 12 else str(report).splitlines()[0])
            hook = refresh_hook(model, qat, seed, record_every=config.log_every)
        loss_fn = next_token_loss
        if qat.distill:   # the teacher: the source model, as it was before QAT
            loss_fn = distillation(fresh_model(), qat)
        result = train(config, resume=state_of_run != "start", overwrite=job.overwrite, model=model,
                       data=build_data(config), on_step=hook, on_optimizer=hook.attach if hook else None,
                       loss_fn=loss_fn, job=job_record(qat, source_path, fingerprint))
        del loss_fn   # the teacher
        if not RunDir(result.run_dir).finished:   # stopped at the job's time limit
            return _stopped(summary, job, f"{result.run_dir} stopped at step {result.steps}, "
                                          f"checkpointed")
        if qat.format.grid != "bf16":   # the control has nothing to pack
            save_packed(model, result.run_dir)
        summary["runs"].append({"run": str(result.run_dir), "weights": qat.weights,
                                "estimator": label, "seed": seed,
                                "val_loss": result.val_loss, "val_ppl": result.val_ppl,
                                "steps": result.steps, "tokens": result.tokens_seen,
                                "wall_time_s": result.wall_time_s})
    # named by the setting, so another format or --compare on the same source keeps this one
    labels = list(dict.fromkeys(label for _, _, _, label in plans))
    seeds = "" if tuple(job.seeds) == (0,) else "-s" + "-".join(map(str, job.seeds))   # (0,): the default
    out = Path(job.out_dir) / _slug(f"{base_name}-{job.configs[0].weights}-{'+'.join(labels)}"
                                    f"{seeds}-summary")
    out.mkdir(parents=True, exist_ok=True)
    summary["table"] = format_table(summary)
    if len(job.configs) > 1 and summary["runs"]:
        # --compare: the gaps to the first estimator over paired seeds, the statistics and
        # seed-band plot of `lowbit train --compare` (lowbit.train.compare), in <out>/seeds/
        outcomes = {}
        for _, _, config, _ in plans:
            run_dir = Path(config.out_dir) / config.name
            outcomes[config.name] = RunOutcome(val_curve(run_dir), "ok", str(run_dir))
        comparison = write_comparison(specs, outcomes, out / "seeds",
                                      title=f"QAT to {job.configs[0].weights}, {len(job.seeds)} "
                                            f"seed{'s' * (len(job.seeds) > 1)}")
        summary["comparison"] = str(comparison.table)
        summary["table"] += "\n" + comparison.table.read_text()
    write_json_atomic(out / "summary.json", summary)
    write_text_atomic(out / "table.md", summary["table"])
    summary["figure"] = str(plot_qat(summary, out / "qat.png"))
    summary["dir"] = str(out)
    return summary


def _stopped(summary: dict, job: QATJob, where: str) -> dict:
    """The summary of a job stopped by --stop-after-minutes: no table (its runs are not all
    done), the line that says where it stopped and how to go on."""
    summary["stopped"] = (f"stopped after {job.stop_after_minutes:g} minutes (--stop-after-minutes): "
                          f"{where}; run the same command with --resume to continue")
    return summary


def _finished_row(qat: QATConfig, seed: int, run_dir: Path, label: str) -> dict:
    """summary["runs"]'s entry for a run finished before (a resumed job), from its final.json."""
    final = RunDir(run_dir).final_record()
    return {"run": str(run_dir), "weights": qat.weights, "estimator": label, "seed": seed,
            "val_loss": float(final["val_loss"]), "val_ppl": float(final["val_ppl"]),
            "steps": final["steps"], "tokens": final["tokens_seen"],
            "wall_time_s": float(final["wall_time_s"])}


def save_packed(model: torch.nn.Module, run_dir: Path) -> Path:
    """The trained QAT model's weights packed (lowbit.qat.convert, in place: the model then
    evaluates as before, bit for bit) into `<run_dir>/quantized.safetensors`, keyed by
    parameter name, which for lowbit's models is the Hugging Face weight name."""
    model.eval()
    convert(model)
    path = Path(run_dir) / PACKED_FILE
    save_qtensors(path, packed_weights(model))
    return path


def _baselines(job: QATJob, fresh_model, data, device, notes: list[str]) -> dict:
    """Validation loss of the source model (bf16), RTN and GPTQ, per weight format; why a
    baseline is missing goes to `notes`."""
    out = {}
    model = fresh_model()
    out["bf16"] = evaluate(model, data.eval_batches(), device)
    for weights in sorted({c.weights for c in job.configs} - {"bf16"}):
        first = next(c for c in job.configs if c.weights == weights)
        plain = QATConfig(weights=weights, estimator="ste", scale_init=first.scale_init)
        model = fresh_model()
        prepare(model, plain)
        out[f"rtn {weights}"] = evaluate(model, data.eval_batches(), device)
        calibration = [data.train_batch(i) for i in range(job.gptq_batches)]
        if gptq(model, calibration, device):
            out[f"gptq {weights}"] = evaluate(model, data.eval_batches(), device)
        else:
            notes.append(f"No GPTQ row for {weights}: lowbit's GPTQ covers the grid formats "
                         "(intK, ternary, binary, seq2) of linear layers; nvfp4 and mxfp4 "
                         "scales follow the weights (lowbit.qat.gptq).")
    return out


def format_table(summary: dict) -> str:
    """Markdown: each method's validation loss, perplexity, and gap to BF16; with several
    seeds, mean ± standard deviation over them."""
    base = summary["baselines"].get("bf16")
    lines = ["| method | weights | val loss | ppl | gap to bf16 (loss) | seeds |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for name, loss in summary["baselines"].items():
        method, _, weights = name.partition(" ")
        gap = "" if base is None or method == "bf16" else f"{loss - base:+.4f}"
        lines.append(f"| {method} | {weights or '-'} | {loss:.4f} | {_ppl(loss):.2f} | {gap} | |")
    groups: dict[tuple[str, str], list[float]] = {}
    for r in summary["runs"]:
        groups.setdefault((r["estimator"], r["weights"]), []).append(r["val_loss"])
    for (estimator, weights), losses in groups.items():
        mean = statistics.fmean(losses)
        sd = f" ± {statistics.stdev(losses):.4f}" if len(losses) > 1 else ""
        gap = "" if base is None else f"{mean - base:+.4f}{sd}"
        lines.append(f"| {estimator} | {weights} | {mean:.4f}{sd} | {_ppl(mean):.2f} | {gap} | {len(losses)} |")
    lines += ["", *summary.get("notes", [])] if summary.get("notes") else []
    return "\n".join(lines) + "\n"


def plot_qat(summary: dict, path: Path) -> Path:
    """Validation loss (left) and perplexity (right) over steps of every QAT run, the
    baselines as horizontal lines."""
    import numpy as np

    from lowbit.train.plot import pyplot, save_figure

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(8, 5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"] * 10
    labels = sorted({(r["estimator"], r["weights"]) for r in summary["runs"]})
    for r in summary["runs"]:
        color = colors[labels.index((r["estimator"], r["weights"]))]
        evals = val_curve(r["run"])
        if evals:
            first = r is next(x for x in summary["runs"]
                              if (x["estimator"], x["weights"]) == (r["estimator"], r["weights"]))
            ax.plot(*zip(*evals), color=color, marker="o", markersize=3, alpha=0.9,
                    label=f"{r['estimator']} {r['weights']}" if first else None)
    styles = {"bf16": ("black", "-"), "rtn": ("tab:red", ":"), "gptq": ("tab:purple", "-.")}
    for name, loss in summary["baselines"].items():
        color, style = styles.get(name.split(" ")[0], ("gray", "--"))
        ax.axhline(loss, color=color, linestyle=style, linewidth=1, label=name)
    ax.set_xlabel("QAT step")
    ax.set_ylabel("validation loss (nats/token)")
    # perplexity on the right, the same curves read as exp(loss)
    ppl = ax.secondary_yaxis("right", functions=(lambda x: np.exp(np.minimum(x, 700)),
                                                 lambda p: np.log(np.maximum(p, 1e-300))))
    ppl.set_ylabel("perplexity")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    ax.set_title(f"QAT from {Path(summary['source']).name}", fontsize="medium")
    return save_figure(fig, path)


def _ppl(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf
