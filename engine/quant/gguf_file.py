"""A GGUF file's tensor table and chosen metadata values, read without parsing the rest.

`gguf.GGUFReader` builds a Python object for every metadata value (the bundled model's 49k-entry
token list: ~2.3 s per open); the weights only need the tensor table and the loaders a few
scalars, so this reads the header, skips the key/value section but for the keys asked for, and
memory-maps the data:

    "GGUF" u32 version  u64 n_tensors  u64 n_kv
    n_kv x (string key, u32 type, value)          arrays: u32 item type, u64 count, items
    n_tensors x (string name, u32 n_dims, u64 ne[n_dims], u32 ggml type, u64 offset)
    padding to `general.alignment` (default 32), then the tensor data

`ne[0]` is the contiguous dimension: a [rows, cols] matrix has ne = (cols, rows).
"""

from __future__ import annotations

import struct
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.quant.ggml_types import GGML_QUANT_SIZES, GGMLQuantizationType

_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    """One stored tensor: `shape` in PyTorch order (rows first), `data` its raw bytes
    (memory-mapped uint8, [rows, bytes per row] for a matrix)."""

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


class _Cursor:
    def __init__(self, buf: np.ndarray) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> tuple:
        size = struct.calcsize(fmt)
        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return values

    def string(self) -> str:
        (n,) = self.take("<Q")
        self.pos += n
        return bytes(self.buf[self.pos - n : self.pos]).decode("utf-8")

    def value(self, vtype: int) -> int | float | bool | str:
        """Read one scalar or string value."""
        return self.string() if vtype == _STRING else self.take(_SCALAR_FORMATS[vtype])[0]

    def skip_value(self, vtype: int) -> None:
        if vtype == _STRING:
            (n,) = self.take("<Q")
            self.pos += n
        elif vtype == _ARRAY:
            item, count = self.take("<IQ")
            if item in _SCALAR_SIZES:
                self.pos += count * _SCALAR_SIZES[item]
            else:
                for _ in range(count):
                    self.skip_value(item)
        else:
            self.pos += _SCALAR_SIZES[vtype]


def _open(path: str | Path) -> tuple[np.ndarray, _Cursor, int, int]:
    """(file bytes, a cursor at the key/value section, n_tensors, n_kv)."""
    buf = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(buf)
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file")
    cur.pos = 4
    version, n_tensors, n_kv = cur.take("<IQQ")
    if version < 2:
        raise ValueError(f"{path}: GGUF version {version} is not supported")
    return buf, cur, n_tensors, n_kv


def _read_kv(cur: _Cursor, n_kv: int, keys: Collection[str]) -> dict[str, object]:
    """The values of `keys` (scalars and strings; arrays are skipped), the cursor moved past
    the key/value section."""
    found: dict[str, object] = {}
    for _ in range(n_kv):
        key = cur.string()
        (vtype,) = cur.take("<I")
        if key in keys and vtype != _ARRAY:
            found[key] = cur.value(vtype)
        else:
            cur.skip_value(vtype)
    return found


def read_metadata(path: str | Path, keys: Collection[str]) -> dict[str, object]:
    """The scalar and string values stored under `keys` (a key the file lacks is absent)."""
    _, cur, _, n_kv = _open(path)
    return _read_kv(cur, n_kv, keys)


def read_tensors(path: str | Path) -> list[GGUFTensor]:
    """The tensors of a GGUF file (v2/v3), in file order, their data memory-mapped.
    Raises ValueError on a file that is not GGUF or names an unknown tensor type."""
    buf, cur, n_tensors, n_kv = _open(path)
    alignment = int(_read_kv(cur, n_kv, ("general.alignment",)).get("general.alignment", 32))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        (n_dims,) = cur.take("<I")
        ne = cur.take(f"<{n_dims}Q")
        raw_type, offset = cur.take("<IQ")
        infos.append((name, ne, raw_type, offset))
    start = -(-cur.pos // alignment) * alignment
    return [_tensor(buf, start, *info) for info in infos]


def _tensor(
    buf: np.ndarray, start: int, name: str, ne: tuple[int, ...], raw_type: int, offset: int
) -> GGUFTensor:
    try:
        qtype = GGMLQuantizationType(raw_type)
    except ValueError:
        raise ValueError(f"tensor {name!r} has unknown GGML type {raw_type}") from None
    block, type_size = GGML_QUANT_SIZES[qtype]
    shape = tuple(reversed(ne))
    row_bytes = ne[0] // block * type_size
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    data = buf[start + offset : start + offset + rows * row_bytes].reshape(rows, row_bytes)
    return GGUFTensor(name, qtype, shape, data)
