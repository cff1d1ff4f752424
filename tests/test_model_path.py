"""--model PATH: lowbit train, bench train and inspect on a tiny Hugging Face folder, and the
run's export; a bad folder is one line and exit 2."""

import json

import pytest
import torch

from hf_models import compressed_tensors_weights, save_hf_model
from lowbit.cli import main


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    return save_hf_model("qwen3-moe", tmp_path_factory.mktemp("qwen3moe"), dtype=torch.bfloat16)


def test_train_from_a_hugging_face_folder_then_export_the_run(moe_folder, tmp_path, corpus_env, capsys):
    from lowbit.data import BPETokenizer, load_dataset
    from lowbit.models import load_model

    runs = tmp_path / "runs"
    code = main(["train", "--model", str(moe_folder), "--recipe", "stable-fp4", "--steps", "2",
                 "--seq-len", "32", "--batch-size", "2", "--corpus-max-bytes", "20000",
                 "--eval-batches", "1", "--no-diagnostics", "--no-progress", "--out-dir", str(runs)])
    assert code == 0, capsys.readouterr().err
    run = runs / f"{moe_folder.name}-tinyshakespeare-stable-fp4"
    config = json.loads((run / "config.json").read_text())
    assert config["tokenizer"] == "model" and config["model"] == str(moe_folder)
    assert config["lr"] == 2e-5                 # a trained model fine-tunes at fine-tuning's rate
    # the run started from the folder's weights: its first evaluation is the loaded model's loss
    # on the model's own tokens (bf16 weights as float32; fp32 compute on the CPU)
    model, tok, _ = load_model(moe_folder, dtype=torch.float32)
    data = load_dataset("tinyshakespeare", tokenizer=BPETokenizer(tok), max_bytes=20000)
    x, y = next(iter(data.eval_batches("val", 2, 32, max_batches=1)))
    import lowbit
    lowbit.quantize_(model, "stable-fp4")
    with torch.no_grad():
        loss = torch.nn.functional.cross_entropy(model(x).logits.flatten(0, 1), y.flatten()).item()
    first = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][0]
    assert first["event"] == "eval" and first["val_loss"] == pytest.approx(loss, rel=1e-5)

    out = tmp_path / "export"
    assert main(["export", str(run), "--layout", "compressed-tensors", "--out", str(out),
                 "--no-progress"]) == 0
    assert (out / "tokenizer.json").read_bytes() == (moe_folder / "tokenizer.json").read_bytes()
    from lowbit.export import load_exported
    assert len(load_exported(out).weights) == 2 * (4 + 4 * 3)


def test_bench_and_inspect_take_a_model_folder(moe_folder, capsys):
    assert main(["bench", "train", "--model", str(moe_folder), "--recipes", "bf16,nvfp4",
                 "--steps", "1", "--warmup", "0", "--seq-len", "16", "--batch-size", "2",
                 "--device", "cpu"]) == 0
    assert "nvfp4" in capsys.readouterr().out
    assert main(["inspect", "--model", str(moe_folder), "--formats", "nvfp4", "--json",
                 "--no-progress"]) == 0
    rows = json.loads(capsys.readouterr().out)
    names = {r["tensor"] if "tensor" in r else r["name"] for r in rows}
    assert any("q_proj" in n for n in names) and any("experts" in n for n in names)
    assert not any("embed" in n or "norm" in n for n in names)


def test_bad_model_folders_are_one_line_errors(moe_folder, tmp_path, capsys):
    assert main(["train", "--model", str(moe_folder), "--tokenizer", "bytes", "--steps", "1"]) == 2
    assert "trains with its own tokenizer" in capsys.readouterr().err
    assert main(["train", "--model", str(tmp_path / "none"), "--steps", "1"]) == 2
    assert "no such model folder" in capsys.readouterr().err
    cfg = json.loads((moe_folder / "config.json").read_text())
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**cfg, "architectures": ["MixtralForCausalLM"]}))
    assert main(["inspect", "--model", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "MixtralForCausalLM is not supported" in err and err.count("\n") == 1


# --- lowbit qat / lowbit rl --model PATH, and the QAT run's export ------------------------------

QAT_FLAGS = ["--estimator", "ste", "--steps", "2", "--batch-size", "2", "--seq-len", "32",
             "--corpus-max-bytes", "20000", "--eval-every", "2", "--no-baselines",
             "--no-progress", "--device", "cpu"]


def _qat_model(run):
    """The QAT run's model as it trained (fake-quantized), rebuilt from its checkpoint."""
    from lowbit.qat import QATConfig, prepare
    from lowbit.train.build import build_model
    from lowbit.train.checkpoint import load_checkpoint
    from lowbit.train.config import TrainConfig
    from lowbit.train.job_record import JobRecord

    checkpoint = load_checkpoint(run / "checkpoints" / "latest.pt")
    config = TrainConfig.from_dict(checkpoint["config"])
    model = build_model(config)
    prepare(model, QATConfig.from_dict(JobRecord.of_checkpoint(checkpoint).qat))
    model.load_state_dict(checkpoint["model"])
    with torch.no_grad():   # the export stores everything but the packed weights in BF16
        for name, p in model.named_parameters():
            if "parametrizations" not in name:
                p.copy_(p.bfloat16().float())
    return model.eval()


def _perplexity(model, ids):
    with torch.no_grad():
        logits = model(ids[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).exp().item()


def _ids():
    from hf_models import TEXT, tokenizer
    ids = torch.tensor(tokenizer().encode(TEXT[:2000]).ids)
    return ids[: (len(ids) // 64) * 64].view(-1, 64)[:4]


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    return save_hf_model("llama", tmp_path_factory.mktemp("llama"), dtype=torch.bfloat16)


def test_qat_from_a_folder_exports_its_nvfp4_weights_bit_for_bit(llama_folder, tmp_path, corpus_env, capsys):
    from lowbit.export import load_exported
    from lowbit.qat import convert, packed_weights

    runs = tmp_path / "runs"
    assert main(["qat", "--model", str(llama_folder), "--weights", "nvfp4", *QAT_FLAGS,
                 "--out-dir", str(runs)]) == 0, capsys.readouterr().err
    run = runs / f"qat-{llama_folder.name}-nvfp4-ste"
    config = json.loads((run / "config.json").read_text())
    assert json.loads((run / "job.json").read_text())["init_from"] == str(llama_folder)
    assert config["tokenizer"] == "model"
    assert config["lr"] == 2e-5   # a trained Hugging Face model: fine-tuning's rate, no --lr given
    out = tmp_path / "export"
    assert main(["export", str(run), "--out", str(out), "--no-progress"]) == 0   # nvfp4, modelopt
    exported = load_exported(out)
    assert exported.format == "nvfp4"
    qat = _qat_model(run)
    ids = _ids()
    fake_quantized = _perplexity(qat, ids)
    convert(qat)
    own = packed_weights(qat)
    assert len(own) == len(exported.weights) == 2 * 7
    for name, q in own.items():
        got = exported.weights[name]
        assert torch.equal(got.codes, q.codes), name
        assert torch.equal(got.scales.view(torch.uint8), q.scales.view(torch.uint8)), name
        assert torch.equal(got.tensor_scale, q.tensor_scale), name
    # q/k/v and gate/up trained under one tensor scale each (what lets the export write them)
    attn = "model.layers.1.self_attn"
    assert len({float(own[f"{attn}.{n}.weight"].tensor_scale) for n in ("q_proj", "k_proj", "v_proj")}) == 1
    assert _perplexity(exported.model, ids) == fake_quantized
    # another format would quantize the trained weights again: refused
    assert main(["export", str(run), "--format", "mxfp4", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "trained nvfp4 weights (QAT)" in err and "--format nvfp4" in err and err.count("\n") == 1


def test_qat_int4_asym_moe_exports_pack_quantized_that_compressed_tensors_decompresses(
        moe_folder, tmp_path, corpus_env, capsys):
    from compressed_tensors.quantization import QuantizationConfig

    from lowbit.export import load_exported
    from lowbit.formats import load_qtensors

    runs = tmp_path / "runs"
    assert main(["qat", "--model", str(moe_folder), "--weights", "int4:g16:asym", *QAT_FLAGS,
                 "--out-dir", str(runs)]) == 0, capsys.readouterr().err
    run = runs / f"qat-{moe_folder.name}-int4-g16-asym-ste"
    out = tmp_path / "export"
    assert main(["export", str(run), "--format", "int4", "--out", str(out), "--no-progress"]) == 0
    quant = json.loads((out / "config.json").read_text())["quantization_config"]
    assert quant["format"] == "pack-quantized"
    config = QuantizationConfig.model_validate(quant)
    scheme = config.config_groups["group_0"]
    assert (scheme.weights.num_bits, scheme.weights.symmetric, scheme.weights.group_size) == (4, False, 16)
    dense = compressed_tensors_weights(out)   # compressed-tensors' own decompression
    exported = load_exported(out)
    assert dense.keys() == exported.weights.keys()
    packed = load_qtensors(run / "quantized.safetensors")   # the QAT model's packed_weights
    assert len(exported.weights) == 2 * (4 + 4 * 3)
    F_ = exported.model.config.moe_ffn_dim
    for name, q in exported.weights.items():
        assert torch.equal(dense[name], q.dequantize(torch.float32)), name
        parts = name.removesuffix(".weight").split(".")
        if "experts" in parts:   # the QAT run's fused 3D stacks, expert by expert
            e, proj = int(parts[-2]), parts[-1]
            stack = packed[".".join(parts[:-2]) + (".down_proj" if proj == "down_proj" else ".gate_up_proj")]
            rows = {"gate_proj": slice(0, F_), "up_proj": slice(F_, 2 * F_)}.get(proj, slice(None))
            expected = stack.dequantize(torch.float32)[e, rows]
        else:
            own = packed[name]
            assert torch.equal(q.codes, own.codes) and torch.equal(q.zeros, own.zeros)
            assert torch.equal(q.scales, own.scales)
            expected = own.dequantize(torch.float32)
        assert torch.equal(q.dequantize(torch.float32), expected), name
    ids = _ids()
    assert _perplexity(exported.model, ids) == _perplexity(_qat_model(run), ids)


def test_rl_takes_a_model_folder_and_bad_folders_are_one_line_errors(llama_folder, tmp_path, capsys):
    from lowbit.export.source import export_format

    runs = tmp_path / "runs"
    assert main(["rl", "--model", str(llama_folder), "--device", "cpu", "--out-dir", str(runs),
                 "--no-progress", "--steps", "1", "--eval-every", "0", "--eval-problems", "2",
                 "--prompts-per-step", "1", "--num-generations", "2",
                 "--max-completion-length", "3", "--checkpoint-every", "0"]) == 0, capsys.readouterr().err
    run = runs / f"rl-{llama_folder.name}-add-nvfp4+quads"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("event") == "train" or "loss" in r for r in records)
    saved = json.loads((run / "config.json").read_text())
    assert saved["warmstart_steps"] == 0 and saved["lr"] == 1e-6   # a trained model: TRL's rate
    capsys.readouterr()
    for argv, words in [
            (["rl", "--model", str(tmp_path / "none")], "no such model folder"),
            (["rl", "--model", str(llama_folder), "--warmstart-steps", "5"], "starts RL from its own weights"),
            (["qat", "--model", str(tmp_path / "none")], "no such model folder"),
            (["qat", "--model", str(llama_folder), "--from", str(tmp_path)], "give one"),
            (["export", str(llama_folder), "--format", "ternary", "--out", str(tmp_path / "t")],
             "no serving layout")]:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1, (argv, err)
    with pytest.raises(ValueError, match="int2 weights have no serving layout"):
        export_format(None, "int2:g32", "runs/x")


def test_a_qat_runs_export_takes_its_own_format_and_refuses_another_in_the_users_words():
    """A QAT run exports its trained weights as they are: `--format int4` (options left out) is
    the run's int4:g16, the run's own text is accepted, and a block or `asym` the run did not
    train is refused, the message quoting the --format as typed."""
    from lowbit.export.layouts import parse_export_format
    from lowbit.export.source import export_format

    def asked(text):
        return export_format(parse_export_format(text), "int4:g16", "runs/q", text=text)

    assert str(export_format(None, "int4:g16", "runs/q")) == "int4:g16"
    assert str(asked("int4")) == "int4:g16" and str(asked("int4:g16")) == "int4:g16"
    assert str(export_format(parse_export_format("int4"), "int4:g16:asym", "runs/q", text="int4")) == "int4:g16:asym"
    for text in ("int4:g32", "int4:asym", "int4:row", "int8", "nvfp4"):
        with pytest.raises(ValueError, match=f"--format {text} would quantize them again: use "
                                             f"--format int4:g16"):
            asked(text)
