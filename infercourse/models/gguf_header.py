"""A GGUF file's header, read in milliseconds: its metadata and its tensors' names, shapes and
types, without the vocabulary.

`gguf.GGUFReader` (llama.cpp's own reader) decodes every field eagerly, the tokenizer's
token list included: Gemma 3's 262,144 tokens take it tens of seconds on a busy 2-core
machine, for a lesson that needs two numbers (the architecture and the sliding window).
This reader walks the same layout (GGUF v2/v3: magic, version, tensor and key counts, the
key-value pairs, then the tensor infos) and skips over long arrays instead of decoding them,
so the header of any model costs the same. Written by hand for that reason; the value types
and the block sizes come from the `gguf` package, so the two cannot drift apart.
"""
from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

__all__ = ["read_header"]

_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


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
