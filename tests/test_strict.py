"""The suite's rules for skipping (tests/conftest.py) hold, and its strict switch works.

- A scan of every test file: no importorskip of lowbit, no importorskip with a reason that hides
  the module's name, no skip inside an `except ImportError`, and no skip on a missing CUDA GPU
  other than the `gpu` marker's (so `pytest -m gpu` selects exactly the GPU tests).
- Tiny suites run under a copy of conftest.py, with and without LOWBIT_TEST_STRICT=1: what is a
  skip, what becomes a failure, and what the failure says.
"""

import ast
import re
from pathlib import Path

import pytest

from conftest import DATA_MISSING, STRICT_VARIABLE, TEST_EXTRA, skip_failure

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
TEST_FILES = sorted(TESTS.glob("*.py"))
_GPU_WORDS = re.compile(r"cuda|gpu|device_count", re.I)
_GPU_REASON = re.compile(r"\bneeds?\b.*\b(gpu|cuda)", re.I)


# --- the scan -----------------------------------------------------------------------------------

def _name(func: ast.expr) -> str:
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def _literal_text(node: ast.expr | None) -> str:
    """The constant parts of a string or f-string argument."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(_literal_text(v) for v in node.values)
    return ""


def _argument(call: ast.Call, position: int, keyword: str) -> ast.expr | None:
    if len(call.args) > position:
        return call.args[position]
    return next((k.value for k in call.keywords if k.arg == keyword), None)


def _means_no_gpu(test: ast.expr) -> bool:
    """A condition that holds where there is no (or not enough) CUDA GPU: `not <cuda...>`,
    `torch.cuda.device_count() < 2`, `DEVICE == "cpu"`, `DEVICE != "cuda"`."""
    if isinstance(test, ast.BoolOp):
        return any(_means_no_gpu(v) for v in test.values)
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return bool(_GPU_WORDS.search(ast.unparse(test.operand)))
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        op, right, left = test.ops[0], test.comparators[0], ast.unparse(test.left)
        if "device_count" in left:
            return isinstance(op, (ast.Lt, ast.LtE, ast.Eq))
        if isinstance(right, ast.Constant) and re.search(r"device", left, re.I):
            return ((isinstance(op, ast.Eq) and right.value == "cpu")
                    or (isinstance(op, ast.NotEq) and str(right.value).startswith("cuda")))
    return False


def _is_skip(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and _name(node.func) == "skip"


def skip_rule_violations(source: str, filename: str = "<test>") -> list[str]:
    """Where a test file breaks the rules of tests/conftest.py's docstring, one line each."""
    tree = ast.parse(source, filename)
    found = []

    def say(node, what):
        found.append(f"{filename}:{node.lineno}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _name(node.func) == "importorskip":
            module = _literal_text(_argument(node, 0, "modname"))
            if module.split(".")[0] == "lowbit":
                say(node, f"importorskip({module!r}): lowbit's own modules must import, not skip")
            if _argument(node, 2, "reason") is not None:
                say(node, "importorskip(..., reason=...): the default reason names the module, "
                          "which LOWBIT_TEST_STRICT reads")
        if isinstance(node, ast.Call) and _name(node.func) == "skipif":
            condition = _argument(node, 0, "condition")
            if condition is not None and _means_no_gpu(condition):
                say(node, "a skipif on CUDA: mark the test @pytest.mark.gpu (or gpu(count=2)) instead")
        if _is_skip(node) and _GPU_REASON.search(_literal_text(_argument(node, 0, "reason"))):
            say(node, "a skip that says it needs a GPU: mark the test @pytest.mark.gpu instead")
        if isinstance(node, ast.If) and _means_no_gpu(node.test):
            for statement in node.body:
                if isinstance(statement, ast.Expr) and _is_skip(statement.value):
                    say(statement, "a skip where there is no GPU: mark the test @pytest.mark.gpu instead")
        if isinstance(node, ast.ExceptHandler) and node.type is not None:
            caught = ast.unparse(node.type)
            if "ImportError" in caught or "ModuleNotFoundError" in caught:
                if any(_is_skip(n) for n in ast.walk(node)):
                    say(node, f"a skip on {caught}: use pytest.importorskip, which the strict "
                              f"switch reads (and which fails for lowbit's own modules)")
    return found


@pytest.mark.parametrize("path", TEST_FILES, ids=lambda p: p.name)
def test_test_file_skips_by_the_rules(path):
    assert skip_rule_violations(path.read_text(), path.name) == []


@pytest.mark.parametrize("source", [
    'pytest.importorskip("lowbit.kernels")',
    'pytest.importorskip("triton", reason="no triton")',
    'mark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")',
    'mark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two")',
    'mark = pytest.mark.skipif(not ON_GPU, reason="x")',
    'def test():\n    if DEVICE == "cpu":\n        pytest.skip("x")',
    'def test():\n    if not torch.cuda.is_available():\n        pytest.skip("x")',
    'def test():\n    pytest.skip("needs a CUDA GPU")',
    'try:\n    import lowbit.rl\nexcept ImportError:\n    pytest.skip("no rl", allow_module_level=True)',
])
def test_the_scan_finds_each_broken_rule(source):
    assert len(skip_rule_violations(source)) == 1


def test_the_scan_allows_what_the_rules_allow():
    source = '\n'.join([
        'triton = pytest.importorskip("triton")',
        'pytestmark = pytest.mark.skipif(not DATA.is_dir(), reason=missing_data("x"))',
        '@pytest.mark.gpu',
        'def test_a():',
        '    if DEVICE != "cpu":',
        '        pytest.skip("the view needs an 11 GB allocation; the CPU\'s is virtual")',
        '    if torch.cuda.is_available():',
        '        pytest.skip("on a GPU this would time the real shapes")',
    ])
    assert skip_rule_violations(source) == []


# --- skip_failure -------------------------------------------------------------------------------

def test_what_the_strict_switch_fails():
    for package in TEST_EXTRA:
        reason = f"could not import '{package}.sub': No module named '{package}'"
        assert skip_failure(reason, strict=False) is None
        assert f"{package} is a test dependency" in skip_failure(reason, strict=True)
    data = DATA_MISSING + "no data directory found"
    assert skip_failure(data, strict=False) is None
    assert skip_failure(data, strict=True).startswith(data)
    for allowed in ["needs a CUDA GPU", "needs two CUDA GPUs", "this triton build has no ptxas",
                    "could not import 'vllm': No module named 'vllm'"]:
        assert skip_failure(allowed, strict=True) is None
    lowbit = "could not import 'lowbit.rl': No module named 'lowbit.rl'"
    assert "must import" in skip_failure(lowbit, strict=False)
    assert "must import" in skip_failure(lowbit, strict=True)


def test_ci_sets_the_switch_before_it_runs_the_tests():
    ci = (ROOT / ".ci" / "run").read_text()
    switch = re.search(rf"^export {STRICT_VARIABLE}=1$", ci, flags=re.M)
    assert switch, f".ci/run must `export {STRICT_VARIABLE}=1`"
    assert switch.start() < ci.index("pytest")


# --- the mechanism, end to end ------------------------------------------------------------------

TINY_TESTS = '''
import pytest
from conftest import missing_data


def test_reads_the_data(corpus_env):
    pass


@pytest.mark.skipif(True, reason=missing_data("needs the corpora in /nowhere"))
def test_marked_for_the_data():
    pass


def test_needs_a_test_extra():
    pytest.importorskip("ml_dtypes.no_such_module")


def test_needs_another_package():
    pytest.importorskip("no_such_package_anywhere")


def test_imports_lowbit_or_skips():
    pytest.importorskip("lowbit.no_such_module")


@pytest.mark.gpu
def test_one_gpu():
    import torch
    assert torch.cuda.device_count() >= 1


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:1", marks=pytest.mark.gpu(count=2))])
def test_two_gpus(device):
    import torch
    assert device == "cpu" or torch.cuda.device_count() >= 2
'''

TINY_MODULE_SKIP = '''
import pytest

pytest.importorskip("transformers.no_such_module")


def test_never_collected():
    pass
'''


@pytest.fixture
def tiny_suite(pytester, monkeypatch):
    """Runs the tiny suites under a copy of tests/conftest.py, where the data cannot be found."""
    import torch

    pytester.makeconftest((TESTS / "conftest.py").read_text())
    pytester.makeini("[pytest]\nmarkers =\n    gpu(count=1): needs count CUDA GPUs\n")
    pytester.makepyfile(test_tiny=TINY_TESTS, test_tiny_module=TINY_MODULE_SKIP)
    monkeypatch.setenv("LOWBIT_DATA", str(pytester.path / "nonexistent"))
    monkeypatch.setenv("COLUMNS", "400")  # the summary lines whole
    gpus = torch.cuda.device_count()

    def run(strict: bool):
        monkeypatch.setenv(STRICT_VARIABLE, "1" if strict else "0")
        return pytester.runpytest_subprocess("-rA", "-p", "no:cacheprovider",
                                             "--continue-on-collection-errors")
    return run, gpus


def _gpu_outcomes(gpus: int) -> tuple[int, int]:
    """(passed, skipped) among test_one_gpu and test_two_gpus[cuda:1] on this machine."""
    passed = (gpus >= 1) + (gpus >= 2)
    return passed, 2 - passed


@pytest.mark.slow
def test_without_the_switch_missing_things_skip(tiny_suite):
    run, gpus = tiny_suite
    result = run(strict=False)
    gpu_passed, gpu_skipped = _gpu_outcomes(gpus)
    # skipped: the two data tests, the test extra, the other package, the module; failed: lowbit
    result.assert_outcomes(passed=1 + gpu_passed, skipped=5 + gpu_skipped, failed=1)
    result.stdout.fnmatch_lines_random([
        "*test_tiny.py*shared data missing: *LOWBIT_DATA*nonexistent*",
        "*shared data missing: needs the corpora in /nowhere*",
        "*could not import 'ml_dtypes.no_such_module'*",
        "*could not import 'transformers.no_such_module'*",
        "FAILED *test_imports_lowbit_or_skips*lowbit's own modules must import*",
    ])
    if gpus < 2:
        result.stdout.fnmatch_lines(["*needs two CUDA GPUs*"])
    if gpus < 1:
        result.stdout.fnmatch_lines(["*needs a CUDA GPU*"])


@pytest.mark.slow
def test_with_the_switch_missing_data_and_test_extras_fail(tiny_suite):
    run, gpus = tiny_suite
    result = run(strict=True)
    gpu_passed, gpu_skipped = _gpu_outcomes(gpus)
    # still skipped: the package outside the [test] extra, and the GPU tests without GPUs
    result.assert_outcomes(passed=1 + gpu_passed, skipped=1 + gpu_skipped, failed=2, errors=3)
    assert result.ret != 0
    result.stdout.fnmatch_lines_random([
        "ERROR *test_reads_the_data*shared data missing:*LOWBIT_TEST_STRICT=1: the tests that read*",
        "ERROR *test_marked_for_the_data*shared data missing: needs the corpora in /nowhere*",
        "FAILED *test_needs_a_test_extra*LOWBIT_TEST_STRICT=1: ml_dtypes is a test dependency*",
        "ERROR *test_tiny_module.py*LOWBIT_TEST_STRICT=1: transformers is a test dependency*",
        "FAILED *test_imports_lowbit_or_skips*lowbit's own modules must import*",
        "SKIPPED *could not import 'no_such_package_anywhere'*",
    ])
    if gpus < 1:
        result.stdout.fnmatch_lines(["SKIPPED *needs a CUDA GPU*"])
