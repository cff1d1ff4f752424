"""`ExportConfig`: what one `lowbit export` writes, each field declaring its flag
(lowbit.config.flag), checked where it is built so that a bad value is refused before a model
loads. Whether the folders are usable (--out a folder, empty or --overwrite, apart from the
source) is the state of the disk, checked by lowbit.export.cli_args.run_export when it runs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from lowbit.config import flag, require
from lowbit.export.layouts import parse_export_format
from lowbit.formats.weight_format import WeightFormat

__all__ = ["ExportConfig"]


@dataclass(kw_only=True)   # keyword-only: source and out, which have no default, come first
class ExportConfig:
    source: str
    """A Hugging Face model folder, or a `lowbit train` / `lowbit qat` run folder (its last
    checkpoint). The command's positional RUN_OR_MODEL, so not declared as a flag here."""
    format: str | None = field(default=None, metadata=flag(
        "--format", "weight format: nvfp4, mxfp4, int4 or int8 (with :gG or :row, and :asym; "
        "int4's default g128, int8's row), or bf16: a plain Hugging Face folder, unquantized "
        "(default: a QAT run's own format, else nvfp4)"))
    """The weight format (lowbit.export.layouts.parse_export_format), or "bf16": a plain Hugging
    Face folder; None: a QAT run's own format, else nvfp4 (lowbit.export.source.export_format)."""
    layout: str | None = field(default=None, metadata=flag(
        "--layout", "checkpoint layout (default: modelopt for nvfp4, compressed-tensors for mxfp4, "
        "which ModelOpt has no layout for)", choices=("modelopt", "compressed-tensors")))
    """The checkpoint layout; None: the format's first in lowbit.export.FORMAT_LAYOUTS."""
    out: str = field(metadata=flag("--out", "folder to write", metavar="DIR", required=True))
    """The folder to write."""
    scale_rule: str = field(default="floor", metadata=flag(
        "--scale-rule", "mxfp4 block scales for weights lowbit quantizes (default: %(default)s)",
        choices=("floor", "rceil")))
    """How mxfp4 block scales round, for the weights lowbit quantizes (not a QAT run's packed
    ones)."""
    activations: str = field(default="bf16", metadata=flag(
        "--activations", "bf16: weight-only (W4A16); nvfp4: W4A4 with static activation scales "
        "calibrated on --calib-corpus (default: %(default)s)", choices=("bf16", "nvfp4")))
    """"bf16": weight-only; "nvfp4": W4A4, with static input scales calibrated on calib_corpus."""
    calib_corpus: str = field(default="tinyshakespeare", metadata=flag(
        "--calib-corpus", "corpus for --activations nvfp4 (default: %(default)s)", metavar="NAME"))
    """The corpus (lowbit.data.CORPORA) whose batches calibrate the activation scales."""
    calib_batches: int = field(default=8, metadata=flag(
        "--calib-batches", "calibration batches of 4 x 256 tokens (default: %(default)s)",
        metavar="N"))
    """Calibration batches of 4 x 256 tokens (lowbit.export.source.corpus_calibration_batches)."""
    allow_unshared_scales: bool = field(default=False, metadata=flag(
        "--allow-unshared-scales", "write given QTensors of a fused group (q/k/v, gate/up) that "
        "carry different tensor scales as they are (vLLM takes their max)", action="store_true"))
    """Write a fused group's given QTensors whose tensor scales differ as they are, instead of
    refusing them (vLLM serves them with the group's largest scale)."""
    overwrite: bool = field(default=False, metadata=flag(
        "--overwrite", "write into a folder that has files", action="store_true"))
    """Write into an out folder that already has files."""
    allow_unfinished: bool = field(default=False, metadata=flag(
        "--allow-unfinished", "export a run folder that has no final.json (it stopped before its "
        "last step) from its last checkpoint", action="store_true"))
    """Export a run folder without final.json (a stopped run) from its last checkpoint."""
    progress: bool = field(default=True, metadata=flag(
        "--no-progress", "no progress bar", action="store_false"))
    """Show a progress bar while the weights are written."""

    def __post_init__(self) -> None:
        require(self.calib_batches >= 1, "--calib-batches must be >= 1")
        require(not self.plain_bf16 or (self.layout is None and self.activations == "bf16"),
                "--format bf16 writes a plain Hugging Face folder: it takes no --layout "
                "and no --activations nvfp4")
        self.weight_format   # a bad format: refused before anything loads

    @property
    def plain_bf16(self) -> bool:
        """--format bf16: a plain Hugging Face folder, nothing quantized."""
        return self.format is not None and self.format.strip().lower() == "bf16"

    @functools.cached_property
    def weight_format(self) -> WeightFormat | None:
        """--format parsed once (parse_export_format); None when left out or bf16."""
        return None if self.format is None or self.plain_bf16 else parse_export_format(self.format)
