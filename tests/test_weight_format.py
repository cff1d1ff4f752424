"""One grammar for a weight format (lowbit.formats.weight_format): what it parses to, that
`str` writes it back, the QuantSpec it means, and how QAT, export and inspect each keep the
part they support, refusing the rest in one line."""

import pytest

from lowbit.diagnostics.inspect import InspectError, parse_format
from lowbit.export.layouts import parse_export_format
from lowbit.formats import QuantSpec, WeightFormat, parse_weight_format
from lowbit.qat import qat_weight_format

# text -> (canonical str, the QuantSpec for a weight of 256 inputs)
CASES = {
    "int2:g64": ("int2:g64", QuantSpec.make("int2", block=(1, 64))),
    "INT4": ("int4:g128", QuantSpec.make("int4")),
    "int4:1x64": ("int4:g64", QuantSpec.make("int4", block=(1, 64))),
    "int4:row:asym": ("int4:row:asym", QuantSpec.make("int4_asym", block=(1, 256))),
    "int4_asym:g32": ("int4:g32:asym", QuantSpec.make("int4_asym", block=(1, 32))),
    "ternary": ("ternary:g128", QuantSpec.make("ternary")),
    "seq2:g64": ("seq2:g64", QuantSpec.make("seq2", block=(1, 64))),
    "nvfp4": ("nvfp4", QuantSpec.make("nvfp4")),
    "nvfp4:16x16:single": ("nvfp4:16x16:single",
                           QuantSpec.make("nvfp4", block=(16, 16), tensor_scale=False)),
    "mxfp4:floor": ("mxfp4", QuantSpec.make("mxfp4")),
    "mxfp4:rceil:32x32:sr": ("mxfp4:32x32:rceil:sr", QuantSpec.make(
        "mxfp4", block=(32, 32), scale_rule="rceil", rounding="stochastic")),
    "mxfp8_e4m3": ("mxfp8_e4m3", QuantSpec.make("mxfp8_e4m3")),
}


@pytest.mark.parametrize("text", CASES)
def test_a_format_parses_to_its_spec_and_writes_back_to_itself(text):
    canonical, spec = CASES[text]
    fmt = parse_weight_format(text)
    assert str(fmt) == canonical
    assert parse_weight_format(str(fmt)) == fmt
    assert fmt.spec(256) == spec


def test_the_properties_the_jobs_read():
    fmt = parse_weight_format("int3:g32:asym")
    assert (fmt.grid, fmt.bits, fmt.group, fmt.asym, fmt.format_name) == ("int", 3, 32, True,
                                                                          "int3_asym")
    assert parse_weight_format("int8:row").group is None
    assert parse_weight_format("nvfp4").data_scaled and parse_weight_format("mxfp4").data_scaled
    assert not parse_weight_format("ternary").data_scaled
    assert parse_weight_format("bf16") == WeightFormat("bf16")
    with pytest.raises(ValueError, match="does not divide layers.0.q's 100 inputs"):
        parse_weight_format("int2:g64").check_layer("layers.0.q", 100)
    with pytest.raises(ValueError, match="need the weight's in_features"):
        parse_weight_format("int4:row").spec()


@pytest.mark.parametrize("bad, says", [
    ("fp3", "unknown format 'fp3'"), ("int5", "unknown format 'int5'"),
    ("int4:g64:row", "names its blocks twice"), ("ternary:asym", "applies to intK only"),
    ("nvfp4:rceil", "scale_rule applies to MX formats only"), ("mxfp4:single", "tensor_scale applies to nvfp4 only"),
    ("int4:g0", "is empty"), ("int4:fast", "unknown option 'fast'"), ("bf16:g64", "no options"),
    ("nvfp4:16x32", "weight format 'nvfp4:16x32'"),
])
def test_a_malformed_format_is_one_line(bad, says):
    with pytest.raises(ValueError, match=says) as e:
        parse_weight_format(bad)
    assert "\n" not in str(e.value)


def test_each_job_keeps_what_it_supports():
    # QAT: 1 x G or row blocks, asym; nvfp4 / mxfp4 plain; bf16 as its control
    assert qat_weight_format("int2:g64:asym") == parse_weight_format("int2:g64:asym")
    assert qat_weight_format("bf16").grid == "bf16"
    for bad, says in [("int4:16x16", "QAT takes no `16x16`"), ("int4:g64:sr", "no `sr`"),
                      ("nvfp4:g32", "write plain 'nvfp4'"), ("int2:g12", "multiple of 8"),
                      ("mxfp8_e4m3", "QAT takes no mxfp8_e4m3")]:
        with pytest.raises(ValueError, match=says):
            qat_weight_format(bad)
    # export: the layouts servers read, with their defaults for int4 and int8
    assert parse_export_format("int4").group == 128 and parse_export_format("int8").group is None
    assert str(parse_export_format("int4:asym")) == "int4:g128:asym"
    for bad, says in [("int2:g64", "no serving layout"), ("nvfp4:16x16", "write plain --format"),
                      ("int4:16x16", "takes no `16x16`"), ("ternary", "no serving layout"),
                      ("mxfp8_e4m3", "unknown --format"),
                      ("mxfp4:rceil", "write --format mxfp4 --scale-rule rceil")]:
        with pytest.raises(ValueError, match=says):
            parse_export_format(bad)
    # inspect: everything quantized, under its own error type
    assert parse_format("int4:row")[1].row
    with pytest.raises(InspectError, match="bf16 is no quantization"):
        parse_format("bf16")
