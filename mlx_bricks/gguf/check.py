"""Check a GGUF file's structure before ``gguf.GGUFReader`` reads it, so that a damaged file gives
one sentence saying what is wrong (truncated where, which field or tensor is corrupt) instead of
numpy's text from deep inside the reader.

GGUF layout (llama.cpp's ``docs/gguf.md``; versions 2 and 3, little-endian):

    header       magic "GGUF", uint32 version, uint64 tensor count, uint64 metadata count
    metadata     per entry: string key, uint32 value type, value
                 (string = uint64 length + UTF-8 bytes; array = uint32 item type, uint64 count,
                 items; scalars of 1, 2, 4 or 8 bytes)
    tensor table per tensor: string name, uint32 n_dims, uint64 dims[n_dims], uint32 ggml type,
                 uint64 offset (relative to the data section)
    data         starts at the next multiple of ``general.alignment`` (default 32)

The walk touches only lengths and counts (strings are skipped, not decoded), so it costs a few
tens of milliseconds on a 49152-token vocabulary.
"""
from __future__ import annotations

import mmap
import struct
from pathlib import Path

from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES

_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_VERSIONS = (2, 3)
_MAX_DIMS = 4  # GGML_MAX_DIMS


class _Truncated(Exception):
    """The structure runs past the end of the file."""


def check_gguf_file(path: Path) -> None:
    """Raise ``ValueError("<path>: <what is wrong>")`` when ``path`` is not a well-formed GGUF
    file: bad magic, unsupported version, a header, metadata or tensor table that runs past the
    end of the file, an unknown value or ggml type, tensor data outside the file.

    Raises:
        ValueError: as above, one line naming the file.
        OSError: the file cannot be opened or read.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        if size == 0:
            raise ValueError(f"{path}: empty file, not a GGUF file")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            try:
                problem = _walk(data, size)
            except _Truncated as e:
                raise ValueError(f"{path}: truncated GGUF file ({size} bytes): {e}") from None
    if problem:
        raise ValueError(f"{path}: {problem}")


def _walk(data, size: int) -> str | None:
    pos = 0

    def take(n: int, what: str) -> int:
        nonlocal pos
        if n < 0 or pos + n > size:
            raise _Truncated(f"{what} needs bytes {pos}..{pos + n}")
        start, pos = pos, pos + n
        return start

    def u32(what):
        return struct.unpack_from("<I", data, take(4, what))[0]

    def u64(what):
        return struct.unpack_from("<Q", data, take(8, what))[0]

    def string(what) -> bytes:
        n = u64(what)
        return data[take(n, what):pos]

    magic = bytes(data[0:min(4, size)])
    if magic != b"GGUF":
        return f"not a GGUF file (starts with {magic!r}, expected b'GGUF')"
    pos = 4
    version = u32("the header")
    if version not in _VERSIONS:
        return (f"unsupported GGUF version {version} (supported: "
                f"{', '.join(map(str, _VERSIONS))})")
    n_tensors, n_kv = u64("the header"), u64("the header")
    # a cut file fails below at the first entry past its end; counts no file of under 2**31
    # entries could have are damage to the header itself
    if n_kv >= 1 << 31 or n_tensors >= 1 << 31:
        return (f"corrupt GGUF header: it announces {n_kv} metadata entries and {n_tensors} "
                "tensors")
    alignment = 32
    for i in range(n_kv):
        what = f"metadata entry {i + 1} of {n_kv}"
        key = string(what)
        vtype = u32(what)
        label = f"metadata key {_text(key)!r}"
        if vtype == _ARRAY:
            item, count = u32(label), u64(label)
            if item == _STRING:
                for _ in range(count):
                    string(label)
            elif item in _SCALAR_BYTES:
                take(count * _SCALAR_BYTES[item], label)
            else:
                return f"corrupt GGUF metadata: {label} is an array of unknown type {item}"
        elif vtype == _STRING:
            string(label)
        elif vtype in _SCALAR_BYTES:
            start = take(_SCALAR_BYTES[vtype], label)
            if key == b"general.alignment" and vtype == _UINT32:
                alignment = struct.unpack_from("<I", data, start)[0]
                if alignment == 0 or alignment & (alignment - 1):
                    return f"corrupt GGUF metadata: general.alignment is {alignment}"
        else:
            return f"corrupt GGUF metadata: {label} has unknown value type {vtype}"
    tensors = []
    for i in range(n_tensors):
        what = f"tensor table entry {i + 1} of {n_tensors}"
        name = _text(string(what))
        n_dims = u32(what)
        if not 1 <= n_dims <= _MAX_DIMS:
            return f"corrupt GGUF tensor table: tensor {name!r} has {n_dims} dimensions"
        dims = [u64(what) for _ in range(n_dims)]
        raw_type = u32(what)
        offset = u64(what)
        try:
            qtype = GGMLQuantizationType(raw_type)
            block, type_bytes = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            return f"corrupt GGUF tensor table: tensor {name!r} has unknown ggml type {raw_type}"
        count = 1
        for d in dims:
            count *= d
        if dims[0] % block:
            return (f"corrupt GGUF tensor table: tensor {name!r} ({qtype.name}) has {dims[0]} "
                    f"columns, not a multiple of its block size {block}")
        tensors.append((name, offset, count // block * type_bytes))
    data_start = -(-pos // alignment) * alignment
    for name, offset, nbytes in tensors:
        end = data_start + offset + nbytes
        if end > size:
            return (f"truncated GGUF file ({size} bytes): the data of tensor {name!r} ends at "
                    f"byte {end}")
    return None


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace")
