"""Every Python example in the README and docs/python.md runs, CI runs the README's test
command, and every shell command of the README's ```bash blocks (and of docs/*.md's) names
flags that exist: `lowbit ...` commands parse with lowbit's own parser,
`python benchmarks/<script>.py ...` name a script that exists and, where it defines
`build_parser()`, parse with it. The shell commands are parsed only: nothing runs."""

import argparse
import ast
import contextlib
import importlib.util
import io
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
SHELL_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PYTHON_DOCS = [ROOT / "README.md", ROOT / "docs" / "python.md"]   # their examples run as written
_OPERATORS = {"&&", "||", ";", "|", "&"}
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
_LAUNCHER = re.compile(r"python[0-9.]*|torchrun")


def test_python_examples_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = [(doc.relative_to(ROOT), block) for doc in PYTHON_DOCS
              for block in re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.S)]
    assert blocks
    for doc, block in blocks:
        exec(compile(block, str(doc), "exec"), {})


def test_ci_runs_the_readme_test_command():
    bash_blocks = re.findall(r"```bash\n(.*?)```", README, flags=re.S)
    test_command = next(b.strip() for b in bash_blocks if "pytest" in b)
    assert test_command in (ROOT / ".ci" / "run").read_text()


# --- shell commands -----------------------------------------------------------------------------

def shell_commands(markdown: str) -> list[list[str]]:
    """The simple commands of the markdown's ```bash blocks, each as its argv: backslash
    continuations joined, comments dropped, split at && || ; | &, `NAME=value` prefixes and
    redirections removed."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", markdown, flags=re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"(?<!\S)\d*>&\d+(?!\S)", " ", line)     # 2>&1
            lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
            lexer.whitespace_split, lexer.commenters = True, ""
            argv, tokens = [], iter(lexer)
            for token in tokens:
                if token.startswith("#"):                          # a comment: the rest of the line
                    break
                if token in _OPERATORS:
                    commands.append(argv)
                    argv = []
                elif re.fullmatch(r"\d*(>>?|<)", token):           # > file
                    next(tokens, None)
                elif not re.match(r"\d*(>>?|<)", token):           # >file
                    argv.append(token)
            commands.append(argv)
    for argv in commands:
        while argv and (argv[0] == "env" or _ASSIGNMENT.match(argv[0])):
            argv.pop(0)
    return [argv for argv in commands if argv]


def lowbit_arguments(argv: list[str]) -> list[str] | None:
    """The arguments lowbit's parser gets from this command, or None for another command:
    `lowbit ...` (any path to it), `python -m lowbit.cli ...`, `torchrun ... -m lowbit.cli ...`."""
    if Path(argv[0]).name == "lowbit":
        return argv[1:]
    if _LAUNCHER.fullmatch(Path(argv[0]).name):
        for i, token in enumerate(argv[:-1]):
            if token == "-m" and argv[i + 1] in ("lowbit", "lowbit.cli"):
                return argv[i + 2:]
    return None


def script_arguments(argv: list[str]) -> tuple[str, list[str]] | None:
    """(script, its arguments) for `python <script>.py ...` or `torchrun ... <script>.py ...`."""
    if not _LAUNCHER.fullmatch(Path(argv[0]).name) or "-m" in argv or "-c" in argv:
        return None
    script = next((i for i, token in enumerate(argv) if token.endswith(".py")), None)
    return None if script is None else (argv[script], argv[script + 1:])


def parse_error(parser: argparse.ArgumentParser, arguments: list[str]) -> str | None:
    """What the parser says is wrong with the arguments (None: they parse). A literal `...`
    (for "more flags") is left out."""
    arguments = [a for a in arguments if a not in ("...", "…")]
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        try:
            parser.parse_args(arguments)
        except SystemExit as e:  # --help and --version exit 0
            if e.code not in (0, None):
                return stderr.getvalue().strip() or f"exit status {e.code}"
    return None


def script_parser(path: Path) -> argparse.ArgumentParser | None:
    """The script's `build_parser()`, where it defines one at the top level (then importing it
    runs nothing else, by the same convention as lowbit.cli)."""
    tree = ast.parse(path.read_text(), str(path))
    if not any(isinstance(n, ast.FunctionDef) and n.name == "build_parser" for n in tree.body):
        return None
    spec = importlib.util.spec_from_file_location(f"_readme_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_parser()


def _documented_commands():
    for doc in SHELL_DOCS:
        for argv in shell_commands(doc.read_text()):
            yield doc.relative_to(ROOT), argv


def test_shell_commands_are_found_as_a_shell_reads_them():
    markdown = "\n".join([
        "```bash",
        "python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/lowbit train",
        "lowbit train --steps 2   # a comment --no-such-flag",
        "# a whole-line comment",
        "LOWBIT_DATA=/data OMP_NUM_THREADS=1 lowbit train \\",
        "    --recipe nvfp4 --model 'a b'",
        "lowbit inspect --random 8x32 --json 2>&1 | head -3 > out.txt; echo done",
        "torchrun --nproc_per_node 2 -m lowbit.cli train --steps 2",
        "python benchmarks/tune.py search --budget 3",
        "```",
        "```",
        "lowbit not --in-a-bash-block",
        "```",
    ])
    commands = shell_commands(markdown)
    assert commands == [
        ["python3", "-m", "venv", ".venv"], [".venv/bin/pip", "install", "-e", "."],
        [".venv/bin/lowbit", "train"],
        ["lowbit", "train", "--steps", "2"],
        ["lowbit", "train", "--recipe", "nvfp4", "--model", "a b"],
        ["lowbit", "inspect", "--random", "8x32", "--json"], ["head", "-3"], ["echo", "done"],
        ["torchrun", "--nproc_per_node", "2", "-m", "lowbit.cli", "train", "--steps", "2"],
        ["python", "benchmarks/tune.py", "search", "--budget", "3"],
    ]
    assert [lowbit_arguments(c) for c in commands] == [
        None, None, ["train"], ["train", "--steps", "2"], ["train", "--recipe", "nvfp4", "--model", "a b"],
        ["inspect", "--random", "8x32", "--json"], None, None, ["train", "--steps", "2"], None]
    assert script_arguments(commands[-1]) == ("benchmarks/tune.py", ["search", "--budget", "3"])
    assert script_arguments(commands[0]) is None


def test_parse_error_tells_a_bad_flag_from_a_good_one():
    from lowbit.cli import build_parser

    assert parse_error(build_parser(), ["train", "--steps", "2", "..."]) is None
    assert parse_error(build_parser(), ["train", "--help"]) is None
    assert "--no-such-flag" in parse_error(build_parser(), ["train", "--no-such-flag"])
    assert parse_error(build_parser(), ["no-such-command"]) is not None


def test_readme_lowbit_commands_parse():
    from lowbit.cli import build_parser

    checked, wrong = 0, []
    for doc, argv in _documented_commands():
        arguments = lowbit_arguments(argv)
        if arguments is None:
            continue
        checked += 1
        error = parse_error(build_parser(), arguments)
        if error is not None:
            wrong.append(f"{doc}: {shlex.join(argv)}\n    {error}")
    assert checked, "README.md shows no `lowbit ...` command in its ```bash blocks"
    assert not wrong, "documented commands that lowbit's parser refuses:\n" + "\n".join(wrong)


def test_readme_script_commands_name_scripts_that_exist_and_flags_that_parse():
    wrong = []
    for doc, argv in _documented_commands():
        found = script_arguments(argv)
        if found is None:
            continue
        script, arguments = found
        path = ROOT / script
        if not path.is_file():
            wrong.append(f"{doc}: {shlex.join(argv)}\n    {script} does not exist")
            continue
        parser = script_parser(path)
        error = None if parser is None else parse_error(parser, arguments)
        if error is not None:
            wrong.append(f"{doc}: {shlex.join(argv)}\n    {error}")
    assert not wrong, "documented script commands that do not parse:\n" + "\n".join(wrong)
