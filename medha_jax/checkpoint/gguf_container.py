"""The GGUF container (versions 2 and 3): header, typed metadata, tensor infos, data offset.

    gguf = read_gguf(path)
    gguf.fields["general.architecture"]   # 'llama'
    gguf.tensors[0].data                  # numpy memmap view at the tensor's offset

Why not `gguf.GGUFReader`: it builds a numpy view for every element of every metadata array,
~6 s for a tokenizer's ~100k token and merge strings; here each string is one struct read
and one decode. Layout (little-endian; a version whose low 16 bits are zero when read
little-endian marks a big-endian file):

    magic "GGUF" | version u32 | tensor_count u64 | kv_count u64
    kv_count x  (key: string, value_type u32, value)
    tensor_count x  (name: string, n_dims u32, ne[n_dims] u64, ggml_type u32, offset u64)
    padding to general.alignment (default 32) | tensor data (offsets relative to here)

A string is a u64 byte length then UTF-8 bytes; an array is item_type u32, length u64, items.
Dequantization is `gguf_dequant`'s (gguf.quants for the types it does not vectorise).
"""

from __future__ import annotations

import dataclasses
import mmap
import pathlib
import struct
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType
from gguf.constants import GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

from medha_jax.checkpoint.tensors import CheckpointError

SUPPORTED_GGUF_VERSIONS = (2, 3)   # version 1 had 32-bit lengths; 2 and 3 share a layout

# Scalar value types -> struct / numpy format character.
_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
    GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT32: "f", GGUFValueType.FLOAT64: "d",
    GGUFValueType.BOOL: "?",
}

# Unquantized tensor types read as typed elements; every other type as raw bytes per row.
_ELEMENT_DTYPES = {
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclasses.dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor's entry. shape is ggml's ne (innermost first); data is numpy-ordered
    (reversed): [..., cols] of elements for float/int types, [..., bytes per row] of uint8
    for quantized ones, as `gguf.quants.dequantize` takes it."""

    name: str
    shape: tuple[int, ...]
    tensor_type: GGMLQuantizationType
    data_offset: int            # absolute byte offset in the file
    n_bytes: int
    data: np.ndarray = dataclasses.field(repr=False, compare=False)


@dataclasses.dataclass(frozen=True)
class GGUFContainer:
    """A parsed GGUF file. fields: key -> Python value (str, int, float, bool, or a list of
    them); field_types: key -> (value type, item type for arrays else None)."""

    path: pathlib.Path
    version: int
    byte_order: str             # struct prefix: "<" or ">"
    alignment: int
    data_offset: int
    fields: dict[str, Any]
    field_types: dict[str, tuple[GGUFValueType, GGUFValueType | None]]
    tensors: list[GGUFTensorInfo]


def read_gguf(path: str | pathlib.Path) -> GGUFContainer:
    """Parses the file's header, metadata and tensor infos; tensor data stays memory-mapped."""
    path = pathlib.Path(path)
    with open(path, "rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:   # an empty file cannot be mapped
            raise CheckpointError(f"GGUF file {path} is empty") from None
    try:
        return _Parser(path, buf).parse()
    except (struct.error, IndexError):
        raise CheckpointError(f"GGUF file {path} is truncated or corrupt") from None
    finally:
        buf.close()


class _Parser:
    def __init__(self, path: pathlib.Path, buf: mmap.mmap):
        self.path, self.buf, self.offset, self.order = path, buf, 0, "<"

    def parse(self) -> GGUFContainer:
        if len(self.buf) < 24 or self._unpack("I") != GGUF_MAGIC:
            raise CheckpointError(f"{self.path} is not a GGUF file (bad magic)")
        version = self._unpack("I")
        if version & 0xFFFF == 0:   # a big-endian file read little-endian
            self.order, version = ">", struct.unpack(">I", struct.pack("<I", version))[0]
        if version not in SUPPORTED_GGUF_VERSIONS:
            raise CheckpointError(
                f"GGUF file {self.path} has version {version}; supported versions: "
                f"{', '.join(map(str, SUPPORTED_GGUF_VERSIONS))}")
        tensor_count, kv_count = self._unpack("Q"), self._unpack("Q")
        fields: dict[str, Any] = {}
        field_types: dict[str, tuple[GGUFValueType, GGUFValueType | None]] = {}
        for _ in range(kv_count):
            key = self._string("metadata key")
            if key in fields:
                raise CheckpointError(f"GGUF metadata key {key!r} appears twice")
            value_type = self._value_type(key)
            item_type = None
            if value_type == GGUFValueType.ARRAY:
                item_type = self._value_type(key)
                fields[key] = self._array(key, item_type)
            else:
                fields[key] = self._value(key, value_type)
            field_types[key] = (value_type, item_type)
        infos = [self._tensor_info() for _ in range(tensor_count)]
        alignment = fields.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if "general.alignment" in fields and field_types["general.alignment"][0] != (
                GGUFValueType.UINT32):
            raise CheckpointError("GGUF general.alignment must be a uint32")
        if alignment <= 0 or alignment & (alignment - 1):
            raise CheckpointError(f"GGUF general.alignment={alignment} is not a power of two")
        data_offset = -(-self.offset // alignment) * alignment
        return GGUFContainer(
            path=self.path, version=version, byte_order=self.order, alignment=alignment,
            data_offset=data_offset, fields=fields, field_types=field_types,
            tensors=self._tensors(infos, data_offset))

    def _unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(self.order + fmt, self.buf, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def _string(self, what: str) -> str:
        return self._strings(what, 1)[0]

    def _value_type(self, key: str) -> GGUFValueType:
        raw = self._unpack("I")
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise CheckpointError(f"GGUF metadata {key!r} has unknown value type {raw}") from None

    def _value(self, key: str, value_type: GGUFValueType) -> Any:
        if value_type == GGUFValueType.STRING:
            return self._string(f"metadata {key!r}")
        if value_type == GGUFValueType.ARRAY:   # an array of arrays
            return self._array(key, self._value_type(key))
        return self._unpack(_SCALAR_FORMATS[value_type])

    def _array(self, key: str, item_type: GGUFValueType) -> list[Any]:
        length = self._unpack("Q")
        if item_type == GGUFValueType.STRING:
            return self._strings(f"metadata {key!r}", length)
        fmt = _SCALAR_FORMATS.get(item_type)
        if fmt is None:   # nested arrays
            return [self._value(key, item_type) for _ in range(length)]
        # Numbers in one vectorised read: a vocabulary's token types are ~50k of them.
        dtype = np.dtype(self.order + fmt)
        if self.offset + length * dtype.itemsize > len(self.buf):
            raise struct.error(key)
        values = np.frombuffer(self.buf, dtype, count=length, offset=self.offset).tolist()
        self.offset += length * dtype.itemsize
        return values

    def _strings(self, what: str, count: int) -> list[str]:
        """`count` strings in a row, in one loop: the tokenizer's vocabulary and merges
        are ~100k of them (read one call each, they were a quarter of a warm start's
        parse time)."""
        buf, offset, size = self.buf, self.offset, len(self.buf)
        unpack_length = struct.Struct(self.order + "Q").unpack_from
        strings = []
        try:
            for _ in range(count):
                (length,) = unpack_length(buf, offset)
                start, offset = offset + 8, offset + 8 + length
                if offset > size:
                    raise struct.error(what)
                strings.append(buf[start:offset].decode("utf-8"))
        except UnicodeDecodeError as e:
            raise CheckpointError(f"GGUF {what} is not valid UTF-8: {e}") from None
        self.offset = offset
        return strings

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string("tensor name")
        n_dims = self._unpack("I")
        shape = tuple(self._unpack("Q") for _ in range(n_dims))
        return name, shape, self._unpack("I"), self._unpack("Q")

    def _tensors(self, infos, data_offset: int) -> list[GGUFTensorInfo]:
        whole = np.memmap(self.path, mode="r")
        tensors, names = [], set()
        for name, shape, raw_type, relative_offset in infos:
            if name in names:
                raise CheckpointError(f"GGUF tensor {name!r} appears twice")
            names.add(name)
            try:
                tensor_type = GGMLQuantizationType(raw_type)
            except ValueError:
                raise CheckpointError(
                    f"GGUF tensor {name!r} has unknown ggml type {raw_type}") from None
            block_size, type_size = GGML_QUANT_SIZES[tensor_type]
            n_elements = int(np.prod(shape, dtype=np.int64))
            n_bytes = n_elements * type_size // block_size
            start = data_offset + relative_offset
            if start + n_bytes > len(whole):
                raise CheckpointError(
                    f"GGUF tensor {name!r} ends at byte {start + n_bytes}, past the end of "
                    f"{self.path} ({len(whole)} bytes)")
            np_shape = tuple(reversed(shape))
            dtype = _ELEMENT_DTYPES.get(tensor_type)
            raw = whole[start:start + n_bytes]
            if dtype is None:
                data = raw.reshape(quant_shape_to_byte_shape(np_shape, tensor_type))
            else:
                data = raw.view(np.dtype(dtype).newbyteorder(self.order)).reshape(np_shape)
            tensors.append(GGUFTensorInfo(name, shape, tensor_type, start, n_bytes, data))
        return tensors


def container_from_reader(reader) -> GGUFContainer:
    """The same container from a `gguf.GGUFReader` someone already opened (tests do)."""
    fields = {key: field.contents() for key, field in reader.fields.items()
              if not key.startswith("GGUF.")}
    field_types = {key: (field.types[0], field.types[-1] if len(field.types) > 1 else None)
                   for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    tensors = [GGUFTensorInfo(t.name, tuple(int(n) for n in t.shape), t.tensor_type,
                              int(t.data_offset), int(t.n_bytes), t.data)
               for t in reader.tensors]
    return GGUFContainer(
        path=pathlib.Path(reader.data.filename),
        version=int(reader.fields["GGUF.version"].parts[0][0]),
        byte_order="<" if reader.endianess.name == "LITTLE" else ">",
        alignment=int(reader.alignment), data_offset=int(reader.data_offset),
        fields=fields, field_types=field_types, tensors=tensors)
