import os
import warnings

import pytest
import torch

# torchao warns about its CUDA extensions on CPU-only machines; that is expected here.
warnings.filterwarnings("ignore", message=".*Failed to load.*")
os.environ.setdefault("MPLBACKEND", "Agg")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
