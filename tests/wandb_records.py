"""Read the records of an offline W&B run from its ``.wandb`` file, for assertions.

The file is a LevelDB-style log: a 7-byte header (``:W&B``, magic, version), then 32 KiB blocks of
chunks, each with a 7-byte header (CRC-32, length, type: full, first, middle, last) and a piece of
one serialized ``wandb_internal_pb2.Record``.
"""

from __future__ import annotations

import json
import pathlib
import struct
from collections.abc import Iterator
from typing import Any

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _payloads(data: bytes) -> Iterator[bytes]:
    assert data[:4] == b":W&B", "not a .wandb file"
    offset = HEADER
    pending = b""
    while offset + HEADER <= len(data):
        left_in_block = BLOCK - offset % BLOCK
        if left_in_block < HEADER:
            offset += left_in_block  # trailer padding
            continue
        _crc, length, kind = struct.unpack("<IHB", data[offset : offset + HEADER])
        chunk = data[offset + HEADER : offset + HEADER + length]
        offset += HEADER + length
        if kind == 0 and length == 0:
            continue
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            yield pending + chunk
            pending = b""


def history_rows(run_dir: pathlib.Path) -> list[dict[str, Any]]:
    """Every history row of the offline run under ``run_dir``, keys to decoded JSON values."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.rglob("*.wandb")
    rows = []
    for payload in _payloads(path.read_bytes()):
        record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
            )
    return rows
