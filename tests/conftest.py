"""Fixtures shared by the suite, and its rules for skipping: a skip says what is missing, and CI
cannot pass by skipping.

- GPU tests carry the `gpu` marker: `@pytest.mark.gpu` (one CUDA GPU) or
  `@pytest.mark.gpu(count=2)`, also as `pytest.param(..., marks=...)`. The marker is the skip:
  where there are fewer GPUs this file skips the test, "needs a CUDA GPU" / "needs two CUDA
  GPUs", so `pytest -m gpu` selects exactly the GPU tests. No test writes its own skipif on
  CUDA (tests/test_strict.py scans for one).
- An optional dependency: `pytest.importorskip("name")`, without `reason=` (the default reason
  names the module, which the strict switch reads). Never of lowbit itself: a lowbit module
  that does not import is a bug, so such a skip is always turned into a failure.
- ../shared/data: a test that reads it skips with the reason `missing_data(...)` (the
  `corpus_env` fixture does).
- LOWBIT_TEST_STRICT=1 (.ci/run sets it) turns two kinds of skips into failures that say what
  is missing: shared data missing, and a module of pyproject's [test] extra (TEST_EXTRA) that
  does not import. GPU skips and any other skip stay skips.
"""

import os
import re
import warnings

# Under pytest-xdist (pyproject's addopts: -n 2) each worker takes its share of the cores, it and
# the processes it launches (torchrun, `python -m lowbit`): two workers each running two
# intra-op threads on two cores ran no faster than one process. Set before torch is imported.
# A user's own OMP_NUM_THREADS is left as it is.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_THREADS = None
if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    # the cores this process may use (affinity, as a container sets it), else the machine's
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    _THREADS = max(1, cores // _WORKERS)
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)

import pytest  # noqa: E402
import torch  # noqa: E402

if _THREADS is not None:
    torch.set_num_threads(_THREADS)

pytest_plugins = ["pytester"]  # tests/test_strict.py runs tiny suites under this file

# Triton kernels run under its CPU interpreter where there is no GPU; the variable must be set
# before triton is first imported (torchao imports it too).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# torchao warns about its CUDA extensions on CPU-only machines; that is expected here.
warnings.filterwarnings("ignore", message=".*Failed to load.*")
os.environ.setdefault("MPLBACKEND", "Agg")
# Run folders draw no figure of their own here (matplotlib's 0.5-1 s a figure was half of the
# suite): the tests of those figures turn them on with the `figures` fixture, and explicit
# plots (`lowbit plot`, comparison summaries) are drawn either way. The variable is
# lowbit.train.run_dir.FIGURES_VARIABLE, spelled out: this file imports no lowbit module (one
# imported here made clean-clone runs fail in Triton's interpreter).
FIGURES_VARIABLE = "LOWBIT_FIGURES"
os.environ.setdefault(FIGURES_VARIABLE, "0")


@pytest.fixture
def figures(monkeypatch):
    """Run folders draw their figures (loss.png, rl.png, qat.png), as they do for users."""
    monkeypatch.setenv(FIGURES_VARIABLE, "1")


# --- skips that CI must not take ----------------------------------------------------------------

STRICT_VARIABLE = "LOWBIT_TEST_STRICT"
STRICT = os.environ.get(STRICT_VARIABLE, "") not in ("", "0")
# The importable names of what `pip install -e ".[test]"` adds to lowbit's own dependencies.
TEST_EXTRA = ("torchao", "triton", "transformers", "tensorboard", "ml_dtypes", "compressed_tensors",
              "trl", "datasets")
DATA_MISSING = "shared data missing: "
_IMPORT_SKIP = re.compile(r"could not import '([\w.]+)'")  # pytest.importorskip's default reason


def missing_data(detail: str) -> str:
    """The reason for skipping a test that needs ../shared/data; LOWBIT_TEST_STRICT=1 fails it."""
    return DATA_MISSING + detail


def skip_failure(reason: str, strict: bool = STRICT) -> str | None:
    """The failure message that a skip with this reason becomes, or None where it stays a skip."""
    match = _IMPORT_SKIP.match(reason)
    package = match.group(1).split(".")[0] if match else None
    if package == "lowbit":
        return f"{reason}: lowbit's own modules must import; a test never skips on them"
    if not strict:
        return None
    if reason.startswith(DATA_MISSING):
        return (f"{reason} ({STRICT_VARIABLE}=1: the tests that read ../shared/data must run; "
                f"put the corpora there or point LOWBIT_DATA at them)")
    if package in TEST_EXTRA:
        return (f"{reason} ({STRICT_VARIABLE}=1: {package} is a test dependency; "
                f"pip install -e \".[test]\" installs it)")
    return None


def _fail_instead(report, reason: str) -> None:
    failure = skip_failure(reason)
    if failure is not None:
        report.outcome = "failed"
        report.longrepr = failure


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A skip in setup (a skipif mark, a fixture) or in the test body."""
    report = (yield).get_result()
    if report.skipped and call.excinfo is not None and isinstance(call.excinfo.value, pytest.skip.Exception):
        _fail_instead(report, call.excinfo.value.msg)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A module-level skip: pytest keeps only (path, line, "Skipped: <reason>")."""
    report = (yield).get_result()
    if report.skipped and isinstance(report.longrepr, tuple):
        _fail_instead(report, report.longrepr[2].removeprefix("Skipped: "))


# --- the gpu marker -----------------------------------------------------------------------------

def needs_gpus_reason(count: int) -> str:
    return {1: "needs a CUDA GPU", 2: "needs two CUDA GPUs"}.get(count, f"needs {count} CUDA GPUs")


def pytest_collection_modifyitems(config, items):
    available = torch.cuda.device_count()
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is None:
            continue
        count = marker.kwargs.get("count", 1)
        if available < count:
            item.add_marker(pytest.mark.skip(reason=needs_gpus_reason(count)))


# --- fixtures -----------------------------------------------------------------------------------

@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def compiled_quant_linear():
    """lowbit.ops.quant_linear under torch.compile (AOTAutograd, eager kernels, no graph break
    allowed), with dynamo's caches reset: every test that compiles it adds entries for the one
    code object, and past 8 dynamo stops compiling it (fullgraph: an error)."""
    import torch._dynamo

    from lowbit.ops import quant_linear

    torch._dynamo.reset()
    yield torch.compile(quant_linear, backend="aot_eager", fullgraph=True)
    torch._dynamo.reset()


@pytest.fixture
def corpus_env(tmp_path, monkeypatch) -> dict:
    """For tests that read ../shared/data (or $LOWBIT_DATA): skipped where it is missing (a bare
    GPU box may not have it), failed there under LOWBIT_TEST_STRICT=1 (CI has it). Tokenizer
    caches go to a fresh folder (LOWBIT_CACHE, set here and in the returned environment for
    subprocesses)."""
    from lowbit.data import data_root

    try:
        data_root()
    except FileNotFoundError as e:
        pytest.skip(missing_data(str(e)))
    monkeypatch.setenv("LOWBIT_CACHE", str(tmp_path / "cache"))
    return dict(os.environ)
