"""The IDX file format of MNIST and Fashion-MNIST, read with numpy.

An IDX file is a big-endian header and a dense array (LeCun et al., "THE MNIST DATABASE")::

    bytes 0-1: 0x00 0x00           magic, always zero
    byte  2:   type code           0x08 ubyte, 0x09 byte, 0x0B int16, 0x0C int32, 0x0D float32, 0x0E float64
    byte  3:   ndim
    then ndim big-endian uint32    the size of each dimension
    then the values, row-major, big-endian

Files may be gzip-compressed (``.gz``), as distributed.
"""
from __future__ import annotations

import gzip
import os
from typing import IO

import numpy as np

from ..errors import DataError

__all__ = ["IDX_TYPES", "read_idx", "write_idx"]

IDX_TYPES: dict[int, np.dtype] = {
    0x08: np.dtype(np.uint8), 0x09: np.dtype(np.int8), 0x0B: np.dtype(">i2"), 0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8"),
}
"""IDX type code -> numpy dtype (big-endian where it matters)."""


def _open(path: str) -> IO[bytes]:
    with open(path, "rb") as probe:
        gz = probe.read(2) == b"\x1f\x8b"
    return gzip.open(path, "rb") if gz else open(path, "rb")  # type: ignore[return-value]


def read_idx(path: str) -> np.ndarray:
    """The array stored in IDX file ``path`` (gzip-compressed or not), in native byte order.

    Raises:
        DataError: not an IDX file (bad magic or type), or the file is shorter than its header says.
    """
    try:
        with _open(path) as f:
            data = f.read()
    except (OSError, EOFError) as exc:
        raise DataError(f"cannot read IDX file {path!r} ({exc}); check the file") from None
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in IDX_TYPES:
        raise DataError(f"{path!r} is not an IDX file (header {data[:4].hex() or 'empty'}: expected 0000, a "
                        f"type code in {sorted(hex(k) for k in IDX_TYPES)} and ndim); use the original "
                        f"train-images-idx3-ubyte files")
    dtype, ndim = IDX_TYPES[data[2]], data[3]
    header = 4 + 4 * ndim
    shape = tuple(int(v) for v in np.frombuffer(data[4:header], dtype=">u4")) if len(data) >= header else ()
    count = int(np.prod(shape)) if shape else 0
    if len(data) < header or len(data) - header != count * dtype.itemsize:
        raise DataError(f"IDX file {path!r} is truncated or padded: header says shape {list(shape)} "
                        f"({count * dtype.itemsize} bytes), the file has {max(len(data) - header, 0)}; "
                        f"download or unpack it again")
    return np.frombuffer(data, dtype=dtype, offset=header).reshape(shape).astype(dtype.newbyteorder("="))


def write_idx(path: str, array: np.ndarray, compress: bool | None = None) -> None:
    """Write ``array`` as an IDX file (gzip when ``compress``, default: ``path`` ends in ``.gz``).

    The inverse of :func:`read_idx`; tests use it to make tiny data sets.
    """
    codes = {v.newbyteorder("=").str: k for k, v in IDX_TYPES.items()}
    native = np.dtype(array.dtype).newbyteorder("=")
    if native.str not in codes:
        raise DataError(f"IDX cannot store dtype {array.dtype}; use one of uint8, int8, int16, int32, float32, "
                        f"float64")
    code = codes[native.str]
    body = (bytes([0, 0, code, array.ndim]) + np.asarray(array.shape, dtype=">u4").tobytes()
            + np.ascontiguousarray(array, dtype=IDX_TYPES[code]).tobytes())
    compress = path.endswith(".gz") if compress is None else compress
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with (gzip.open(path, "wb") if compress else open(path, "wb")) as f:
        f.write(body)
