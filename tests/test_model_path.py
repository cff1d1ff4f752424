"""--model PATH: lowbit train, bench train and inspect on a tiny Hugging Face folder, and the
run's export; a bad folder is one line and exit 2."""

import json

import pytest
import torch

from hf_models import save_hf_model
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
    # the run started from the folder's weights: its first evaluation is the loaded model's loss
    # on the model's own tokens (bf16 weights as float32; fp32 compute on the CPU)
    model, tok, _ = load_model(moe_folder, dtype=torch.float32)
    data = load_dataset("tinyshakespeare", tokenizer=BPETokenizer(tok), max_bytes=20000)
    x, y = next(iter(data.eval_batches("val", 2, 32, max_batches=1)))
    import lowbit
    lowbit.convert(model, "stable-fp4")
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
