"""Verifiable tasks for RL: seeded generators of problems with exact-match rewards, and GSM8K.

    task = get_task("add", digits=2)
    problems = task.problems(seed=0, index=step, count=8)   # a pure function of its arguments
    task.reward(problems[0], completion_text)               # 1.0 or 0.0
    task.eval_problems(200)                                  # held out: never in a training draw

Every completion ends with a newline (the stop token of the byte tokenizer, id 10); a
problem's `solution` is the reference completion a supervised warm start trains on.

- `add`: "a+b=" with a, b of `digits` digits; the answer is the sum.
- `add-worked`: the same problems, the completion adding the columns from the right with their
  carries before the sum ("47+85=" -> "7+5=12 4+8+1=13 =132"): long completions.
- `mul`: "a*b=" with a of `digits` digits and b of one digit.
- `countdown`: "countdown 3 7 5 -> 26:" -- combine all the numbers, each once, with + - *
  (usual precedence) to reach the target; any correct expression scores 1. Targets come from
  a random expression over the numbers, so every problem has a solution.
- `gsm8k`: grade-school math word problems from `<data>/gsm8k/{train,test}.jsonl` (the shared
  data folder, lowbit.data.data_root); the reward matches the last number of the completion
  against the answer after "####" (the reference solution's steps joined on one line). For
  models with a BPE tokenizer; the held-out set is test.
"""

from __future__ import annotations

import ast
import decimal
import json
import random
import re
from dataclasses import dataclass

from lowbit.data.corpora import data_root

__all__ = ["Problem", "Task", "TASKS", "get_task", "STOP_TEXT"]

STOP_TEXT = "\n"
_EVAL_SEED = 0x5EED_E7A1


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str
    """What the reward compares against (the number, or the countdown target)."""
    solution: str
    """A correct completion, stop text included (for the supervised warm start)."""


class Task:
    name = ""

    def sample(self, rng: random.Random) -> Problem:
        raise NotImplementedError

    def reward(self, problem: Problem, completion: str) -> float:
        """1.0 for a correct completion (text up to the first stop), else 0.0."""
        return float(completion.split(STOP_TEXT, 1)[0].strip() == problem.answer)

    def eval_problems(self, count: int) -> list[Problem]:
        """The held-out set: `count` problems from a seed no training draw uses, distinct."""
        rng, seen, out = random.Random(_EVAL_SEED), set(), []
        for _ in range(count * 50):
            p = self.sample(rng)
            if p.prompt not in seen:
                seen.add(p.prompt)
                out.append(p)
            if len(out) == count:
                break
        return out

    def problems(self, seed: int, index: int, count: int, exclude: set[str] | None = None) -> list[Problem]:
        """`count` training problems for draw `index` of a run seeded `seed` (a pure function
        of the three); prompts in `exclude` (the held-out set's) are redrawn."""
        rng = random.Random(f"{self.name}:{seed}:{index}")
        out, rejected = [], 0
        while len(out) < count:
            p = self.sample(rng)
            if exclude is None or p.prompt not in exclude:
                out.append(p)
            else:
                rejected += 1
                if rejected > 100 * count:
                    raise ValueError(f"the held-out set covers (nearly) all of {self.name}'s "
                                     f"problems; evaluate on fewer (--eval-problems) or use a "
                                     f"larger task (--task-size)")
        return out


class Addition(Task):
    def __init__(self, digits: int = 2) -> None:
        if not 1 <= digits <= 12:
            raise ValueError(f"digits must be in 1..12 (got {digits})")
        self.digits, self.name = digits, f"add{digits}"

    def _number(self, rng: random.Random) -> int:
        return rng.randrange(10 ** (self.digits - 1) if self.digits > 1 else 0, 10 ** self.digits)

    def sample(self, rng: random.Random) -> Problem:
        a, b = self._number(rng), self._number(rng)
        return Problem(f"{a}+{b}=", str(a + b), f"{a + b}{STOP_TEXT}")


class Multiplication(Addition):
    def __init__(self, digits: int = 2) -> None:
        super().__init__(digits)
        self.name = f"mul{digits}"

    def sample(self, rng: random.Random) -> Problem:
        a, b = self._number(rng), rng.randrange(2, 10)
        return Problem(f"{a}*{b}=", str(a * b), f"{a * b}{STOP_TEXT}")


class WorkedAddition(Addition):
    """`add` with its work shown: the completion adds the columns from the right, each with
    the carry into it, then gives the sum after a last "=", so a completion is several times
    longer than the answer (30-41 tokens at 4 digits, against 5-6) and an error in any column
    carries into the answer. The reward checks the answer after the last "=" only, as GSM8K's
    checks its last number."""

    def __init__(self, digits: int = 2) -> None:
        super().__init__(digits)
        self.name = f"addw{digits}"

    def sample(self, rng: random.Random) -> Problem:
        a, b = self._number(rng), self._number(rng)
        width = max(len(str(a)), len(str(b)))
        xs, ys = str(a).zfill(width)[::-1], str(b).zfill(width)[::-1]
        steps, carry = [], 0
        for x, y in zip(xs, ys):
            total = int(x) + int(y) + carry
            steps.append(f"{x}+{y}{'+1' if carry else ''}={total}")
            carry = total // 10
        return Problem(f"{a}+{b}=", str(a + b), f"{' '.join(steps)} ={a + b}{STOP_TEXT}")

    def reward(self, problem: Problem, completion: str) -> float:
        text = completion.split(STOP_TEXT, 1)[0]
        return float("=" in text and text.rsplit("=", 1)[1].strip() == problem.answer)


class Countdown(Task):
    def __init__(self, numbers: int = 3, largest: int = 9) -> None:
        if not 2 <= numbers <= 5:
            raise ValueError(f"countdown takes 2..5 numbers (got {numbers})")
        self.count, self.largest, self.name = numbers, largest, f"countdown{numbers}"

    def sample(self, rng: random.Random) -> Problem:
        nums = [rng.randint(1, self.largest) for _ in range(self.count)]
        order = nums[:]
        rng.shuffle(order)
        ops = [rng.choice("+-*") for _ in range(self.count - 1)]
        expr = str(order[0]) + "".join(f"{op}{n}" for op, n in zip(ops, order[1:]))
        target = _evaluate(expr)
        prompt = f"countdown {' '.join(map(str, nums))} -> {target}:"
        return Problem(prompt, str(target), f"{expr}{STOP_TEXT}")

    def reward(self, problem: Problem, completion: str) -> float:
        expr = completion.split(STOP_TEXT, 1)[0].strip()
        if not re.fullmatch(r"[0-9+\-*]+", expr or "x"):
            return 0.0
        nums = problem.prompt.split(" -> ")[0].split()[1:]
        if sorted(re.findall(r"\d+", expr)) != sorted(nums):
            return 0.0
        value = _evaluate(expr)
        return float(value is not None and str(value) == problem.answer)


def _evaluate(expr: str) -> int | None:
    """Integer value of an expression of numbers and + - * (precedence as in Python); None if
    it does not parse."""
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError:
        return None

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
            a, b = ev(node.left), ev(node.right)
            if a is None or b is None:
                return None
            return a + b if isinstance(node.op, ast.Add) else a - b if isinstance(node.op, ast.Sub) else a * b
        return None

    return ev(tree)


class GSM8K(Task):
    name = "gsm8k"

    def __init__(self, data_dir: str | None = None) -> None:
        folder = data_root(data_dir) / "gsm8k"
        self.train = _read_gsm8k(folder / "train.jsonl")
        self.test = _read_gsm8k(folder / "test.jsonl")

    def sample(self, rng: random.Random) -> Problem:
        return rng.choice(self.train)

    def eval_problems(self, count: int) -> list[Problem]:
        return self.test[:count]

    def reward(self, problem: Problem, completion: str) -> float:
        numbers = re.findall(r"-?\d[\d,]*\.?\d*", completion.split("####")[-1])
        if not numbers:
            return 0.0
        return float(_number(numbers[-1]) == _number(problem.answer))


def _number(text: str) -> str:
    """A number's canonical text, so that 1,000 / 1000.00 / 1000. all read 1000."""
    text = text.replace(",", "").rstrip(".")
    try:
        value = decimal.Decimal(text)
    except decimal.InvalidOperation:
        return text
    return str(int(value)) if value == value.to_integral_value() else str(value.normalize())


def _read_gsm8k(path) -> list[Problem]:
    if not path.is_file():
        raise FileNotFoundError(f"no GSM8K file {path}; point --data-dir at the folder holding gsm8k/")
    out = []
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            answer = _number(row["answer"].split("####")[-1].strip())
            # one line, so the newline stop token ends it (the steps' own newlines become spaces)
            steps = " ".join(re.sub(r"<<[^>]*>>", "", row["answer"]).split())
            out.append(Problem(f"Question: {row['question']}\nAnswer:", answer,
                               f" {steps}{STOP_TEXT}"))
    return out


TASKS = {"add": Addition, "add-worked": WorkedAddition, "mul": Multiplication, "countdown": Countdown,
         "gsm8k": GSM8K}


def get_task(name: str, **options) -> Task:
    """A task by name ("add", "add-worked", "mul", "countdown", "gsm8k") with its options (digits=,
    numbers=, data_dir=)."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of {', '.join(TASKS)}")
    return TASKS[name](**options)

