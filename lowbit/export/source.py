"""What `lowbit export` reads: a Hugging Face model folder or a lowbit run folder
(`load_source`), the weight format to write for it (`export_format`), and its calibration
text for `--activations nvfp4` (`corpus_calibration_batches`). lowbit.export.cli_args has the
rules.
"""

from __future__ import annotations

from pathlib import Path

import torch

from lowbit.export.layouts import parse_export_format
from lowbit.formats.weight_format import WeightFormat, names_block

__all__ = ["load_source", "master_weights", "export_format", "corpus_calibration_batches",
           "check_apart"]


def load_source(source: str | Path, allow_unfinished: bool = False):
    """(model in float32, weights mapping or None, tokenizer or None, tokenizer folder or None,
    the QAT run's weight format or None) of a Hugging Face folder or a run folder; a run folder
    another process holds, or without final.json (unless allow_unfinished), is refused."""
    from lowbit.models import load_model
    from lowbit.train.run_dir import RunDir

    path = Path(source)
    if not path.exists():
        raise ValueError(f"no such run or model folder: {path}")
    run = RunDir(path)
    if run.checkpoint.is_file():
        return _load_run(run.open(allow_unfinished, use="export"))
    model, tokenizer, _ = load_model(path, dtype=torch.float32)
    return model, None, tokenizer, path, None


def _load_run(saved):
    from lowbit.formats import load_qtensors
    from lowbit.models import ModelConfig, build_model, is_model_folder
    from lowbit.train.build import model_config

    path, config, state = saved.path, saved.config, saved.state["model"]
    if config is None:   # a lowbit rl run: its policy, in high precision (the trainer's weights)
        model = build_model(ModelConfig(**saved.state["model_config"]))
        model.load_state_dict(master_weights(state))
        tokenizer_dir = saved.state["tokenizer_dir"]
        return model.eval(), None, None, None if tokenizer_dir is None else Path(tokenizer_dir), None
    vocab = state["model.embed_tokens.weight"].shape[0]
    model = build_model(model_config(config, vocab))
    model.load_state_dict(master_weights(state))
    weights = None
    if (path / "quantized.safetensors").is_file():
        weights = load_qtensors(path / "quantized.safetensors")
    trained = None
    if saved.job.qat is not None:
        trained = saved.job.qat["weights"]
        if weights is None:
            raise ValueError(f"{path} is a QAT run without quantized.safetensors (its packed "
                             f"weights, written when the run finishes); finish it with "
                             f"`lowbit qat ... --resume`")
    tokenizer, tokenizer_dir = None, None
    if is_model_folder(config.model):
        tokenizer_dir = Path(config.model)
    elif config.tokenizer == "bpe":
        tokenizer = _run_tokenizer(path, config, saved.state.get("data_fingerprint"))
    return model.eval(), weights, tokenizer, tokenizer_dir, trained


def _run_tokenizer(path: Path, config, fingerprint: str | None):
    """A BPE run's tokenizer, trained again from its corpus as the run built it
    (lowbit.train.build.build_data). Its ids are the model's only on the corpus the run read:
    the tokens' fingerprint must be the checkpoint's (checkpoints without one are taken as they
    are)."""
    from lowbit.data import data_root
    from lowbit.train.build import build_data

    data = build_data(config)
    if fingerprint is not None and data.fingerprint != fingerprint:
        where = "" if config.corpus == "pycode" else f" in {data_root(config.data_dir)}"
        raise ValueError(f"cannot export {path}: its BPE tokenizer is trained again from corpus "
                         f"{config.corpus}{where}, which is not the text the run trained on "
                         f"(tokens' fingerprint {data.fingerprint[:12]}, the checkpoint's "
                         f"{fingerprint[:12]}), so its ids would not be the model's; restore that "
                         f"corpus there")
    return data.dataset.tokenizer


def master_weights(state: dict) -> dict:
    """A model state dict with parametrized weights (a QAT checkpoint's
    `m.parametrizations.weight.original` and its quantizer's state) as plain `m.weight`."""
    out = {}
    for name, tensor in state.items():
        if ".parametrizations." not in name:
            out[name] = tensor
        elif name.endswith(".original"):
            module, _, rest = name.partition(".parametrizations.")
            out[f"{module}.{rest.removesuffix('.original')}"] = tensor
    return out


def export_format(requested: WeightFormat | None, trained: str | None, source, *,
                  text: str | None = None) -> WeightFormat:
    """The format to write: the requested one (ExportConfig.weight_format, parsed from `text`,
    the --format the user wrote), or a QAT run's own; a QAT run asked for another format (which
    would quantize its trained weights again) is refused. For a QAT run, `int4` names its int4
    weights whatever their groups; `int4:g64` (a block the text gives) or `int4:asym` must be
    theirs."""
    if trained is None:
        return requested or parse_export_format("nvfp4")
    try:
        own = parse_export_format(trained)
    except ValueError as e:
        raise ValueError(f"{source} trained {trained} weights (QAT): {e}") from None
    if requested is None:
        return own
    # options left out (int4 for an int4:g32:asym run) are the run's; options named must match
    block_given = text is not None and names_block(text)
    if (requested.name != own.name or (requested.asym and not own.asym)
            or (block_given and requested.group != own.group)):
        raise ValueError(f"{source} trained {trained} weights (QAT), which export as they are; "
                         f"--format {text or requested} would quantize them again: use --format "
                         f"{own} (or leave --format out)")
    return own


def corpus_calibration_batches(model, tokenizer, corpus: str, n: int):
    from lowbit.data import BPETokenizer, load_corpus

    if tokenizer is None:
        raise ValueError("--activations nvfp4 calibrates on text, which needs the model's "
                         "tokenizer (tokenizer.json); this source has none")
    tok = tokenizer if hasattr(tokenizer, "encode_array") else BPETokenizer(tokenizer)
    text = load_corpus(corpus).splits["train"][: 4 * 256 * n * 8]
    ids = torch.from_numpy(tok.encode_array(text).astype("int64"))
    seq = min(256, model.config.max_seq_len)
    usable = (len(ids) // seq) * seq
    if usable < seq:
        raise ValueError(f"corpus {corpus} is too short to calibrate")
    windows = ids[:usable].view(-1, seq)
    return [windows[i:i + 4] for i in range(0, min(len(windows), 4 * n), 4)]


def check_apart(source: Path, out: Path, what: str = "the source folder") -> None:
    """Refuse an --out that is `source`, holds it or lies inside it (symlinks resolved): the
    export would write over what it reads."""
    src, dst = source.resolve(), out.resolve()
    if dst == src:
        where = f"is {what}"
    elif dst.is_relative_to(src):
        where = f"lies inside {what} {source}"
    elif src.is_relative_to(dst):
        where = f"holds {what} {source}"
    else:
        return
    raise ValueError(f"--out {out} {where}, and the export would write over what it reads; "
                     f"choose an --out outside {source}")
