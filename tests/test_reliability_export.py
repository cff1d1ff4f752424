"""What `lowbit export`, its readers and the QTensor file guarantee about the files they touch:
an export never writes over its own source, never writes through a symlink, leaves
no stale index or shard and no partial file, writes files a server running as another user can
read, and a loader never reads outside the model folder or trusts metadata its tensors belie."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from hf_models import save_hf_model
from lowbit.cli import main
from lowbit.export import export_model, load_exported
from lowbit.formats import FORMATS, load_qtensors, quantize, save_qtensors
from lowbit.models import load_model
from lowbit.models.hf import ModelLoadError

FULL_DISK = "Error while serializing: I/O error: No space left on device (os error 28)"


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    return save_hf_model("llama", tmp_path_factory.mktemp("llama"), dtype=torch.bfloat16)


@pytest.fixture
def source(hf_folder, tmp_path):
    """A copy of the tiny model folder that a test may see damaged."""
    return shutil.copytree(hf_folder, tmp_path / "model")


def _export(source, out, *extra):
    return main(["export", str(source), "--out", str(out), "--no-progress", *extra])


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("lowbit: error: ") and err.strip().count("\n") == 0, err
    return err


def _tree(folder) -> dict:
    """Every entry under `folder`: a link's target, a file's bytes and mode."""
    out = {}
    for path in sorted(folder.rglob("*")):
        if path.is_symlink():
            out[str(path)] = ("link", os.readlink(path))
        elif path.is_file():
            out[str(path)] = (path.read_bytes(), path.stat().st_mode)
        else:
            out[str(path)] = "dir"
    return out


def _weights(path):
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


# --- 1. an --out that is, holds or lies inside the source --------------------------------------

@pytest.mark.parametrize("case", ["same", "inside", "holds", "symlink", "run-folder"])
def test_export_refuses_an_out_that_is_holds_or_lies_inside_its_source(source, tmp_path, capsys,
                                                                       case):
    if case == "run-folder":   # refused before the run is read: any run folder will do
        source = tmp_path / "run"
        (source / "checkpoints").mkdir(parents=True)
        (source / "checkpoints" / "latest.pt").write_bytes(b"a checkpoint")
        (source / "config.json").write_text("{}\n")
    out = {"same": source, "inside": source / "exported", "holds": tmp_path,
           "symlink": tmp_path / "link", "run-folder": source}[case]
    if case == "symlink":
        out.symlink_to(source, target_is_directory=True)
    before = _tree(tmp_path)
    assert _export(source, out, "--overwrite") == 2
    err = _one_line(capsys)
    assert f"--out {out}" in err and "would write over what it reads" in err
    assert f"choose an --out outside {source}" in err
    assert _tree(tmp_path) == before


# --- 2. symlinks are replaced, never written through -------------------------------------------

def test_export_overwrite_replaces_symlinked_files_instead_of_writing_through_them(source,
                                                                                   tmp_path):
    # a Hugging Face cache snapshot: every file a link into blobs/
    blobs, out = tmp_path / "blobs", tmp_path / "snapshot"
    blobs.mkdir()
    out.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (blobs / name).write_bytes(f"the blob of {name}".encode())
        (out / name).symlink_to(blobs / name)
    blobs_before = _tree(blobs)
    assert _export(source, out, "--overwrite") == 0
    assert _tree(blobs) == blobs_before
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert not (out / name).is_symlink()
    assert json.loads((out / "config.json").read_text())["quantization_config"]
    assert load_exported(out).weights


# --- 3. shard names stay inside the model folder -----------------------------------------------

@pytest.mark.parametrize("where", ["parent", "absolute"])
def test_shard_names_outside_the_folder_are_refused_by_every_loader(source, tmp_path, capsys,
                                                                    where):
    def point_outside(folder):
        # the weights moved out, the index naming them there: without the check this loads
        elsewhere = tmp_path / f"elsewhere-{folder.name}"
        elsewhere.mkdir()
        shutil.move(folder / "model.safetensors", elsewhere / "model.safetensors")
        shard = ("../" + elsewhere.name + "/model.safetensors" if where == "parent"
                 else str(elsewhere / "model.safetensors"))
        keys = _weights(elsewhere / "model.safetensors")
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {k: shard for k in keys}}))
        return shard

    exported = tmp_path / "exported"
    assert _export(source, exported) == 0
    capsys.readouterr()
    shard = point_outside(source)
    with pytest.raises(ModelLoadError, match="weight_map entry .* names shard") as e:
        load_model(source)
    assert repr(shard) in str(e.value)
    assert _export(source, tmp_path / "again") == 2
    assert "outside the model folder" in _one_line(capsys)
    assert not (tmp_path / "again").exists()

    shard = point_outside(exported)
    with pytest.raises(ModelLoadError, match="weight_map entry .* names shard") as e:
        load_exported(exported)
    assert repr(shard) in str(e.value)


# --- 4. an overwrite leaves nothing of the previous export -------------------------------------

def test_overwrite_removes_what_a_previous_export_wrote_and_keeps_other_files(hf_folder,
                                                                              tmp_path):
    model = load_model(hf_folder, dtype=torch.float32)[0]
    out, fresh = tmp_path / "out", tmp_path / "fresh"
    export_model(model, out, max_shard_bytes=20_000, tokenizer_dir=hf_folder, progress=False)
    old_shards = sorted(p.name for p in out.glob("model-*-of-*.safetensors"))
    assert len(old_shards) > 1 and (out / "model.safetensors.index.json").is_file()
    (out / "merges.txt").write_text("a stale tokenizer file of a previous export\n")
    (out / ".model.safetensors.4242.0badcafe.tmp").write_bytes(b"a killed export's temp file")
    (out / "notes.txt").write_text("the user's own file\n")
    (out / "extra").mkdir()

    assert _export(hf_folder, out, "--overwrite") == 0
    assert _export(hf_folder, fresh) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [p.name for p in fresh.iterdir()] + ["notes.txt", "extra"])
    new, clean = _weights(out / "model.safetensors"), _weights(fresh / "model.safetensors")
    assert new.keys() == clean.keys() and all(torch.equal(new[k], clean[k]) for k in new)
    assert set(load_exported(out).weights) == set(load_exported(fresh).weights)


def test_export_refuses_a_foreign_safetensors_file_in_out_and_touches_nothing(source, tmp_path,
                                                                               capsys):
    out = tmp_path / "out"
    assert _export(source, out) == 0
    save_qtensors(out / "quantized.safetensors", {"w": quantize(torch.randn(8, 32), "nvfp4")})
    capsys.readouterr()
    before = _tree(out)
    assert _export(source, out, "--overwrite") == 2
    err = _one_line(capsys)
    assert "quantized.safetensors" in err and "move it out of" in err
    assert _tree(out) == before
    with pytest.raises(ValueError, match="quantized.safetensors"):   # the library refuses too
        export_model(load_model(source, dtype=torch.float32)[0], out, progress=False)
    assert _tree(out) == before


# --- 5. the usual file mode --------------------------------------------------------------------

@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_exported_files_and_qtensor_files_get_the_umasks_mode(source, tmp_path, umask):
    old = os.umask(umask)
    try:
        assert _export(source, tmp_path / "out") == 0
        save_qtensors(tmp_path / "q.safetensors", {"w": quantize(torch.randn(8, 32), "nvfp4")})
    finally:
        os.umask(old)
    files = [*(tmp_path / "out").iterdir(), tmp_path / "q.safetensors"]
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in files} == {
        p.name: oct(0o666 & ~umask) for p in files}


# --- 6. save_qtensors' temporary file ----------------------------------------------------------

def test_save_qtensors_uses_a_unique_temp_name_and_removes_it_on_failure(tmp_path, monkeypatch):
    path = tmp_path / "quantized.safetensors"
    mine = tmp_path / "quantized.safetensors.tmp"
    mine.write_text("a user's file that happens to have the old fixed temp name\n")
    tensors = {"w": quantize(torch.randn(8, 32), "nvfp4")}
    save_qtensors(path, tensors)
    assert mine.read_text().startswith("a user's file")
    before = _tree(tmp_path)

    def fails_half_way(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\0" * 100)
        raise RuntimeError("killed half way")

    monkeypatch.setattr("safetensors.torch.save_file", fails_half_way)
    # any failure of the write is an OSError naming the file (lowbit.files), the cause kept
    with pytest.raises(OSError, match="killed half way") as failed:
        save_qtensors(path, {"w": quantize(torch.randn(8, 32), "int4")})
    assert failed.value.filename == str(path)
    assert _tree(tmp_path) == before
    assert load_qtensors(path)["w"].format == "nvfp4"


# --- 7. metadata that disagrees with the stored tensors -----------------------------------------

def _relabel(path, name, change):
    """Rewrite `name`'s metadata in a QTensor file, its tensors as they are."""
    with safe_open(str(path), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    info = json.loads(meta[f"lowbit.{name}"])
    change(info)
    meta[f"lowbit.{name}"] = json.dumps(info)
    save_file(tensors, str(path), metadata=meta)


@pytest.mark.parametrize("format, change, part", [
    ("nvfp4", lambda i: i.update(shape=[64, 32]), "codes"),
    ("int4", lambda i: i.update(shape=[16, 64]), "codes"),
    ("nvfp4", lambda i: i["spec"].update(format="mxfp4", scale_rule="floor", tensor_scale=False),
     "scales"),
    ("int4", lambda i: i["spec"].update(format="int8"), "codes"),
    ("mxfp4", lambda i: i["spec"].update(format="mxfp8_e4m3"), "codes"),
    ("int4", lambda i: i["spec"].update(block=[1, 32]), "codes"),
    ("nvfp4", lambda i: i["spec"].update(tensor_scale=False), "tensor_scale"),
])
def test_load_qtensors_refuses_metadata_that_disagrees_with_the_stored_tensors(tmp_path, format,
                                                                               change, part):
    path = tmp_path / "q.safetensors"
    save_qtensors(path, {"layer.weight": quantize(torch.randn(32, 64), format),
                         "other": quantize(torch.randn(16, 32), format)})
    _relabel(path, "layer.weight", change)
    with pytest.raises(ValueError, match=rf"layer\.weight\.{part} ") as e:
        load_qtensors(path)
    assert str(path) in str(e.value)


def test_load_qtensors_still_reads_every_format_and_layout_it_writes(tmp_path):
    tensors = {}
    for format in FORMATS:
        for shape in [(40,), (33, 70), (2, 17, 48)]:
            tensors[f"{format}.{len(shape)}"] = quantize(torch.randn(shape), format)
        tensors[f"{format}.tiles"] = quantize(torch.randn(33, 70), format, block=(32, 32))
    tensors["nvfp4.single"] = quantize(torch.randn(5, 32), "nvfp4", tensor_scale=False)
    save_qtensors(tmp_path / "all.safetensors", tensors)
    loaded = load_qtensors(tmp_path / "all.safetensors")
    for name, q in tensors.items():
        assert torch.equal(loaded[name].dequantize().nan_to_num(), q.dequantize().nan_to_num()), name


# --- 8. a full disk ------------------------------------------------------------------------------

def _full_disk(tensors, filename, metadata=None):
    with open(filename, "wb") as f:
        f.write(b"\0" * 100)
    raise SafetensorError(FULL_DISK)   # what safetensors raises when a write fails


def test_a_full_disk_during_export_is_one_line_naming_the_file_and_keeps_the_old_one(
        source, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    assert _export(source, out) == 0
    capsys.readouterr()
    before = _tree(out)
    monkeypatch.setattr("safetensors.torch.save_file", _full_disk)
    assert _export(source, out, "--overwrite") == 2
    err = _one_line(capsys)
    assert f"{out / 'model.safetensors'}: no space left on device; free space" in err
    assert _tree(out) == before


def test_a_full_disk_while_saving_qtensors_is_an_oserror_naming_the_file(tmp_path, monkeypatch):
    path = tmp_path / "quantized.safetensors"
    monkeypatch.setattr("safetensors.torch.save_file", _full_disk)
    with pytest.raises(OSError) as e:
        save_qtensors(path, {"w": quantize(torch.randn(8, 32), "nvfp4")})
    assert e.value.errno == 28 and e.value.filename == str(path)
    assert list(tmp_path.iterdir()) == []


def test_a_real_failed_write_of_quantized_safetensors_is_an_oserror_naming_the_file(tmp_path):
    # safetensors' own error, for real: a file-size limit makes its write fail (EFBIG)
    script = textwrap.dedent(f"""
        import resource, signal, torch
        from lowbit.formats import quantize, save_qtensors
        tensors = {{"w": quantize(torch.randn(256, 256), "int8")}}
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        try:
            save_qtensors({str(tmp_path / "q.safetensors")!r}, tensors)
        except OSError as e:
            print(e.errno, e.filename)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.stdout.split() == ["27", str(tmp_path / "q.safetensors")], done.stderr
    assert list(tmp_path.iterdir()) == []
