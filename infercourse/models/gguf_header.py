"""A GGUF file's header, read in milliseconds: its metadata and its tensors' names, shapes and
types, without the vocabulary.

`gguf.GGUFReader` (llama.cpp's own reader) decodes every field eagerly, the tokenizer's
token list included: Gemma 3's 262,144 tokens take it tens of seconds on a busy 2-core
machine, for a lesson that needs two numbers (the architecture and the sliding window).
This reader walks the same layout (GGUF v2/v3: magic, version, tensor and key counts, the
key-value pairs, then the tensor infos) and skips over long arrays instead of decoding them,
so the header of any model costs the same. Written by hand for that reason; the value types
and the block sizes come from the `gguf` package, so the two cannot drift apart. `tensor_data`
maps one tensor's bytes at the offset the header gives (what a lesson reads of the weights),
in the shape gguf-py's reader gives them, so `gguf.quants.dequantize` takes them as they are.
"""
from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

__all__ = ["read_header", "tensor_table", "tensor_data"]

_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# GGUF types stored one number per element; every other type is blocks, read as bytes
_ONE_PER_ELEMENT = {"F32": "<f4", "F16": "<f2", "BF16": "<u2", "F64": "<f8", "I8": "i1", "I16": "<i2", "I32": "<i4",
                    "I64": "<i8"}


class _Cursor:
    def __init__(self, buf: mmap.mmap):
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> Any:
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.unpack("<Q")
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int, keep_array: int) -> Any:
        if vtype in _SCALAR:
            return self.unpack(_SCALAR[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype != _ARRAY:
            raise ValueError(f"unknown GGUF value type {vtype}")
        etype, n = self.unpack("<I"), self.unpack("<Q")
        if n <= keep_array:
            return [self.value(etype, keep_array) for _ in range(n)]
        if etype in _SCALAR:                          # fixed width: jump over it
            self.pos += n * struct.calcsize(_SCALAR[etype])
        else:                                         # strings (or nested arrays): walk the lengths
            for _ in range(n):
                self.value(etype, 0)
        return {"array_of": etype, "length": n}


def read_header(path: str | Path, keep_array: int = 64) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(metadata, tensors) of a GGUF file.

    Args:
        path: the .gguf file.
        keep_array: arrays of up to this many items are decoded; longer ones (a vocabulary)
            are skipped and given as {"array_of": type, "length": n}.

    Returns:
        metadata {key: value}; tensors [{"name", "shape" (innermost first, as GGUF stores it),
        "type" (a `gguf.GGMLQuantizationType` name), "n_elements", "n_bytes", "offset" (of
        its data, from the start of the file)}].
    """
    import gguf
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        c = _Cursor(buf)
        if bytes(buf[:4]) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        c.pos = 4
        version = c.unpack("<I")
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is too old to read")
        n_tensors, n_kv = c.unpack("<Q"), c.unpack("<Q")
        meta: dict[str, Any] = {"GGUF.version": version}
        for _ in range(n_kv):
            key = c.string()
            meta[key] = c.value(c.unpack("<I"), keep_array)
        tensors = []
        for _ in range(n_tensors):
            name = c.string()
            shape = [c.unpack("<Q") for _ in range(c.unpack("<I"))]
            qtype = gguf.GGMLQuantizationType(c.unpack("<I"))
            offset = c.unpack("<Q")                  # into the data section, which starts aligned
            n = 1
            for d in shape:
                n *= d
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            tensors.append({"name": name, "shape": shape, "type": qtype.name, "n_elements": n,
                            "n_bytes": n // block * size, "offset": offset})
        align = int(meta.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT))
        start = -(-c.pos // align) * align
    for t in tensors:
        t["offset"] += start
    return meta, tensors


def tensor_table(path: str | Path) -> dict[str, dict[str, Any]]:
    """{tensor name: its entry in `read_header`} of a GGUF file."""
    return {t["name"]: t for t in read_header(path)[1]}


def tensor_data(path: str | Path, tensor: dict[str, Any]) -> Any:
    """One tensor's data as stored, memory-mapped (read from disk only where it is used), in
    numpy's order (outermost dimension first): its numbers for a type stored one per element
    (F32, F16, BF16 as its raw 16 bits, F64, I8..I64), and for a block type the bytes of each row
    (`gguf.quants.quant_shape_to_byte_shape`), which `gguf.quants.dequantize` reads.

    Args:
        path: the .gguf file.
        tensor: its entry in `read_header(path)[1]` (or `tensor_table(path)[name]`).
    """
    import gguf
    import numpy as np
    shape = tuple(reversed(tensor["shape"]))
    if tensor["type"] in _ONE_PER_ELEMENT:
        return np.memmap(path, np.dtype(_ONE_PER_ELEMENT[tensor["type"]]), "r", tensor["offset"], shape)
    qtype = gguf.GGMLQuantizationType[tensor["type"]]
    return np.memmap(path, np.uint8, "r", tensor["offset"], gguf.quants.quant_shape_to_byte_shape(shape, qtype))
