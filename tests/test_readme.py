"""Every Python example in the README runs, and CI runs the README's test command."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_python_examples_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    assert blocks
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})


def test_ci_runs_the_readme_test_command():
    bash_blocks = re.findall(r"```bash\n(.*?)```", README, flags=re.S)
    test_command = next(b.strip() for b in bash_blocks if "pytest" in b)
    assert test_command in (ROOT / ".ci" / "run").read_text()
