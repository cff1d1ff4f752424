"""The tests' switch of lowbit.dispatch onto the Triton kernels for CPU tensors (the kernels then
run under Triton's interpreter, as tests/conftest.py sets TRITON_INTERPRET=1)."""

import pytest

from lowbit.kernels import interpret_mode, supports


def interpreted_kernels() -> None:
    """Skips the test where Triton's interpreter is off (a GPU machine, where CPU tensors cannot
    take the kernels): it runs the kernels on CPU tensors."""
    if not interpret_mode():
        pytest.skip("hands CPU tensors to the Triton kernels, which take them under Triton's interpreter "
                    "only (TRITON_INTERPRET=1, which tests/conftest.py sets on a machine without a GPU)")


def kernels_on_cpu(monkeypatch) -> None:
    """From here on in the test, lowbit.dispatch hands CPU tensors to the kernels too (every
    spec the kernels support: folds and fake quantization alike). Skips the test where Triton's
    interpreter is off (interpreted_kernels)."""
    interpreted_kernels()
    monkeypatch.setattr("lowbit.dispatch._quantizers.use_kernels",
                        lambda x, spec, codes=True: supports(spec, codes))
