"""QAT, export and quantize driven as a reliability probe drove them, wrongly: QAT or export
from a run that stopped or is still running, a source whose config.json was edited, an export
whose corpus changed since the run, a `lowbit qat` killed while training its cached base run,
jacquant flags with another estimator, a second qat.convert, lowbit.convert on a model prepared
for QAT, quantize of a tensor that requires grad or of a meta tensor, a QAT run written before
job records (job.json). docs/reliability.md tabulates them.

Runs are tiny: stand-in data (tests/pattern_data.py) or a few KB of text, one-layer models, a
few steps on the CPU.
"""

import dataclasses
import json
import random
import re

import pytest
import torch
from run_helpers import cli, finished_run, one_line_error, use_pattern_data
from test_reliability_runs import QAT, contents, held_by_another_process
from torch import nn

import lowbit
import lowbit.qat.run as qat_run
from lowbit.cli import build_parser
from lowbit.formats import FORMATS
from lowbit.qat import QATConfig, convert, packed_weights, prepare
from lowbit.qat.cli_args import job_from_args
from lowbit.train import JobRecord, TrainConfig
from lowbit.train.checkpoint import load_checkpoint, save_checkpoint
from lowbit.train.job_record import OLD_CONFIG_KEYS
from lowbit.train.run_dir import RunDir


@pytest.fixture
def pattern_data(monkeypatch):
    use_pattern_data(monkeypatch)


EXPORT = ["--no-progress"]





def _export(capsys, run, out, *extra):
    return cli(capsys, "export", run, "--out", out, *EXPORT, *extra)


# --- 1. an unfinished or live source run ----------------------------------------------------------

def test_qat_and_export_refuse_an_unfinished_or_live_run_unless_allowed(tmp_path, capsys,
                                                                        pattern_data):
    source = finished_run(tmp_path, "src", 0)
    final = (source / "final.json").read_bytes()
    (source / "final.json").unlink()   # the run stopped before its last step
    qat = [*QAT, "--out-dir", tmp_path / "qat", "--from", source]
    code, err = cli(capsys, *qat)
    one_line_error(code, err, f"{source} holds an unfinished run", "--allow-unfinished")
    code, err = _export(capsys, source, tmp_path / "out")
    one_line_error(code, err, f"{source} holds an unfinished run", "--allow-unfinished")
    assert not (tmp_path / "qat").exists() and not (tmp_path / "out").exists()
    assert cli(capsys, *qat, "--allow-unfinished")[0] == 0
    assert _export(capsys, source, tmp_path / "out", "--allow-unfinished")[0] == 0

    (source / "final.json").write_bytes(final)
    before = contents(source)
    with held_by_another_process(source):   # a live run: not read, even when allowed
        for extra in ([], ["--allow-unfinished"]):
            code, err = cli(capsys, *qat, "--overwrite", *extra)
            one_line_error(code, err, f"{source} is in use", "another lowbit process (pid 4242)")
            code, err = _export(capsys, source, tmp_path / "out2", *extra)
            one_line_error(code, err, f"{source} is in use", "another lowbit process (pid 4242)")
    assert contents(source) == before and not (tmp_path / "out2").exists()
    code, err = cli(capsys, "qat", "--allow-unfinished", "--estimator", "ste")
    one_line_error(code, err, "--allow-unfinished goes with --from")


def test_every_reader_opens_a_run_through_run_dir_open(tmp_path, capsys, pattern_data):
    """RunDir.open is the one place a run is read back: config from the checksummed checkpoint,
    final.json's record; a folder with no run, or a final.json that is not JSON, is one line for
    QAT, export and inspect alike."""
    source = finished_run(tmp_path, "src", 0)
    saved = RunDir(source).open()
    assert saved.config == TrainConfig.from_dict(json.loads((source / "config.json").read_text()))
    assert saved.job == JobRecord() == JobRecord.from_dict(json.loads((source / "job.json").read_text()))
    assert saved.final == json.loads((source / "final.json").read_text())
    assert saved.state["step"] == 2 and "model.embed_tokens.weight" in saved.state["model"]
    assert RunDir(source).finished and not RunDir(tmp_path / "none").finished

    empty = tmp_path / "empty"
    empty.mkdir()
    qat = [*QAT, "--out-dir", tmp_path / "qat"]
    for command in ([*qat, "--from", empty], ["inspect", "--gradients", empty, "--recipes", "mxfp4"]):
        code, err = cli(capsys, *command)
        one_line_error(code, err, f"{empty} is not a finished lowbit train run folder")
    (source / "final.json").write_text("{not json")
    for command in ([*qat, "--from", source], ["export", source, "--out", tmp_path / "out",
                                               *EXPORT]):
        code, err = cli(capsys, *command)
        one_line_error(code, err, f"{source / 'final.json'} is not JSON")
    assert not (tmp_path / "qat").exists() and not (tmp_path / "out").exists()


# --- 2. QAT reads the source's checksummed config, not its config.json ---------------------------

def test_qat_takes_the_source_config_from_its_checkpoint_and_refuses_an_edited_model(
        tmp_path, capsys, pattern_data):
    source = finished_run(tmp_path, "src", 0)
    file = source / "config.json"
    written = json.loads(file.read_text())
    # an edit that does not change the model: the checkpoint's value is the one QAT takes
    file.write_text(json.dumps({**written, "batch_size": 3}))
    assert cli(capsys, *QAT, "--out-dir", tmp_path / "qat", "--from", source)[0] == 0
    run = tmp_path / "qat" / "q-int4-g32-ste"
    assert json.loads((run / "config.json").read_text())["batch_size"] == 2
    # an edit that changes the model is refused, naming the field
    file.write_text(json.dumps({**written, "dim": 128, "n_layers": 2}))
    code, err = cli(capsys, *QAT, "--out-dir", tmp_path / "qat2", "--from", source)
    one_line_error(code, err, f"{file} disagrees with its checkpoint", "dim (128; the checkpoint's 64)",
                   "n_layers (2; the checkpoint's 1)")
    assert not (tmp_path / "qat2").exists()


# --- 3. an export retrains a BPE tokenizer only from the corpus the run read --------------------

def _text(seed: int) -> str:
    words = ["lord", "king", "queen", "sword", "night", "crown", "love", "death", "France",
             "blood", "heaven", "fair", "speak", "sweet", "noble", "grace"]
    rng = random.Random(seed)
    lines = [" ".join(rng.choice(words) for _ in range(12)) + "." for _ in range(300)]
    return "\n".join(lines) + "\n"


def test_export_of_a_bpe_run_refuses_a_corpus_that_changed_since_training(tmp_path, capsys,
                                                                         monkeypatch):
    monkeypatch.setenv("LOWBIT_CACHE", str(tmp_path / "cache"))
    corpus = tmp_path / "data" / "tinyshakespeare" / "input.txt"
    corpus.parent.mkdir(parents=True)
    corpus.write_text(_text(0))
    code, err = cli(capsys, "train", "--recipe", "bf16", "--n-layers", "1", "--dim", "64",
                    "--seq-len", "8", "--batch-size", "2", "--steps", "2", "--eval-every", "0",
                    "--eval-batches", "1", "--tokenizer", "bpe", "--bpe-vocab-size", "300",
                    "--data-dir", tmp_path / "data", "--no-progress", "--no-diagnostics",
                    "--device", "cpu", "--out-dir", tmp_path, "--run-name", "bpe")
    assert code == 0, err
    run = tmp_path / "bpe"
    assert _export(capsys, run, tmp_path / "out")[0] == 0   # the same corpus: the same ids
    exported = json.loads((tmp_path / "out" / "tokenizer.json").read_text())
    assert len(exported["model"]["vocab"]) == 300
    corpus.write_text(_text(1))   # another text where the run's corpus was
    code, err = _export(capsys, run, tmp_path / "out2")
    one_line_error(code, err, f"cannot export {run}", "not the text the run trained on",
                   "fingerprint", "restore that corpus")
    assert not (tmp_path / "out2").exists()


# --- 4. a `lowbit qat` killed while training its cached base run ---------------------------------

@dataclasses.dataclass
class SmallBase(TrainConfig):
    """TrainConfig with a one-layer model and tiny batches: the cached base run, made small."""
    n_layers: int | None = 1
    dim: int | None = 64
    seq_len: int = 8
    batch_size: int = 2
    eval_batches: int = 1


def test_qat_redoes_or_resumes_a_cached_base_run_that_a_kill_left_unfinished(tmp_path, capsys,
                                                                            pattern_data,
                                                                            monkeypatch):
    monkeypatch.setattr(qat_run, "TrainConfig", SmallBase)
    qat = [*QAT, "--out-dir", tmp_path, "--base-steps", "1", "--steps", "1"]
    base = tmp_path / "base-bf16-tiny-1"
    # killed before the base's first checkpoint: config.json and a metrics line, no checkpoint
    base.mkdir()
    (base / "config.json").write_text("{}\n")
    (base / "metrics.jsonl").write_text('{"event": "train", "step": 1, "loss": 3.0}\n')
    with held_by_another_process(base):   # a live base run is refused, not taken as killed
        code, err = cli(capsys, *qat)
        one_line_error(code, err, f"{base} is in use")
    code, err = cli(capsys, *qat)
    assert code == 0, err
    assert f"the cached base run {base} was stopped before its first checkpoint" in err
    assert load_checkpoint(base / "checkpoints" / "latest.pt")["step"] == 1
    # killed after a checkpoint: resumed
    (base / "final.json").unlink()
    code, err = cli(capsys, *qat, "--overwrite")
    assert code == 0, err
    assert f"the cached base run {base} was stopped before its end; resuming it" in err
    assert (base / "final.json").is_file()
    # no checkpoint that verifies: trained again
    (base / "final.json").unlink()
    for checkpoint in (base / "checkpoints").glob("*.pt"):
        checkpoint.write_bytes(b"torn")
    code, err = cli(capsys, *qat, "--overwrite")
    assert code == 0, err
    assert f"no checkpoint of {base} resumes" in err and "training the base run again" in err
    assert load_checkpoint(base / "checkpoints" / "latest.pt")["step"] == 1


# --- 5. jacquant's flags with another estimator ---------------------------------------------------

@pytest.mark.parametrize("flag", [["--refresh-every", "5"], ["--b-max", "2.0"], ["--b-estimate", "probe"],
                                  ["--b-eps", "0.5"], ["--b-samples", "2"], ["--b-ema", "0.5"],
                                  ["--no-b-per-element"], ["--b-unweighted"], ["--b-on", "update"]],
                         ids=lambda flag: flag[0])
def test_qat_refuses_jacquant_flags_with_another_estimator(tmp_path, capsys, flag):
    # a flag equal to its default is refused too: it was given, and means nothing here
    code, err = cli(capsys, *QAT, "--out-dir", tmp_path, *flag)
    one_line_error(code, err, f"{flag[0]} sets jacquant's B", "--estimator ste")
    code, err = cli(capsys, *QAT, "--compare", "ste,lsq", "--out-dir", tmp_path, *flag)
    one_line_error(code, err, f"{flag[0]} sets jacquant's B", "--compare ste,lsq")
    assert not any(tmp_path.iterdir())


def test_jacquant_flags_go_to_the_jacquant_run_of_a_compare_only():
    args = build_parser().parse_args(["qat", "--compare", "ste,jacquant", "--b-max", "1.5",
                                      "--b-unweighted", "--no-b-per-element"])
    ste, jacquant = job_from_args(args).configs
    assert ste.jacquant == QATConfig().jacquant
    jq = jacquant.jacquant
    assert (jq.b_max, jq.weighted, jq.per_element, jq.refresh_every) == (1.5, False, False, 100)


# --- 6, 7. qat.convert twice; lowbit.convert on a QAT model ---------------------------------------

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x):
        return self.b(self.a(x))


def _prepared() -> Net:
    torch.manual_seed(0)
    net = Net()
    prepare(net, QATConfig(weights="int4:g32", estimator="lsq"))
    return net


def test_a_second_qat_convert_says_the_model_is_already_converted():
    net = _prepared()
    assert convert(net) == 2
    packed = {name: q.codes.clone() for name, q in packed_weights(net).items()}
    with pytest.raises(ValueError, match="the model is already converted") as e:
        convert(net)
    assert "prepare" not in str(e.value) and "\n" not in str(e.value)
    assert all(torch.equal(packed_weights(net)[n].codes, c) for n, c in packed.items())
    with pytest.raises(ValueError, match="no fake-quantized weight; run lowbit.qat.prepare"):
        convert(Net())   # a model never prepared is still told to prepare


def _snapshot(net):
    return ({n: type(m) for n, m in net.named_modules()},
            {k: v.clone() for k, v in net.state_dict().items()})


def test_lowbit_convert_refuses_a_model_prepared_for_qat_and_changes_nothing():
    every = lambda module, name: True
    net = _prepared()
    x = torch.randn(4, 64)
    types, state = _snapshot(net)
    out = net(x)
    with pytest.raises(ValueError) as e:
        lowbit.quantize_(net, "nvfp4", filter_fn=every)
    message = str(e.value)
    assert "\n" not in message
    for fragment in ("a is prepared for QAT", "would drop", "lowbit.qat.convert", "fresh model",
                     "nothing was changed"):
        assert fragment in message, message
    after_types, after_state = _snapshot(net)
    assert after_types == types and after_state.keys() == state.keys()
    assert all(torch.equal(after_state[k], state[k]) for k in state)
    assert torch.equal(net(x), out)
    assert net.a.parametrizations.weight.original.requires_grad   # still training
    # packed by qat.convert: the swap would drop the packed codes, refused too
    convert(net)
    packed = {name: q.codes.clone() for name, q in packed_weights(net).items()}
    with pytest.raises(ValueError, match="a holds packed weights"):
        lowbit.quantize_(net, "nvfp4", filter_fn=every)
    assert all(torch.equal(packed_weights(net)[n].codes, c) for n, c in packed.items())
    # a fresh model converts as before
    assert len(lowbit.quantize_(Net(), "nvfp4", filter_fn=every).swapped) == 2


# --- 8, 9. quantize is storage: no autograd graph, no meta tensors ------------------------------

QUANTIZERS = {"lowbit.quantize": lowbit.quantize, "lowbit.formats.quantize": lowbit.formats.quantize}


@pytest.mark.parametrize("entry", QUANTIZERS)
def test_quantize_builds_no_autograd_graph_for_any_format(entry):
    quantize = QUANTIZERS[entry]
    for format in FORMATS:
        x = torch.randn(4, 64, requires_grad=True)
        q = quantize(x, format)
        for part in (q.codes, q.scales, q.tensor_scale, q.zeros):
            assert part is None or (part.grad_fn is None and not part.requires_grad), format
        w = torch.randn(4, 64, requires_grad=True)
        (q.dequantize(torch.float32) * w).sum().backward()
        assert x.grad is None, format               # no gradient through codes or scales
        assert torch.equal(w.grad, q.dequantize(torch.float32)), format


@pytest.mark.parametrize("entry", QUANTIZERS)
def test_quantize_refuses_a_meta_tensor_for_every_format(entry):
    for format in FORMATS:
        with pytest.raises(ValueError, match="a meta tensor .* holds none") as e:
            QUANTIZERS[entry](torch.empty(4, 64, device="meta"), format)
        assert "\n" not in str(e.value)


def test_a_qat_run_saved_before_a_field_existed_still_resumes():
    # a JacQuant run from before the shuffled-B control and B's storage option: its saved
    # job record lacks shuffle_b and b_dtype, which then were off and float32; a resume
    # compares against those, not against "absent"
    from lowbit.qat import parse_qat_spec

    q = parse_qat_spec("int2:g64/jacquant").to_dict()
    job = JobRecord(kind="qat", qat=q)
    old = job.to_dict()
    old["qat"] = {**q, "jacquant": {k: v for k, v in q["jacquant"].items()
                                    if k not in ("shuffle_b", "b_dtype")}}
    assert job.changed_fields(old) == []
    shuffled = JobRecord(kind="qat", qat=parse_qat_spec("int2:g64/jacquant/shuffled").to_dict())
    assert shuffled.changed_fields(old) and "shuffle_b" in shuffled.changed_fields(old)[0]
    bf16_b = JobRecord(kind="qat", qat=parse_qat_spec("int2:g64/jacquant/bf16b").to_dict())
    assert [c.split(":")[0] for c in bf16_b.changed_fields(old)] == ["qat"]
    # saved before B went inside AdamW's step: it ran around the step, and resumes that way only
    older = {**old, "qat": {**old["qat"], "jacquant": {k: v for k, v in old["qat"]["jacquant"].items()
                                                      if k != "b_in_adamw"}}}
    (change,) = job.changed_fields(older)
    assert "'b_in_adamw': False}" in change and "'b_in_adamw': True}" in change
    around = JobRecord(kind="qat", qat=parse_qat_spec("int2:g64/jacquant/around").to_dict())
    assert around.changed_fields(older) == []
    # a run saved before job records: the same settings inside its config
    config = TrainConfig()
    old_config = {**config.to_dict(), "qat": old["qat"], "init_from": "runs/src",
                  "init_fingerprint": "ab" * 32}
    assert TrainConfig.from_dict(old_config) == config and config.changed_fields(old_config) == []
    assert job.changed_fields(JobRecord.of_checkpoint({"config": old_config}).to_dict()) == []
    assert bf16_b.changed_fields(JobRecord.of_checkpoint({"config": old_config}).to_dict())
    plain = {**config.to_dict(), "qat": None, "init_from": None, "init_fingerprint": None}
    assert JobRecord.of_checkpoint({"config": plain}) == JobRecord()
    assert JobRecord.of_checkpoint({"config": config.to_dict()}) == JobRecord()   # older still


def test_a_job_record_refuses_unknown_fields_and_a_kind_that_does_not_fit_in_one_line():
    for make, words in ((lambda: JobRecord.from_dict({"kind": "train", "recipe": "bf16"}),
                         "unknown JobRecord field(s): recipe"),
                        (lambda: JobRecord(kind="rl"), "job kind must be one of train, qat"),
                        (lambda: JobRecord(kind="qat"), "QAT settings exactly when its kind is qat"),
                        (lambda: JobRecord(qat={"weights": "int4"}), "kind 'train' with qat set")):
        with pytest.raises(ValueError, match=re.escape(words)) as e:
            make()
        assert "\n" not in str(e.value)


# --- 10. a QAT run written before job records (job.json) ----------------------------------------

def _as_before_job_records(run):
    """Rewrite a QAT run folder as lowbit wrote it before job records: the job's fields inside
    config.json and every checkpoint's config (after "recipe", where TrainConfig declared them),
    no job.json and no "job" in the checkpoints; its QAT settings without the JacQuant options
    added later, as runs older than those saved them."""
    job = json.loads((run / "job.json").read_text())
    job["qat"]["jacquant"] = {k: v for k, v in job["qat"]["jacquant"].items()
                              if k not in ("shuffle_b", "b_dtype")}

    def old(config):
        out = {}
        for key, value in config.items():
            out[key] = value
            if key == "recipe":
                out.update({k: job[k] for k in OLD_CONFIG_KEYS})
        return out

    (run / "job.json").unlink()
    (run / "config.json").write_text(json.dumps(old(json.loads((run / "config.json").read_text()))))
    for path in (run / "checkpoints").glob("*.pt"):
        state = load_checkpoint(path)
        del state["job"]
        state["config"] = old(state["config"])
        save_checkpoint(state, path)


def _assert_same_export(a, b):
    """The same files; the same tensors, bit for bit, and metadata in the safetensors (whose
    header's key order varies from one write to the next), the same bytes in the others."""
    from safetensors import safe_open

    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir()) and "model.safetensors" in names
    for name in names:
        if not name.endswith(".safetensors"):
            assert (a / name).read_bytes() == (b / name).read_bytes(), name
            continue
        with safe_open(str(a / name), framework="pt") as x, safe_open(str(b / name), framework="pt") as y:
            assert x.metadata() == y.metadata() and sorted(x.keys()) == sorted(y.keys())
            for key in x.keys():   # as bytes: the packed codes, the scales, the BF16 weights
                assert torch.equal(x.get_tensor(key).view(torch.uint8), y.get_tensor(key).view(torch.uint8)), key


def test_a_qat_run_written_before_job_records_opens_exports_and_resumes_exactly(
        tmp_path, capsys, pattern_data):
    source = finished_run(tmp_path, "src", 0)
    qat = [*QAT, "--out-dir", tmp_path / "qat", "--from", source]
    assert cli(capsys, *qat)[0] == 0
    run = tmp_path / "qat" / "q-int4-g32-ste"
    job = JobRecord.from_dict(json.loads((run / "job.json").read_text()))
    assert (job.kind, job.qat["weights"], job.init_from) == ("qat", "int4:g32", str(source))
    assert job.init_fingerprint == qat_run.source_fingerprint(source, RunDir(source).open().state["model"])
    assert not {"qat", "init_from", "init_fingerprint"} & json.loads((run / "config.json").read_text()).keys()
    whole = load_checkpoint(run / "checkpoints" / "latest.pt")
    assert JobRecord.of_checkpoint(whole) == job and whole["step"] == 4
    assert _export(capsys, run, tmp_path / "today")[0] == 0
    _as_before_job_records(run)

    # it opens, its job record read from its config
    saved = RunDir(run).open()
    assert saved.config == TrainConfig.from_dict(whole["config"])
    assert (saved.job.kind, saved.job.init_from, saved.job.init_fingerprint) == (
        "qat", job.init_from, job.init_fingerprint)
    assert job.changed_fields(saved.job.to_dict()) == []
    # it exports as it did, bit for bit
    assert _export(capsys, run, tmp_path / "before")[0] == 0
    _assert_same_export(tmp_path / "today", tmp_path / "before")
    # QAT from it is refused, as from any QAT run
    code, err = cli(capsys, *QAT, "--out-dir", tmp_path / "qat2", "--from", run)
    one_line_error(code, err, f"{run} is a QAT run", f"came from ({source})")

    # it resumes from its step-2 checkpoint to the same step 4, bit for bit
    (step_2,) = (run / "checkpoints").glob("step-*.pt")
    step_2.replace(run / "checkpoints" / "latest.pt")
    (run / "final.json").unlink()
    (run / "quantized.safetensors").unlink()
    code, err = cli(capsys, *qat, "--resume", "--distill-temperature", "2")
    one_line_error(code, err, f"cannot resume {run}: the config differs from the checkpoint's in "
                   f"qat: ", "'distill_temperature': 1.0", f"(see {run / 'config.json'})")
    code, err = cli(capsys, *QAT, "--out-dir", tmp_path / "qat", "--resume",
                    "--from", finished_run(tmp_path, "other", 1))
    one_line_error(code, err, f"cannot resume {run}", "started from other weights", str(source))
    assert cli(capsys, *qat, "--resume")[0] == 0
    resumed = load_checkpoint(run / "checkpoints" / "latest.pt")
    assert resumed["step"] == 4 and resumed["train_losses"] == whole["train_losses"]
    assert resumed["model"].keys() == whole["model"].keys()
    assert all(torch.equal(resumed["model"][k], whole["model"][k]) for k in whole["model"])
    # from then on in today's layout
    assert JobRecord.of_checkpoint(resumed) == job == JobRecord.from_dict(
        json.loads((run / "job.json").read_text()))
    assert TrainConfig.from_dict(resumed["config"]).to_dict() == resumed["config"]
    code, err = cli(capsys, *qat, "--resume", "--distill-temperature", "2")
    one_line_error(code, err, f"cannot resume {run}: the config differs from the checkpoint's in "
                   f"qat: ", f"(see {run / 'job.json'})")
    assert _export(capsys, run, tmp_path / "resumed")[0] == 0
    _assert_same_export(tmp_path / "today", tmp_path / "resumed")
