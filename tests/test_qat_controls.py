"""JacQuant's controls and what they need (docs/qat.md): the code-flip fraction in QAT's
records, the shuffled-B control, and an arm's own learning rate in `lowbit qat --compare`."""

import json

import pytest
import torch
import torch.nn as nn

from lowbit.qat import (CodeFlips, JacQuantConfig, QATConfig, fake_quantizers, parse_compare_arm,
                        parse_qat_spec, prepare, refresh, refresh_hook)


def _layer(estimator: str = "ste", **jq) -> tuple[nn.Linear, QATConfig]:
    torch.manual_seed(0)
    layer = nn.Linear(64, 4, bias=False)
    config = QATConfig(weights="int4:g32", estimator=estimator, jacquant=JacQuantConfig(**jq))
    prepare(layer, config)
    return layer, config


@pytest.mark.parametrize("estimator", ["ste", "lsq", "jacquant"])
def test_code_flips_are_zero_without_a_code_change_and_one_over_n_for_one_weight(estimator):
    layer, config = _layer(estimator)
    latent = layer.parametrizations.weight.original
    (_, _, _, fq), = fake_quantizers(layer)
    step = float(fq.scales.detach()[0, 0])
    with torch.no_grad():
        latent[0, 0] = 0.3 * step                # code 0 of int4's -7..7, 0.2 steps from a boundary
    hook = refresh_hook(layer, config, seed=0, record_every=1)
    hook.attach(torch.optim.SGD(layer.parameters(), lr=0.0))   # B on the update: never steps here
    with torch.no_grad():                       # a change far smaller than that keeps every code
        latent.add_(1e-4 * step * torch.sign(latent))
    record = hook(1)
    assert record["event"] == ("jacquant" if estimator == "jacquant" else "qat")   # a refit at step 1
    assert record["qat/code_flips"] == 0 and record["qat/layer/weight/code_flips"] == 0
    with torch.no_grad():
        latent[0, 0] = 0.7 * step                # across the boundary at 0.5: code 1
    record = hook(2)
    assert record["qat/code_flips"] == 1 / latent.numel()
    assert record["qat/layer/weight/code_flips"] == 1 / latent.numel()
    assert hook(3)["qat/code_flips"] == 0       # since the previous record, not since the start


def test_code_flips_count_over_all_weights_and_skip_a_resumed_runs_first_record():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 8, bias=False), nn.Linear(8, 32, bias=False))
    config = QATConfig(weights="int2:g8", estimator="ste")
    prepare(net, config)
    flips = CodeFlips(net)
    with torch.no_grad():
        net[0].parametrizations.weight.original.mul_(-1)   # every nonzero code of layer 0 flips
    record = flips.since_last(1)
    changed = record["qat/layer/0.weight/code_flips"]
    assert 0 < changed <= 1 and record["qat/layer/1.weight/code_flips"] == 0
    assert record["qat/code_flips"] == pytest.approx(changed * 256 / 512)
    resumed = CodeFlips(net)
    resumed.stepped(41)                       # the first step a resumed run takes
    assert resumed.since_last(50)["qat/code_flips"] == 0
    assert CodeFlips(net).since_last(50) == {}   # first call past step 1: no baseline


def test_code_flips_hold_packed_codes_and_count_what_the_codes_say():
    # int2 holds four codes a byte (its groups are a multiple of 4 wide, so no partial byte)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 8, bias=False))
    prepare(net, QATConfig(weights="int2:g8", estimator="ste"))
    (_, _, _, fq), = fake_quantizers(net)
    latent = net[0].parametrizations.weight.original
    flips = CodeFlips(net)
    held, = flips.previous
    assert held.codes.dtype == torch.uint8 and held.codes.numel() == 8 * 32 // 4
    before = fq.codes(latent)
    with torch.no_grad():
        latent.add_(0.05 * torch.randn_like(latent))
    expected = (fq.codes(latent) != before).sum().item() / latent.numel()
    assert 0 < expected < 1
    assert flips.since_last(1)["qat/code_flips"] == expected


def test_shuffled_b_is_a_per_tensor_permutation_of_the_unshuffled_b_and_resume_exact():
    torch.manual_seed(0)
    plain, _ = _layer("jacquant", refresh_every=1)
    shuffled, config = _layer("jacquant", refresh_every=1, shuffle_b=True)
    assert config == parse_qat_spec("int4:g32/jacquant/k1/shuffled")
    for step in (1, 2):
        refresh(plain, seed=3, step=step)
        refresh(shuffled, seed=3, step=step)
        (_, _, _, p), = fake_quantizers(plain)
        (_, _, _, s), = fake_quantizers(shuffled)
        assert torch.equal(s.b_unshuffled, p.b)               # the same fit, draw for draw
        assert torch.equal(s.b.flatten().sort().values, p.b.flatten().sort().values)
        assert not torch.equal(s.b, p.b)
    again, _ = _layer("jacquant", refresh_every=1, shuffle_b=True)
    again.load_state_dict(shuffled.state_dict())   # a resumed run draws the same permutation
    refresh(again, seed=3, step=3)
    refresh(shuffled, seed=3, step=3)
    assert torch.equal(fake_quantizers(again)[0][3].b, fake_quantizers(shuffled)[0][3].b)


def test_compare_arms_parse_options_and_a_learning_rate_multiplier():
    base = QATConfig(weights="int2:g64", estimator="ste", scale_init="mse")
    config, multiplier = parse_compare_arm("ste/lrx1.5", base)
    assert (config.estimator, config.scale_init, multiplier) == ("ste", "mse", 1.5)
    config, multiplier = parse_compare_arm("jacquant/shuffled/k10", base)
    assert config.jacquant.shuffle_b and config.jacquant.refresh_every == 10 and multiplier == 1
    for bad, words in [("ste/lrx", "lrxM"), ("ste/lrx-1", "lrxM"), ("ste@lr1.5", "unknown estimator"),
                       ("ste/shuffled", "ste does not use")]:
        with pytest.raises(ValueError, match=words) as e:
            parse_compare_arm(bad, base)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="arm option of lowbit qat --compare"):
        parse_qat_spec("int2:g64/ste/lrx1.5")


def test_two_arms_of_one_comparison_train_at_their_own_learning_rates(tmp_path, capsys, corpus_env):
    from lowbit.cli import main

    assert main(["qat", "--compare", "ste,ste/lrx2,jacquant/shuffled", "--steps", "3",
                 "--base-steps", "4", "--eval-every", "3", "--refresh-every", "2", "--lr", "1e-3",
                 "--no-baselines", "--out-dir", str(tmp_path), "--no-progress", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "| ste+lrx2 |" in out and "| jacquant+shuffled |" in out
    lrs = {run.name.rsplit("-", 1)[-1]: json.loads((run / "config.json").read_text())["lr"]
           for run in tmp_path.glob("qat-*-int2*") if not run.name.endswith("-summary")}
    assert lrs == {"ste": 1e-3, "ste+lrx2": 2e-3, "jacquant+shuffled": 1e-3}
    (run,) = tmp_path.glob("qat-*-jacquant+shuffled")
    assert json.loads((run / "job.json").read_text())["qat"]["jacquant"]["shuffle_b"] is True
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    flips = [(r["event"], r["step"]) for r in records if "qat/code_flips" in r]
    assert flips == [("jacquant", 1), ("jacquant", 3)]   # each refit record (K = 2) holds them
    code = main(["qat", "--compare", "ste,ste@lr1.5", "--steps", "3", "--base-steps", "4",
                 "--no-baselines", "--out-dir", str(tmp_path), "--no-progress", "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and "unknown estimator 'ste@lr1.5' in --compare" in err
    assert len(err.strip().splitlines()) == 1


def test_a_qat_runs_start_line_names_its_weights_not_bf16():
    from lowbit.train import JobRecord, TrainConfig
    from lowbit.train.loop import describe_numerics

    qat = JobRecord(kind="qat", qat={"weights": "int2:g64", "estimator": "jacquant"})
    assert describe_numerics(TrainConfig(), qat) == "QAT int2:g64 with jacquant"
    assert describe_numerics(TrainConfig(recipe="nvfp4"), JobRecord()) == "recipe nvfp4"


def test_lowbit_qat_notes_mse_scales_at_two_and_three_bits(monkeypatch, capsys):
    # the default stays absmax (documented commands keep their meaning); at 2-3 integer bits the
    # command says mse usually starts closer, once, unless --scale-init is given (progress bars
    # or not: --no-progress turns off bars, not advice)
    import lowbit.qat.cli_args as qat_cli
    from lowbit.cli import build_parser

    monkeypatch.setattr(qat_cli, "run_qat", lambda job: {"stopped": "stub"})
    for flags, noted in ((["--weights", "int2:g64"], True), (["--weights", "int3:g64:asym"], True),
                         (["--weights", "int2:g64", "--scale-init", "mse"], False),
                         (["--weights", "int2:g64", "--scale-init", "absmax"], False),
                         (["--weights", "int4:g128"], False),
                         (["--weights", "int2:g64", "--no-progress"], True)):
        qat_cli.run_qat_command(build_parser().parse_args(["qat", *flags]))
        err = capsys.readouterr().err
        assert ("--scale-init mse usually starts closer" in err) == noted, (flags, err)
