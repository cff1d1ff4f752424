"""The supervised warm start: a policy trained with lowbit.train on a task's reference
solutions, so that RL starts from partial accuracy and has room to improve.

    model = warm_start(config, say)     # trained once, then read from its run folder

It is an ordinary `lowbit train` run (the same loop, step, checkpoints) on `SolutionData`,
prompt + solution rows whose loss covers the solution tokens only, under
`<out_dir>/warmstart/<task>-<model>-<key>/`; a later RL run with the same policy, task and
warm-start settings loads that folder's checkpoint instead of training again.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
from pathlib import Path

import torch

from lowbit.data import ByteTokenizer
from lowbit.data.tasks import Task
from lowbit.models import ModelConfig, build_model
from lowbit.rl.engine import RolloutEngine
from lowbit.rl.sampling import SamplingParams
from lowbit.train import TrainConfig, train
from lowbit.train.run_dir import RunDir

__all__ = ["SolutionData", "policy_config", "policy_tokenizer", "warm_start", "encode_problem",
           "greedy_accuracy", "VALIDATION_PROBLEMS"]

TOKENIZER = ByteTokenizer()
STOP_ID = 10   # "\n" in the byte tokenizer: every task's completions end with it
VALIDATION_PROBLEMS = 256
"""Problems a warm start with a target accuracy is checked on (after the held-out set's)."""


def encode_problem(task_prompt: str) -> list[int]:
    return TOKENIZER.encode(task_prompt)


class SolutionData:
    """lowbit.train's TrainingData: rows of prompt + reference solution, padded to seq_len;
    targets are -100 on the prompt and the padding."""

    def __init__(self, task: Task, seq_len: int, batch_size: int, seed: int,
                 exclude: set[str]) -> None:
        self.task, self.seq_len, self.batch_size, self.seed = task, seq_len, batch_size, seed
        self.exclude = exclude
        self.vocab_size = TOKENIZER.vocab_size
        self._eval = self._rows(task.eval_problems(batch_size))

    def _rows(self, problems) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = torch.zeros(len(problems), self.seq_len, dtype=torch.int64)
        targets = torch.full_like(inputs, -100)
        for i, p in enumerate(problems):
            prompt, solution = TOKENIZER.encode(p.prompt), TOKENIZER.encode(p.solution)
            row = (prompt + solution)[: self.seq_len + 1]
            inputs[i, : len(row) - 1] = torch.tensor(row[:-1])
            start = len(prompt) - 1
            targets[i, start: len(row) - 1] = torch.tensor(row[start + 1:])
        return inputs, targets

    def train_batch(self, step: int):
        # warm-start draws use their own index space (negative), never the RL run's
        return self._rows(self.task.problems(self.seed, -1 - step, self.batch_size, self.exclude))

    def eval_batches(self):
        return [self._eval]


def policy_tokenizer(config) -> tuple[object, tuple[int, ...]]:
    """(tokenizer, stop token ids) of the policy: the byte tokenizer and "\n" for a preset; a
    Hugging Face folder's tokenizer.json (lowbit.data.BPETokenizer) and every token whose text
    holds a newline (a completion ends at its first line, which the tasks' rewards read), plus
    the tokenizer's end-of-text tokens."""
    from lowbit.models import is_model_folder

    if not is_model_folder(config.model):
        return TOKENIZER, (STOP_ID,)
    from lowbit.data import BPETokenizer
    from lowbit.models.hf import ModelLoadError, load_tokenizer, read_config

    read_config(config.model)   # a missing or unsupported folder: one line
    found = load_tokenizer(config.model)
    if found is None:
        raise ModelLoadError(f"{config.model} has no tokenizer.json, which RL's prompts need")
    tokenizer = BPETokenizer(found)
    stops = [i for i in range(tokenizer.vocab_size) if "\n" in tokenizer.decode([i])]
    for token in ("<|endoftext|>", "<|im_end|>", "</s>", "<|end_of_text|>", "<|eot_id|>"):
        if found.token_to_id(token) is not None:
            stops.append(found.token_to_id(token))
    if not stops:
        raise ModelLoadError(f"{config.model}'s tokenizer has no token with a newline, which "
                             f"ends the tasks' completions")
    return tokenizer, tuple(sorted(set(stops)))


def policy_config(config, task: Task) -> ModelConfig:
    """The policy's ModelConfig: the preset with the config's overrides, byte vocabulary, and
    a context that fits the task's prompts and completions; a Hugging Face folder's own
    (its context must fit them)."""
    from lowbit.models import is_model_folder

    if is_model_folder(config.model):
        from lowbit.models.hf import read_config
        built = read_config(config.model)[0]
        tokenizer, _ = policy_tokenizer(config)
        longest = max(len(tokenizer.encode(p.prompt)) for p in task.eval_problems(64))
        if longest + config.max_completion_length > built.max_seq_len:
            raise ValueError(f"{config.model}'s context ({built.max_seq_len} tokens) is shorter "
                             f"than the task's prompts ({longest} tokens) plus "
                             f"--max-completion-length {config.max_completion_length}")
        return built
    overrides = dict(vocab_size=TOKENIZER.vocab_size)
    if config.n_layers is not None:
        overrides["n_layers"] = config.n_layers
    if config.dim is not None:
        overrides.update(dim=config.dim, n_heads=max(1, config.dim // 64), ffn_dim=None)
    if config.n_experts:
        overrides.update(n_experts=config.n_experts, experts_per_token=2)
    longest = max(len(TOKENIZER.encode(p.prompt)) for p in task.eval_problems(64))
    overrides["max_seq_len"] = max(64, 2 * longest + config.max_completion_length)
    return ModelConfig.preset(config.model, **overrides)


def warm_start(config, task: Task, model_config: ModelConfig, device: str, say) -> dict:
    """The warm-started policy's state dict (trained now, or read from its cached run); a
    Hugging Face folder's weights (float32 master weights) as they are; a low-bit export's
    (lowbit export of a QAT run, say) dequantized to float32 (lowbit.export.load_exported)."""
    from lowbit.export import is_low_bit_export, load_exported
    from lowbit.models import is_model_folder, load_model

    if is_model_folder(config.model) and is_low_bit_export(config.model):
        say(f"policy: {config.model} (a low-bit export: its weights dequantized to float32, its "
            f"tokenizer; no warm start)")
        return load_exported(config.model).model.state_dict()
    if is_model_folder(config.model):
        say(f"policy: {config.model} (its own weights and tokenizer; no warm start)")
        return load_model(config.model, dtype=torch.float32)[0].state_dict()
    if config.warmstart_steps == 0:
        torch.manual_seed(config.warmstart_seed)
        return build_model(model_config).state_dict()
    key_fields = {"model": model_config.__dict__, "task": task.name, "steps": config.warmstart_steps,
                  "lr": config.warmstart_lr, "seed": config.warmstart_seed,
                  # the supervised data leaves out the held-out problems, so their number is part of it
                  "eval_problems": config.eval_problems}
    if config.warmstart_target is not None:   # (absent otherwise: earlier cached runs keep their key)
        key_fields["target"] = config.warmstart_target
    key = hashlib.sha256(json.dumps(key_fields, sort_keys=True, default=str).encode()).hexdigest()[:10]
    name = f"{task.name}-{config.model}{'-moe' + str(config.n_experts) if config.n_experts else ''}-{key}"
    run = Path(config.out_dir) / "warmstart" / name
    run.parent.mkdir(parents=True, exist_ok=True)
    # one process trains a warm start and the others (parallel runs of a comparison) wait for
    # it, then read it: a blocking lock beside the folder, dropped when this returns (or dies)
    with open(run.parent / f".{name}.lock", "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"warm start: another process holds {run} (training or reading it); waiting")
            fcntl.flock(lock, fcntl.LOCK_EX)
        return _cached_or_trained(config, task, model_config, device, say, run)


def _cached_or_trained(config, task: Task, model_config: ModelConfig, device: str, say,
                       run: Path) -> dict:
    """The warm start's state dict, read from `run` if finished there, else trained into it."""
    name = run.name
    if RunDir(run).finished:
        say(f"warm start: reading {run}")
        return RunDir(run).open().state["model"]
    exclude = {p.prompt for p in task.eval_problems(config.eval_problems)}
    if config.warmstart_target is not None:   # kept out of the training data too
        validation = task.eval_problems(config.eval_problems + VALIDATION_PROBLEMS)[config.eval_problems:]
        if len(validation) < VALIDATION_PROBLEMS // 2:
            raise ValueError(f"{task.name} has too few distinct problems for a validation set "
                             f"beside the {config.eval_problems} held-out ones: use a larger "
                             f"--task-size or fewer --eval-problems, or drop --warmstart-target")
        exclude |= {p.prompt for p in validation}
    longest = max(len(TOKENIZER.encode(p.prompt + p.solution)) for p in task.eval_problems(256))
    seq_len = min(model_config.max_seq_len, longest + 4)
    train_config = TrainConfig(
        model=config.model, recipe="bf16", seq_len=seq_len, batch_size=32,
        max_steps=config.warmstart_steps, lr=config.warmstart_lr,
        warmup_steps=min(20, config.warmstart_steps), weight_decay=0.0, eval_every=0,
        log_every=max(1, config.warmstart_steps // 4), checkpoint_every=0, diagnostics=False,
        progress=config.progress, seed=config.warmstart_seed, device=device,
        out_dir=str(run.parent), run_name=name)
    say(f"warm start: {config.warmstart_steps} supervised steps on {task.name} solutions -> {run}")
    torch.manual_seed(config.warmstart_seed)
    model = build_model(model_config)
    data = SolutionData(task, seq_len, train_config.batch_size, config.warmstart_seed, exclude)
    on_step = None
    if config.warmstart_target is not None:
        every = max(1, config.warmstart_steps // 40)
        engine = RolloutEngine(model_config, "bf16", device=device, max_batch_size=len(validation))

        def on_step(step: int) -> dict | None:
            if step % every and step != config.warmstart_steps:
                return None
            engine.load_state_dict(model.state_dict())
            accuracy = greedy_accuracy(engine, task, TOKENIZER, validation,
                                       config.max_completion_length, (STOP_ID,))
            reached = accuracy >= config.warmstart_target
            if reached:
                say(f"warm start: validation accuracy {accuracy:.3f} at step {step} reached the "
                    f"target {config.warmstart_target}")
            return {"validation_accuracy": accuracy, "stop": reached}
    train(train_config, model=model, data=data, overwrite=True, on_step=on_step)
    return RunDir(run).open().state["model"]


def greedy_accuracy(engine: RolloutEngine, task: Task, tokenizer, problems: list,
                    max_new_tokens: int, stop_ids: tuple[int, ...]) -> float:
    """The fraction of `problems` the engine (its precision, current weights) answers right,
    decoding greedily in chunks of its max_batch_size."""
    params = SamplingParams(temperature=0, max_new_tokens=max_new_tokens, stop_token_ids=stop_ids)
    correct = 0.0
    for i in range(0, len(problems), engine.max_batch_size):
        chunk = problems[i:i + engine.max_batch_size]
        rollout = engine.generate([tokenizer.encode(p.prompt) for p in chunk], params)
        texts = [tokenizer.decode(ids) for ids in rollout.completion_lists()]
        correct += sum(task.reward(p, t) for p, t in zip(chunk, texts))
    return correct / len(problems)
