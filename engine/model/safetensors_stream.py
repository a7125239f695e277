"""A safetensors file written one tensor at a time, so a conversion never holds a whole
model: `mx.save_safetensors` takes every array at once, which for a GGUF conversion was
the converted weights plus the file's pages, ~3.5x the file at the peak.

Safetensors puts its header (names, dtypes, shapes, offsets) first, so the tensors' bytes
go to a side file as they come and are copied after the header at `close`.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np

# numpy dtype -> safetensors dtype; bfloat16 comes as uint16 bits tagged "BF16"
DTYPES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16",
          np.dtype(np.uint32): "U32", np.dtype(np.int32): "I32", np.dtype(np.uint8): "U8"}


class SafetensorsWriter:
    """Writes ``path`` (mode 0600); `add` each tensor, then `close` once. A writer that is
    not closed leaves only its side file, which `abort` (or `close`) removes."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._side_path = self.path.with_name(self.path.name + ".data")
        fd = os.open(self._side_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        self._side = os.fdopen(fd, "wb")
        self._entries: dict[str, dict] = {}
        self._offset = 0

    def add(self, name: str, array: np.ndarray, dtype: str | None = None) -> None:
        """Append ``array`` (C order) as tensor ``name``; ``dtype`` overrides the tag
        (``"BF16"`` for bfloat16 bits held as uint16)."""
        if name in self._entries:
            raise ValueError(f"tensor {name} added twice")
        array = np.ascontiguousarray(array)
        tag = dtype or DTYPES.get(array.dtype)
        if tag is None:
            raise ValueError(f"tensor {name}: no safetensors dtype for {array.dtype}")
        data = memoryview(array.reshape(-1).view(np.uint8))
        self._side.write(data)
        end = self._offset + data.nbytes
        self._entries[name] = {"dtype": tag, "shape": list(array.shape),
                               "data_offsets": [self._offset, end]}
        self._offset = end

    def __len__(self) -> int:
        """Tensors added so far."""
        return len(self._entries)

    def close(self, metadata: dict[str, str] | None = None) -> None:
        """Write the file: the header, then the tensors' bytes."""
        self._side.close()
        header = dict(self._entries)
        if metadata:
            header["__metadata__"] = metadata
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors does
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as out, open(self._side_path, "rb") as side:
                out.write(struct.pack("<Q", len(raw)))
                out.write(raw)
                shutil.copyfileobj(side, out, 1 << 24)
        finally:
            self.abort()

    def abort(self) -> None:
        """Drop the side file (the tensors added so far)."""
        self._side.close()
        self._side_path.unlink(missing_ok=True)
