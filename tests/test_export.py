"""lowbit export: servable NVFP4 / MXFP4 folders, read back bit for bit by load_exported,
checked against the ModelOpt conventions tensor by tensor and decompressed independently by
compressed-tensors (through transformers' loader)."""

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from hf_models import TEXT, compressed_tensors_weights, load_decompressed, save_hf_model, tokenizer
from lowbit.export import calibrate_input_amax, export_model, load_exported, quantize_group, weight_groups
from lowbit.formats import QTensor, QuantSpec, quantize, quantize_dequantize
from lowbit.models import load_model

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for kind in ("llama", "qwen3-moe"):
        path = save_hf_model(kind, tmp_path_factory.mktemp(kind), dtype=torch.bfloat16)
        out[kind] = (path, load_model(path, dtype=torch.float32)[0])
    return out


def _tensors(folder):
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _tokens():
    ids = torch.tensor(tokenizer().encode(TEXT[:3000]).ids)
    return ids[: (len(ids) // 64) * 64].view(-1, 64)[:6]


def _perplexity(model, ids):
    with torch.no_grad():
        logits = model(ids[:, :-1]).logits
    return math.exp(F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten()).item())


def _fake_quantized(model, spec, dtype=torch.float32):
    """The model with every exported group's weights quantize-dequantized by the reference
    (formats), stacked along rows so each group shares its tensor scale."""
    fake, _, _ = load_model(model._source, dtype=dtype)
    params = dict(fake.named_parameters())
    for group in weight_groups(model):
        stacked = torch.cat([w.detach() for _, w in group])
        deq = quantize_dequantize(stacked, spec).split([w.shape[0] for _, w in group])
        for (name, _), d in zip(group, deq):
            *mod, e, proj = name.split(".")
            if "experts" in name:
                base = ".".join(mod)
                F_ = fake.config.moe_ffn_dim
                with torch.no_grad():
                    if proj == "down_proj":
                        params[f"{base}.down_proj"][int(e)] = d
                    else:
                        rows = slice(0, F_) if proj == "gate_proj" else slice(F_, 2 * F_)
                        params[f"{base}.gate_up_proj"][int(e), rows] = d
            else:
                with torch.no_grad():
                    params[f"{name}.weight"].copy_(d)
    return fake


@pytest.mark.parametrize("kind", ["llama", "qwen3-moe"])
@pytest.mark.parametrize("layout", ["modelopt", "compressed-tensors"])
def test_round_trip_is_bit_exact_and_perplexity_is_the_fake_quantized_one(models, kind, layout, tmp_path):
    path, model = models[kind]
    model._source = path
    report = export_model(model, tmp_path, layout=layout, tokenizer_dir=path, progress=False)
    assert report.weight_ratio <= 0.29
    assert (tmp_path / "tokenizer.json").read_bytes() == (path / "tokenizer.json").read_bytes()
    exported = load_exported(tmp_path)
    spec = QuantSpec.make("nvfp4")
    for group in weight_groups(model):
        expected = quantize_group([w for _, w in group], spec)
        for (name, _), q in zip(group, expected):
            got = exported.weights[f"{name}.weight"]
            assert torch.equal(got.codes, q.codes), name
            assert torch.equal(got.scales.view(torch.uint8), q.scales.view(torch.uint8)), name
            assert torch.equal(got.tensor_scale, q.tensor_scale), name
        # fused groups (q/k/v, gate/up, each expert's gate/up) share their tensor scale
        assert len({float(q.tensor_scale) for q in expected}) == 1
    ids = _tokens()
    assert _perplexity(exported.model, ids) == _perplexity(_fake_quantized(model, spec), ids)
    assert _perplexity(exported.model, ids) != _perplexity(model, ids)


def test_modelopt_tensors_follow_the_documented_conventions(models, tmp_path):
    path, model = models["qwen3-moe"]
    export_model(model, tmp_path, layout="modelopt", progress=False)
    quant = json.loads((tmp_path / "hf_quant_config.json").read_text())["quantization"]
    assert quant["quant_algo"] == "W4A16_NVFP4" and quant["group_size"] == 16
    assert quant["kv_cache_quant_algo"] is None
    assert {"lm_head", "model.layers.0.mlp.gate", "model.layers.1.mlp.gate"} <= set(quant["exclude_modules"])
    t = _tensors(tmp_path)
    assert "model.layers.0.mlp.experts.gate_up_proj" not in t      # per-expert 2D tensors
    assert t["model.layers.0.mlp.gate.weight"].dtype == torch.bfloat16
    assert t["model.embed_tokens.weight"].dtype == torch.bfloat16
    w = model.model.layers[1].mlp.experts.gate_up_proj[2]       # (2F, C) gate rows, then up
    F_ = model.config.moe_ffn_dim
    for proj, rows in (("gate_proj", w[:F_]), ("up_proj", w[F_:])):
        name = f"model.layers.1.mlp.experts.2.{proj}"
        packed, scale, scale_2 = t[f"{name}.weight"], t[f"{name}.weight_scale"], t[f"{name}.weight_scale_2"]
        R, C = rows.shape
        assert (packed.dtype, tuple(packed.shape)) == (torch.uint8, (R, C // 2))
        assert (scale.dtype, tuple(scale.shape)) == (torch.float8_e4m3fn, (R, C // 16))
        assert (scale_2.dtype, tuple(scale_2.shape)) == (torch.float32, ())
        # decode by hand: low nibble = even element, bit 3 = sign, the rest indexes E2M1
        nibbles = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).long()
        values = torch.tensor(E2M1)[nibbles & 7] * (1 - 2 * (nibbles >> 3)).float()
        block = (scale_2 * scale.float()).repeat_interleave(16, dim=-1)
        reference = quantize_dequantize(w, QuantSpec.make("nvfp4"))   # gate and up: one tensor scale
        assert torch.equal(values * block, reference[:F_] if proj == "gate_proj" else reference[F_:])
        # the weight_scale_2 convention: amax of the expert's gate and up together / (448 * 6)
        assert scale_2.item() == pytest.approx(w.abs().max().item() / 2688, rel=1e-6)


def test_compressed_tensors_decompresses_to_lowbits_dequantized_weights(models, tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("compressed_tensors")
    path, model = models["llama"]
    export_model(model, tmp_path, layout="compressed-tensors", tokenizer_dir=path, progress=False)
    exported = load_exported(tmp_path)
    hf = load_decompressed(tmp_path)
    state = hf.state_dict()
    for name, q in exported.weights.items():
        assert torch.equal(state[name], q.dequantize(torch.bfloat16)), name
    ids = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, exported.model.to(torch.bfloat16)(ids).logits,
                                   rtol=0, atol=0)


def test_the_upstream_reproducer_shows_the_fused_experts_bug_without_lowbit(tmp_path):
    """docs/upstream/transformers_fused_experts_nvfp4_repro.py, the reproducer for transformers:
    a checkpoint compressed-tensors' own compressor writes loads its experts wrong (exit 1) and
    its attention exactly. When transformers is fixed it exits 0, and this test says so."""
    import subprocess
    import sys

    pytest.importorskip("transformers")
    pytest.importorskip("compressed_tensors")
    script = Path(__file__).parents[1] / "docs" / "upstream" / "transformers_fused_experts_nvfp4_repro.py"
    done = subprocess.run([sys.executable, str(script), "--out", str(tmp_path / "ckpt")],
                          capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith(("plain:", "dequantize=True:"))]
    assert len(lines) == 2 and all("attention 0," in line for line in lines), done.stdout + done.stderr
    assert done.returncode == 1 and "the fused experts load wrong" in done.stdout, (
        "transformers now loads NVFP4 fused experts exactly: drop the export's reader note, the "
        "docs' warning and the strict xfails (docs/models.md, 'MoE exports in transformers')\n"
        + done.stdout + done.stderr)


@pytest.mark.xfail(raises=AssertionError, strict=True, reason=(
    "transformers 5.25 decompresses fused experts without weight_global_scale "
    "(docs/models.md, 'MoE exports in transformers'); when this passes, drop the export's "
    "reader note and the docs' warning"))
def test_transformers_loads_the_experts_of_an_moe_nvfp4_export_exactly(models, tmp_path):
    _assert_transformers_loads_the_experts_exactly(models, tmp_path, layout="compressed-tensors")


@pytest.mark.xfail(raises=RuntimeError, strict=True, reason=(
    "transformers 5.25 decompresses fused experts without weight_zero_point, which "
    "compressed-tensors refuses ('Asymmetric quant requires zero-point values'; docs/models.md, "
    "'MoE exports in transformers'); when this passes, drop the export's reader note and the "
    "docs' warning"))
def test_transformers_loads_the_experts_of_an_moe_asym_int_export_exactly(models, tmp_path):
    _assert_transformers_loads_the_experts_exactly(models, tmp_path, format="int4:g32:asym")


def _assert_transformers_loads_the_experts_exactly(models, folder, **export):
    pytest.importorskip("transformers")
    pytest.importorskip("compressed_tensors")
    path, model = models["qwen3-moe"]
    export_model(model, folder, tokenizer_dir=path, progress=False, **export)
    exported = load_exported(folder)
    hf = load_decompressed(folder)
    state, ref = hf.state_dict(), exported.weights       # (dense layers: exact, tested above)
    experts = "model.layers.0.mlp.experts"
    down = torch.stack([ref[f"{experts}.{e}.down_proj.weight"].dequantize(torch.bfloat16)
                        for e in range(hf.config.num_experts)])
    assert torch.equal(state[f"{experts}.down_proj"].to(torch.bfloat16), down)


def test_an_moe_export_names_the_readers_known_to_load_it_wrong(models, tmp_path, capsys):
    from lowbit.cli import main
    path, model = models["qwen3-moe"]
    nvfp4 = export_model(model, tmp_path / "a", layout="compressed-tensors", progress=False)
    assert len(nvfp4.notes) == 1 and "weight_global_scale" in nvfp4.notes[0]
    asym = export_model(model, tmp_path / "b", format="int4:g32:asym", progress=False)
    assert len(asym.notes) == 1 and "weight_zero_point" in asym.notes[0]
    for fine in (export_model(model, tmp_path / "c", format="int4:g32", progress=False),
                 export_model(model, tmp_path / "d", layout="modelopt", progress=False),
                 export_model(models["llama"][1], tmp_path / "e", layout="compressed-tensors",
                              progress=False)):
        assert fine.notes == []
    assert main(["export", str(path), "--format", "nvfp4", "--layout", "compressed-tensors",
                 "--out", str(tmp_path / "f"), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("lowbit: warning: transformers (5.25") and "weight_global_scale" in err
    assert json.loads((tmp_path / "f" / "lowbit_export.json").read_text())["reader_notes"] == nvfp4.notes


@pytest.mark.parametrize("format", ["nvfp4", "mxfp4"])
def test_compressed_tensors_compressor_reads_experts_and_mxfp4(models, format, tmp_path):
    pytest.importorskip("compressed_tensors")
    path, model = models["qwen3-moe"]
    export_model(model, tmp_path, format=format, layout="compressed-tensors", progress=False)
    exported = load_exported(tmp_path)
    dense = compressed_tensors_weights(tmp_path)
    assert dense.keys() == exported.weights.keys() and len(dense) == 2 * (4 + 4 * 3)
    for name, value in dense.items():
        assert torch.equal(value, exported.weights[name].dequantize(torch.bfloat16)), name


def test_qat_weights_are_written_as_they_are(models, tmp_path):
    path, model = models["llama"]
    # packed weights as a QAT run would hand them over: NVFP4 16x16 tiles, q/k/v of layer 0 with
    # one tensor scale
    weights = {}
    attn = model.model.layers[0].self_attn
    stacked = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach() * 0.9
    q_all = quantize(stacked, "nvfp4", block=(16, 16))
    deq = q_all.dequantize()
    sizes = [attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features]
    from lowbit.export import split_rows
    for n, q in zip(("q_proj", "k_proj", "v_proj"), split_rows(q_all, sizes)):
        weights[f"model.layers.0.self_attn.{n}.weight"] = q
    export_model(model, tmp_path, weights=weights, progress=False)
    got = load_exported(tmp_path).weights
    back = torch.cat([got[f"model.layers.0.self_attn.{n}.weight"].dequantize(torch.float32)
                      for n in ("q_proj", "k_proj", "v_proj")])
    assert torch.equal(back, deq)                          # no requantization
    # different tensor scales in one fused group: refused, unless allowed
    weights["model.layers.0.self_attn.k_proj.weight"] = quantize(attn.k_proj.weight.detach(), "nvfp4")
    with pytest.raises(ValueError, match="different tensor scales"):
        export_model(model, tmp_path / "b", weights=weights, progress=False)
    export_model(model, tmp_path / "c", weights=weights, allow_unshared_scales=True, progress=False)


def test_w4a4_calibration_writes_static_input_scales(models, tmp_path):
    path, model = models["qwen3-moe"]
    amax = calibrate_input_amax(model, [_tokens()[:2]])
    assert "model.layers.0.self_attn.q_proj" in amax and "model.layers.1.mlp.experts.3.down_proj" in amax
    report = export_model(model, tmp_path, input_amax=amax, progress=False)
    assert "W4A4, static NVFP4 input scales" in str(report)      # not read as weight-only
    assert json.loads((tmp_path / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == "NVFP4"
    t = _tensors(tmp_path)
    s = t["model.layers.0.self_attn.q_proj.input_scale"]
    assert s.dtype == torch.float32 and s.item() == pytest.approx(amax["model.layers.0.self_attn.q_proj"] / 2688)


def test_cli_export_and_its_errors(models, tmp_path, capsys):
    from lowbit.cli import main

    path, _ = models["llama"]
    assert main(["export", str(path), "--format", "nvfp4", "--layout", "compressed-tensors",
                 "--out", str(tmp_path / "ct"), "--no-progress"]) == 0
    assert "0.282x their BF16 size" in capsys.readouterr().out
    summary = json.loads((tmp_path / "ct" / "lowbit_export.json").read_text())
    assert summary["weight_ratio"] <= 0.29
    assert main(["export", str(path), "--format", "mxfp4", "--layout", "modelopt",
                 "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "mxfp4 has no modelopt layout" in err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("format", ["int4:g32", "int8:row", "int8:g16:asym"])
def test_int_exports_load_in_transformers_with_lowbits_values(models, format, tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("compressed_tensors")
    from lowbit.export.layouts import parse_export_format

    path, model = models["llama"]
    export_model(model, tmp_path, format=format, tokenizer_dir=path, progress=False)
    exported = load_exported(tmp_path)
    fmt = parse_export_format(format)
    for group in weight_groups(model):   # round to nearest, as lowbit.formats quantizes
        expected = quantize_group([w for _, w in group], fmt.spec(group[0][1].shape[1]))
        for (name, _), q in zip(group, expected):
            got = exported.weights[f"{name}.weight"]
            assert torch.equal(got.codes, q.codes) and torch.equal(got.scales, q.scales), name
            assert (q.zeros is None) == (not fmt.asym) and (q.zeros is None or torch.equal(got.zeros, q.zeros))
    hf = load_decompressed(tmp_path)
    state = hf.state_dict()   # decompressed in float32 (our scales' dtype), then cast to the model's BF16
    for name, q in exported.weights.items():
        assert torch.equal(state[name], q.dequantize(torch.bfloat16)), name


# Without CompressedTensorsConfig(dequantize=True) transformers leaves the weights compressed
# and compressed-tensors decompresses them on the first forward pass, here in the export's BF16.
@pytest.mark.parametrize("format", ["nvfp4", "mxfp4", "int4:g32", "int8:row"])
def test_transformers_runs_a_dense_export_as_lowbit_does_without_dequantize(models, format, tmp_path):
    export_model(models["llama"][1], tmp_path, format=format, layout="compressed-tensors",
                 progress=False)
    _assert_plain_transformers_runs_it_as_lowbit(tmp_path)


@pytest.mark.xfail(raises=RuntimeError, strict=True, reason=(
    "transformers 5.25 builds the compressed model on the meta device with unpacked (R, G) zero "
    "points, and the export's packed (R/8, G) ones fail its size check (docs/models.md, 'Loading "
    "an export in transformers'); when this passes, correct the docs"))
def test_transformers_runs_a_dense_asym_int_export_without_dequantize(models, tmp_path):
    export_model(models["llama"][1], tmp_path, format="int4:g32:asym", progress=False)
    _assert_plain_transformers_runs_it_as_lowbit(tmp_path)


def _assert_plain_transformers_runs_it_as_lowbit(folder):
    """`from_pretrained(folder)` decompresses every weight to lowbit's BF16 values and gives
    lowbit's logits, bit for bit. transformers casts the int formats' float32 scales to the
    model's BF16 before it decompresses (as a BF16 server does, docs/models.md), so lowbit's
    reference takes its scales rounded the same way."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("compressed_tensors")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    exported = load_exported(folder)
    lowbit = exported.model.to(torch.bfloat16)
    params = dict(lowbit.named_parameters())
    ids = _tokens()
    with torch.no_grad():
        logits = hf(ids).logits
        for name, q in exported.weights.items():
            if q.scales.dtype == torch.float32:
                q = QTensor(q.codes, q.scales.to(torch.bfloat16).float(), q.tensor_scale, q.spec,
                            q.shape, q.dtype, q.zeros)
            expected = q.dequantize(torch.bfloat16)
            assert torch.equal(hf.get_submodule(name.removesuffix(".weight")).weight, expected), name
            params[name].copy_(expected)
        torch.testing.assert_close(logits, lowbit(ids).logits, rtol=0, atol=0)


@pytest.mark.xfail(raises=RuntimeError, strict=True, reason=(
    "compressed-tensors 0.20.1 decompresses FP4 weights to BF16 whatever the model's dtype, and "
    "the first float32 forward multiplies float32 activations by them (docs/models.md, 'Loading "
    "an export in transformers'); when this passes, correct the docs"))
@pytest.mark.parametrize("format", ["nvfp4", "mxfp4"])
def test_transformers_runs_an_fp4_export_in_float32_without_dequantize(models, format, tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("compressed_tensors")
    export_model(models["llama"][1], tmp_path, format=format, layout="compressed-tensors",
                 progress=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = _tokens()[:2]
    with torch.no_grad():   # lowbit's float32 products, or their BF16 roundings widened
        torch.testing.assert_close(hf(ids).logits, load_exported(tmp_path).model(ids).logits,
                                   atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("kind", ["llama", "qwen3-moe"])
def test_bf16_export_is_a_plain_folder_transformers_and_lowbit_load(models, kind, tmp_path, capsys):
    from lowbit.cli import main

    transformers = pytest.importorskip("transformers")
    path, model = models[kind]
    out = tmp_path / "plain"
    assert main(["export", str(path), "--format", "bf16", "--out", str(out), "--no-progress"]) == 0
    assert "plain Hugging Face folder in bf16" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and (out / "tokenizer.json").is_file()
    again, _, _ = load_model(out, dtype=torch.float32)
    expected = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    for name, value in again.state_dict().items():
        assert torch.equal(value.to(torch.bfloat16), expected[name]), name
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = _tokens()[:2]
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, again(ids).logits, atol=2e-3, rtol=2e-3)
    # no --layout or W4A4 with it
    assert main(["export", str(path), "--format", "bf16", "--layout", "modelopt",
                 "--out", str(tmp_path / "x")]) == 2
    assert "takes no --layout" in capsys.readouterr().err


def test_int_formats_default_to_their_serving_granularity():
    from lowbit.export.layouts import parse_export_format

    assert parse_export_format("int4").group == 128            # GPTQ / AWQ's groups
    assert parse_export_format("int8").group is None           # per output channel (W8A16)
    assert parse_export_format("int8:g64").group == 64
