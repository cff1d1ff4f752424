"""A new user's whole path, through the `lowbit` command, as README's tour and docs/models.md
give it (issue 30): a Hugging Face folder -> `lowbit train --model` in FP4 -> `lowbit qat --from`
that run -> `lowbit export` of the QAT run, which transformers loads to lowbit's own logits ->
`lowbit export --format bf16`, a plain folder transformers loads -> `lowbit rl --model` on it.
Each stage reads the folder the stage before wrote; RL also starts from a QAT run's export, and
an RL run leaves as a plain folder."""

import json
import math

import pytest
import torch

from safetensors.torch import load_file

from hf_models import TEXT, compressed_tensors_weights, load_decompressed, save_hf_model, tokenizer
from run_helpers import cli

# What each stage runs on: a few steps of short sequences on a slice of Tiny Shakespeare.
DATA = ["--seq-len", "32", "--batch-size", "2", "--corpus-max-bytes", "20000"]
TRAIN = ["--steps", "2", "--log-every", "1", "--eval-batches", "1", "--no-diagnostics",
         "--no-progress", "--device", "cpu"]
QAT = ["--estimator", "ste", "--steps", "2", "--eval-every", "2", "--no-baselines",
       "--no-progress", "--device", "cpu"]
RL = ["--steps", "2", "--prompts-per-step", "1", "--num-generations", "2",
      "--max-completion-length", "3", "--eval-every", "0", "--eval-problems", "2",
      "--checkpoint-every", "0", "--no-progress", "--device", "cpu"]

# Per model: the QAT format, its compressed-tensors format, and the dtype in which transformers
# holds exactly the values lowbit reads. An MoE NVFP4 export loses its experts' tensor scales in
# transformers (docs/models.md, "MoE exports in transformers"); symmetric int4 needs none. FP4
# decompresses to BF16; int4 to float32 (its scales' dtype), and a BF16 load keeps the fused
# experts in float32, so only a float32 load is one dtype throughout.
KINDS = {"llama": ("nvfp4", "nvfp4-pack-quantized", torch.bfloat16),
         "qwen3-moe": ("int4:g16", "pack-quantized", torch.float32)}


def records(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def token_ids():
    ids = torch.tensor(tokenizer().encode(TEXT[:2000]).ids)
    return ids[: (len(ids) // 64) * 64].view(-1, 64)[:2]


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("kind", KINDS)
def test_hf_folder_to_fp4_training_to_qat_to_exports_to_rl(kind, tmp_path, corpus_env, capsys, recwarn):
    import transformers

    from lowbit.export import load_exported
    from lowbit.export.source import master_weights
    from lowbit.formats import load_qtensors
    from lowbit.models import load_model
    from lowbit.qat.run import source_fingerprint
    from lowbit.train.checkpoint import load_checkpoint

    weights, ct_format, dtype = KINDS[kind]
    folder = save_hf_model(kind, tmp_path / kind, dtype=torch.bfloat16)
    runs = tmp_path / "runs"

    # 1. FP4 training from the folder (stable-fp4: its 32x32 tiles quantize every projection of
    #    a 2-layer model, where nvfp4 keeps the first and last layers, all of them here, in BF16)
    code, err = cli(capsys, "train", "--model", folder, "--recipe", "stable-fp4", *DATA, *TRAIN,
                    "--out-dir", runs)
    assert code == 0, err
    assert not [w for w in recwarn if "quantized no module" in str(w.message)]
    train_run = runs / f"{kind}-tinyshakespeare-stable-fp4"
    config = json.loads((train_run / "config.json").read_text())
    assert (config["model"], config["tokenizer"], config["recipe"]) == (str(folder), "model", "stable-fp4")
    losses = [r["loss"] for r in records(train_run) if r["event"] == "train"]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert math.isfinite(json.loads((train_run / "final.json").read_text())["val_loss"])
    trained = master_weights(load_checkpoint(train_run / "checkpoints" / "latest.pt")["model"])
    start = load_model(folder, dtype=torch.float32)[0].state_dict()
    assert trained.keys() == start.keys()
    assert any(not torch.equal(trained[k], start[k]) for k in start)   # it trained

    # 2. QAT from that run: the run's checkpoint is the model it starts from
    code, err = cli(capsys, "qat", "--from", train_run, "--weights", weights, *QAT, "--out-dir", runs)
    assert code == 0, err
    qat_run = runs / f"qat-{train_run.name}-{weights.replace(':', '-')}-ste"
    config = json.loads((qat_run / "config.json").read_text())
    job = json.loads((qat_run / "job.json").read_text())
    assert job["init_from"] == str(train_run) and job["qat"]["weights"] == weights
    source = load_checkpoint(train_run / "checkpoints" / "latest.pt")["model"]
    assert job["init_fingerprint"] == source_fingerprint(train_run, source)
    assert config["lr"] == 2e-5   # a run trained from a Hugging Face folder: fine-tuning's rate
    qat_losses = [r["loss"] for r in records(qat_run) if r["event"] == "train"]
    assert qat_losses and all(math.isfinite(x) for x in qat_losses)
    assert math.isfinite(json.loads((qat_run / "final.json").read_text())["val_loss"])
    packed = load_qtensors(qat_run / "quantized.safetensors")

    # 3. the QAT run exported for servers, in compressed-tensors: its trained codes as they are
    served = tmp_path / "served"
    code, err = cli(capsys, "export", qat_run, "--layout", "compressed-tensors", "--out", served,
                    "--no-progress")
    assert code == 0, err
    quant = json.loads((served / "config.json").read_text())["quantization_config"]
    assert quant["format"] == ct_format
    assert (served / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    summary = json.loads((served / "lowbit_export.json").read_text())
    assert summary["qat_weights_given"] == len(packed) and summary["reader_notes"] == []
    exported = load_exported(served)
    for name, q in packed.items():
        if name in exported.weights:   # a linear: its codes as QAT packed them
            got = exported.weights[name]
            assert torch.equal(got.codes, q.codes), name
            assert torch.equal(got.dequantize(torch.float32), q.dequantize(torch.float32)), name
            continue
        # an MoE layer's fused experts (E, rows, C), written one expert and projection at a time
        prefix, _, fused = name.rpartition(".")
        parts = ["down_proj"] if fused == "down_proj" else ["gate_proj", "up_proj"]
        for e, stack in enumerate(q.dequantize(torch.float32)):
            got = [exported.weights[f"{prefix}.{e}.{p}.weight"].dequantize(torch.float32) for p in parts]
            assert torch.equal(torch.cat(got), stack), (name, e)

    # 4. transformers loads that export, decompressed, to lowbit's own reading of it exactly
    hf = load_decompressed(served, dtype=dtype)
    ids = token_ids()
    torch.testing.assert_close(logits(hf, ids), logits(exported.model.to(dtype), ids), rtol=0, atol=0)

    # 4b. the FP4 run in every other format and layout a user can export
    export_every_format(kind, train_run, tmp_path / "formats", capsys)

    # 5. the FP4 run's master weights as a plain Hugging Face folder
    plain = tmp_path / "plain"
    code, err = cli(capsys, "export", train_run, "--format", "bf16", "--out", plain, "--no-progress")
    assert code == 0, err
    assert "quantization_config" not in json.loads((plain / "config.json").read_text())
    ours = load_model(plain, dtype=torch.float32)[0]
    for name, value in ours.state_dict().items():
        assert torch.equal(value, trained[name].bfloat16().float()), name
    hf = transformers.AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()
    torch.testing.assert_close(logits(hf, ids), logits(ours, ids), rtol=1e-5, atol=1e-5)

    # 6. RL from that folder: NVFP4 rollouts with QUADS, the defaults
    code, err = cli(capsys, "rl", "--model", plain, *RL, "--out-dir", runs)
    assert code == 0, err
    rl_run = runs / "rl-plain-add-nvfp4+quads"
    config = json.loads((rl_run / "config.json").read_text())
    assert config["model"] == str(plain) and config["warmstart_steps"] == 0
    steps = [r for r in records(rl_run) if r["event"] == "train"]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        gap = r["sampling/sampling_logp_difference/mean"]
        assert math.isfinite(r["loss"]) and math.isfinite(r["entropy"]) and 0 < gap < 1, r
    assert (rl_run / "final.json").is_file()
    # a random policy earns no reward: zero advantages, so the policy it checkpoints is still the
    # folder's weights, exactly
    assert all(r["frac_reward_zero_std"] == 1.0 for r in steps)
    policy = load_checkpoint(rl_run / "checkpoints" / "latest.pt")["model"]
    assert policy.keys() == ours.state_dict().keys()
    for name, value in ours.state_dict().items():
        assert torch.equal(policy[name], value), name


# Every quantized format `lowbit export` writes: (--format, --layout, --activations).
EXPORTS = [("nvfp4", "modelopt", "bf16"), ("nvfp4", "compressed-tensors", "bf16"),
           ("nvfp4", "compressed-tensors", "nvfp4"), ("mxfp4", "compressed-tensors", "bf16"),
           ("int4:g32", "compressed-tensors", "bf16"), ("int4:g32:asym", "compressed-tensors", "bf16"),
           ("int8:row", "compressed-tensors", "bf16"), ("int8:g32:asym", "compressed-tensors", "bf16")]


def export_every_format(kind, run, out, capsys):
    """`lowbit export RUN` in each of EXPORTS: compressed-tensors' own compressor decompresses
    every weight to lowbit's reading of the folder; transformers loads the folder to lowbit's
    logits wherever the export names no reader that loads it wrong (docs/models.md, "MoE
    exports in transformers": an MoE model in NVFP4 or `:asym` integers), and the export says
    so where it does; the ModelOpt layout holds the compressed-tensors one's values; a W4A4
    export holds the W4A16 one's weights and a static input scale for each of them."""
    from lowbit.export import load_exported

    ids = token_ids()
    read = {}
    for format, layout, activations in EXPORTS:
        folder = out / f"{format}-{layout}-{activations}".replace(":", "-")
        code, err = cli(capsys, "export", run, "--format", format, "--layout", layout,
                        "--activations", activations, "--calib-batches", "1", "--out", folder,
                        "--no-progress")
        assert code == 0, (format, layout, activations, err)
        exported = read[format, layout, activations] = load_exported(folder)
        assert exported.weights, folder
        notes = json.loads((folder / "lowbit_export.json").read_text())["reader_notes"]
        known_wrong = kind == "qwen3-moe" and (format == "nvfp4" and layout == "compressed-tensors"
                                               or format.endswith(":asym"))
        assert bool(notes) == known_wrong, (folder, notes)
        if layout == "modelopt":
            continue
        dense = compressed_tensors_weights(folder)
        assert dense.keys() == exported.weights.keys(), folder
        for name, value in dense.items():
            assert torch.equal(value, exported.weights[name].dequantize(value.dtype)), (folder, name)
        if known_wrong or activations == "nvfp4":
            continue
        # FP4 decompresses to BF16, the int formats to float32 (their scales' dtype)
        dtype = torch.bfloat16 if format.endswith("fp4") else torch.float32
        hf = load_decompressed(folder, dtype=dtype)
        torch.testing.assert_close(logits(hf, ids), logits(exported.model.to(dtype), ids),
                                   rtol=0, atol=0, msg=str(folder))
    modelopt, w4a16, w4a4 = (read["nvfp4", layout, act] for layout, act in
                             (("modelopt", "bf16"), ("compressed-tensors", "bf16"),
                              ("compressed-tensors", "nvfp4")))
    for name, q in w4a16.weights.items():
        for other in (modelopt, w4a4):
            assert torch.equal(other.weights[name].dequantize(torch.float32),
                               q.dequantize(torch.float32)), name
    scales = load_file(out / "nvfp4-compressed-tensors-nvfp4" / "model.safetensors")
    inputs = {k.removesuffix(".input_global_scale") for k in scales if k.endswith(".input_global_scale")}
    assert {n.removesuffix(".weight") for n in w4a16.weights} <= inputs
    assert all(torch.isfinite(scales[f"{m}.input_global_scale"]).all()
               and (scales[f"{m}.input_global_scale"] > 0).all() for m in inputs)


# --- the hand-offs between jobs: RL from a QAT run, and an RL run out ------------------------------

@pytest.fixture
def llama_folder(tmp_path):
    return save_hf_model("llama", tmp_path / "llama", dtype=torch.bfloat16)


def test_rl_starts_from_a_qat_runs_export(llama_folder, tmp_path, corpus_env, capsys):
    """`lowbit rl --model` takes a QAT run's export: the policy starts from its packed weights
    dequantized (lowbit.export.load_exported), bit for bit, with the folder's tokenizer."""
    from lowbit.export import load_exported
    from lowbit.train.checkpoint import load_checkpoint

    runs = tmp_path / "runs"
    code, err = cli(capsys, "qat", "--model", llama_folder, "--weights", "nvfp4", *DATA, *QAT,
                    "--out-dir", runs)
    assert code == 0, err
    served = tmp_path / "served"
    code, err = cli(capsys, "export", runs / "qat-llama-nvfp4-ste", "--layout",
                    "compressed-tensors", "--out", served, "--no-progress")
    assert code == 0, err
    code, err = cli(capsys, "rl", "--model", served, *RL, "--rollout", "bf16", "--align", "none",
                    "--out-dir", runs)
    assert code == 0, err
    (run,) = runs.glob("rl-served-*")
    policy = load_checkpoint(run / "checkpoints" / "latest.pt")["model"]
    start = load_exported(served).model.state_dict()
    # a random policy on this task earns no reward, so RL's updates are zero: the checkpoint is
    # the policy it started from
    assert all(r["frac_reward_zero_std"] == 1.0 for r in records(run) if r["event"] == "train")
    for name, value in start.items():
        assert torch.equal(policy[name], value), name


def test_an_rl_run_exports_as_a_plain_folder_transformers_loads(llama_folder, tmp_path, capsys):
    """The RL policy (the trainer's weights, QUADS' trainer side included) leaves as a plain
    Hugging Face folder: its weights are the checkpoint's rounded to bf16, its tokenizer the
    source folder's, and transformers loads it."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from lowbit.train.checkpoint import load_checkpoint

    runs = tmp_path / "runs"
    code, err = cli(capsys, "rl", "--model", llama_folder, *RL, "--out-dir", runs)
    assert code == 0, err
    run = runs / "rl-llama-add-nvfp4+quads"
    code, err = cli(capsys, "export", run, "--format", "bf16", "--out", tmp_path / "plain",
                    "--no-progress")
    assert code == 0, err
    policy = load_checkpoint(run / "checkpoints" / "latest.pt")["model"]
    exported = load_file(tmp_path / "plain" / "model.safetensors")
    for name, value in exported.items():
        assert torch.equal(value, policy[name].to(torch.bfloat16)), name
    assert ((tmp_path / "plain" / "tokenizer.json").read_bytes()
            == (llama_folder / "tokenizer.json").read_bytes())
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "plain", dtype=torch.float32)
    ids = torch.randint(0, hf.config.vocab_size, (1, 8))
    assert torch.isfinite(hf(ids).logits).all()
    # a reader that needs a train run says how to hand the policy over instead
    code, err = cli(capsys, "qat", "--from", run, *QAT, "--out-dir", runs)
    assert code == 2 and "is a lowbit rl run, not a lowbit train run" in err, err
    assert f"lowbit export {run} --format bf16" in err
    code, err = cli(capsys, "rl", "--model", run, *RL, "--out-dir", runs)
    assert code == 2 and f"{run} is a lowbit run folder, not a Hugging Face model folder" in err
