"""The tests' switch of lowbit.dispatch onto the Triton kernels for CPU tensors (the kernels then
run under Triton's interpreter, as tests/conftest.py sets TRITON_INTERPRET=1)."""

from lowbit.kernels import supports


def kernels_on_cpu(monkeypatch) -> None:
    """From here on in the test, lowbit.dispatch hands CPU tensors to the kernels too (every
    spec the kernels support: folds and fake quantization alike)."""
    monkeypatch.setattr("lowbit.dispatch._quantizers.use_kernels",
                        lambda x, spec, codes=True: supports(spec, codes))
