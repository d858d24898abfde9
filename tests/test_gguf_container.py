"""Our GGUF container parser against the gguf package's GGUFReader on the same files."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.constants import GGUFEndian, GGUFValueType
from gguf.quants import quantize

from medha_jax.checkpoint import CheckpointError, default_model_path
from medha_jax.checkpoint.gguf_container import container_from_reader, read_gguf


def write_every_value_type(path, alignment=None, endianess=GGUFEndian.LITTLE):
    """A GGUF with a key of each value type, arrays of numbers, bools and strings (with
    multi-byte UTF-8), and float and quantized tensors."""
    writer = GGUFWriter(str(path), "llama", endianess=endianess)
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_uint8("k.u8", 200)
    writer.add_int8("k.i8", -100)
    writer.add_uint16("k.u16", 60000)
    writer.add_int16("k.i16", -30000)
    writer.add_uint32("k.u32", 4_000_000_000)
    writer.add_int32("k.i32", -2_000_000_000)
    writer.add_uint64("k.u64", 2**63 + 5)
    writer.add_int64("k.i64", -(2**62))
    writer.add_float32("k.f32", 0.1)
    writer.add_float64("k.f64", 0.1)
    writer.add_bool("k.bool", True)
    writer.add_string("k.str", "héllo ∑ 🙂")
    writer.add_string("k.empty", "")
    writer.add_array("k.strs", ["a", "", "Ġthe", "∑🙂", "b c"] * 50)
    writer.add_array("k.ints", list(range(-3, 300)))
    writer.add_array("k.floats", [0.5, -1.25, 3.0])
    writer.add_array("k.bools", [True, False, True])
    writer.add_array("k.none", [])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((7,)).astype(np.float16))
    writer.add_tensor("i32", np.arange(6, dtype=np.int32).reshape(2, 3))
    for qtype in (GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0):
        rows = rng.standard_normal((4, 64)).astype(np.float32)
        writer.add_tensor(qtype.name.lower(), quantize(rows, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def assert_same_as_gguf_reader(path):
    ours, theirs = read_gguf(path), container_from_reader(GGUFReader(path, "r"))
    assert ours.version == theirs.version
    assert (ours.alignment, ours.data_offset) == (theirs.alignment, theirs.data_offset)
    assert list(ours.fields) == list(theirs.fields)
    for key in theirs.fields:
        assert ours.field_types[key] == theirs.field_types[key], key
        assert type(ours.fields[key]) is type(theirs.fields[key]), key
        assert ours.fields[key] == theirs.fields[key], key
    assert ours.tensors == theirs.tensors   # names, shapes, types, offsets, sizes
    for mine, reference in zip(ours.tensors, theirs.tensors):
        assert mine.data.dtype == reference.data.dtype and mine.data.shape == reference.data.shape
        np.testing.assert_array_equal(mine.data, reference.data)
    return ours


@pytest.mark.parametrize("alignment", [None, 64])
@pytest.mark.parametrize("endianess", [GGUFEndian.LITTLE, GGUFEndian.BIG])
def test_every_value_type_and_tensor_equals_gguf_reader(tmp_path, alignment, endianess):
    ours = assert_same_as_gguf_reader(
        write_every_value_type(tmp_path / "m.gguf", alignment, endianess))
    assert ours.byte_order == ("<" if endianess == GGUFEndian.LITTLE else ">")
    assert ours.alignment == (alignment or 32) and ours.data_offset % ours.alignment == 0
    assert ours.fields["k.str"] == "héllo ∑ 🙂" and ours.fields["k.u64"] == 2**63 + 5
    assert ours.field_types["k.strs"] == (GGUFValueType.ARRAY, GGUFValueType.STRING)
    assert ours.fields["k.bools"] == [True, False, True]


def test_smollm2_file_equals_gguf_reader():
    ours = assert_same_as_gguf_reader(default_model_path())
    assert len(ours.fields["tokenizer.ggml.tokens"]) == 49152
    assert {t.tensor_type for t in ours.tensors} >= {GGMLQuantizationType.Q4_1}


@pytest.mark.parametrize("version", [1, 4])
def test_other_versions_are_refused(tmp_path, version):
    data = bytearray(write_every_value_type(tmp_path / "m.gguf").read_bytes())
    data[4:8] = version.to_bytes(4, "little")
    (tmp_path / "v.gguf").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"version {version}; supported versions: 2, 3"):
        read_gguf(tmp_path / "v.gguf")


@pytest.mark.parametrize("cut", [3, 30, 200])
def test_truncated_or_foreign_files_are_refused(tmp_path, cut):
    data = write_every_value_type(tmp_path / "m.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:cut])
    with pytest.raises(CheckpointError, match="not a GGUF file|truncated"):
        read_gguf(tmp_path / "cut.gguf")


def test_a_tensor_past_the_end_of_the_file_names_the_tensor(tmp_path):
    path = write_every_value_type(tmp_path / "m.gguf")
    last = read_gguf(path).tensors[-1]
    (tmp_path / "cut.gguf").write_bytes(path.read_bytes()[:last.data_offset + last.n_bytes - 1])
    with pytest.raises(CheckpointError, match="'q8_0' ends at byte"):
        read_gguf(tmp_path / "cut.gguf")


def test_a_string_array_cut_short_or_not_utf8_is_refused(tmp_path):
    """The vocabulary-sized string arrays are read in one loop (`_Parser._strings`): a
    file ending inside one, or a string in one that is not UTF-8, is refused by name."""
    data = write_every_value_type(tmp_path / "m.gguf").read_bytes()
    inside = data.index("∑🙂".encode()) + 2          # in a string of k.strs
    (tmp_path / "cut.gguf").write_bytes(data[:inside])
    with pytest.raises(CheckpointError, match="truncated"):
        read_gguf(tmp_path / "cut.gguf")
    (tmp_path / "bad.gguf").write_bytes(data[:inside - 2] + b"\xff" + data[inside - 1:])
    with pytest.raises(CheckpointError, match="metadata 'k.strs' is not valid UTF-8"):
        read_gguf(tmp_path / "bad.gguf")
