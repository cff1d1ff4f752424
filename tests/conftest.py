import os
import warnings

import pytest
import torch

# Triton kernels run under its CPU interpreter where there is no GPU; the variable must be set
# before triton is first imported (torchao imports it too).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# torchao warns about its CUDA extensions on CPU-only machines; that is expected here.
warnings.filterwarnings("ignore", message=".*Failed to load.*")
os.environ.setdefault("MPLBACKEND", "Agg")


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
    """For tests that read ../shared/data: skipped where it is missing (CI has it; a bare GPU
    box may not). Tokenizer caches go to a fresh folder (LOWBIT_CACHE, set here and in the
    returned environment for subprocesses)."""
    from lowbit.data import data_root

    try:
        data_root()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    monkeypatch.setenv("LOWBIT_CACHE", str(tmp_path / "cache"))
    return dict(os.environ)
