"""A safetensors file written one piece at a time: no tensor needs to be whole in memory.

    with SafetensorsWriter(path, bound=[(name, shape), ...], metadata={"format": "pt"}) as w:
        w.begin("a", torch.bfloat16, (4096, 7168))
        for slab in slabs:            # rows of "a", in order
            w.write(slab)
        w.begin("b", torch.uint8, (16,)); w.write(b)
    # closed: every begun tensor complete, the header written

The header comes first in the format but is only known at the end (the dtypes of tensors read from a checkpoint),
so room for it is reserved at the start, sized from `bound` (every name the file may hold, with its shape) at the
longest dtype spelling and offset, and filled at close padded with spaces, as the format allows (safetensors' own
writer pads the same way). Tensors are laid out in the order they are begun, back to back.
"""
from __future__ import annotations

import json
import math
import os
import struct

import torch

DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
_LONGEST = max(DTYPES.values(), key=len)
_BIG_OFFSET = 10 ** 19                      # more digits than any real offset


def header_bound(bound, metadata: dict[str, str]) -> int:
    """Bytes that hold the header of any file of these (name, shape) entries (a multiple of 8)."""
    entries = {n: {"dtype": _LONGEST, "shape": list(s), "data_offsets": [_BIG_OFFSET, _BIG_OFFSET]} for n, s in bound}
    size = len(json.dumps({"__metadata__": metadata, **entries}, separators=(",", ":")).encode())
    return -(-size // 8) * 8


class SafetensorsWriter:
    def __init__(self, path: str, *, bound, metadata: dict[str, str] | None = None):
        self.path = path
        self.metadata = dict(metadata or {})
        self.names = {n for n, _ in bound}
        self.reserved = header_bound(bound, self.metadata)
        self.entries: dict[str, dict] = {}
        self.offset = 0                     # bytes of tensor data written
        self._current: tuple[str, int] | None = None   # (name, bytes still to come)
        self.fh = open(path, "wb")
        self.fh.seek(8 + self.reserved)

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.fh.close()

    def begin(self, name: str, dtype: torch.dtype, shape) -> None:
        """Start tensor `name`; its bytes follow through write()."""
        self.finish_tensor()
        if name not in self.names or name in self.entries:
            raise ValueError(f"{name!r}: not a tensor this file was sized for, or written twice")
        if dtype not in DTYPES:
            raise ValueError(f"{name!r}: dtype {dtype} has no safetensors spelling")
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        self.entries[name] = {"dtype": DTYPES[dtype], "shape": [int(s) for s in shape],
                              "data_offsets": [self.offset, self.offset + size]}
        self._current = (name, size)
        self._dtype = dtype

    def write(self, part: torch.Tensor) -> None:
        """The next bytes of the current tensor (a contiguous piece of it in row-major order)."""
        name, left = self._current
        if part.dtype != self._dtype:
            raise ValueError(f"{name!r}: a {part.dtype} piece of a {self._dtype} tensor")
        data = part.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        if data.nbytes > left:
            raise ValueError(f"{name!r}: more bytes than its shape holds")
        self.fh.write(data)
        self.offset += data.nbytes
        self._current = (name, left - data.nbytes)

    def finish_tensor(self) -> None:
        if self._current is not None and self._current[1]:
            raise ValueError(f"{self._current[0]!r}: {self._current[1]} bytes short of its shape")

    def close(self) -> None:
        self.finish_tensor()
        header = json.dumps({"__metadata__": self.metadata, **self.entries}, separators=(",", ":")).encode()
        if len(header) > self.reserved:
            raise ValueError("safetensors header larger than reserved")
        self.fh.seek(0)
        self.fh.write(struct.pack("<Q", self.reserved) + header + b" " * (self.reserved - len(header)))
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.fh.close()
