"""The masked CRC-32C that frames each record of a TensorBoard event file, computed with numpy.

Without TensorFlow installed, TensorBoard's writer checksums every record in a Python loop over
its bytes (``tensorboard.compat.tensorflow_stub.pywrap_tensorflow.crc32c``): about 0.1 ms per
64-bin histogram, on a thread that holds the GIL throughout. Here the CRC's linearity does the
work in bulk, for all the records of a sample at once:

- The register's initial value acts as the first four bytes inverted, and zero bytes in front
  of a message leave a zero register at zero. So each message is inverted in its first four
  bytes, padded in front to a multiple of 256 bytes, and checksummed from a zero register.
- A byte's contribution to the register depends only on its value and on how many bytes follow
  it: a block of 256 bytes is one table lookup per byte and an XOR reduction (every block of
  every message in one numpy call), and the register carried in from the block before is
  four more lookups.

Below 64 bytes (a record's 8-byte length) the byte loop is faster than numpy's fixed cost.
Where the compiled kernels are built, a C loop (slicing by eight) does it all instead.
"""

from __future__ import annotations

import sys
from functools import cache
from typing import TYPE_CHECKING

import numpy as np

from torchinstruments_core.reducers import _compiled

if TYPE_CHECKING:
    from collections.abc import Sequence
    from types import ModuleType

    from numpy.typing import NDArray

_POLYNOMIAL = 0x82F63B78
"""The Castagnoli polynomial, bit-reflected."""
_BLOCK = 256
"""Bytes per block: a block's tables take 256 KiB."""
_MASK = 0xFFFFFFFF
_SHORT = 4
"""Shorter messages, too short to carry the initial register, go through a Python loop."""


@cache
def _tables() -> NDArray[np.uint32]:
    """``tables[k, b]``: the register after byte ``b`` then ``k`` zero bytes, from zero."""
    byte = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        byte = np.where(byte & 1, (byte >> 1) ^ np.uint32(_POLYNOMIAL), byte >> 1)
    tables = np.empty((_BLOCK, 256), dtype=np.uint32)
    tables[0] = byte
    for shift in range(1, _BLOCK):
        previous = tables[shift - 1]
        tables[shift] = (previous >> 8) ^ byte[previous & 0xFF]
    return tables


@cache
def _lists() -> tuple[list[int], list[list[int]]]:
    """The one-byte table, and the four that carry a register over a block, as Python ints."""
    tables = _tables()
    return tables[0].tolist(), [tables[_BLOCK - 1 - position].tolist() for position in range(4)]


def _lookup(blocks: NDArray[np.uint8]) -> NDArray[np.uint32]:
    """Each byte's contribution to its block's register: ``tables[bytes after it, byte]``."""
    rows = np.arange(_BLOCK - 1, -1, -1, dtype=np.intp) * 256  # the last byte is followed by none
    return _tables().ravel().take(blocks + rows)


def crc32cs(messages: Sequence[bytes]) -> list[int]:
    """The CRC-32C of each message (``crc32cs([b"123456789"]) == [0xE3069283]``).

    With the compiled kernels (``reducers._native``) each is one call to C, eight bytes a step.
    """
    kernels = _kernels()
    if kernels is not None:
        return [kernels.crc32c(message) for message in messages]
    crcs = [0] * len(messages)
    long = [index for index, message in enumerate(messages) if len(message) >= _SHORT]
    for index, message in enumerate(messages):
        if len(message) < _SHORT:
            crcs[index] = _bytewise(message)
    if long:
        for index, crc in zip(long, _blockwise([messages[i] for i in long]), strict=True):
            crcs[index] = crc
    return crcs


def _kernels() -> ModuleType | None:
    """The extension as the reductions use it, or ``None``.

    ``_native.KERNELS`` where torch's side is loaded (a test may switch it off there), else the
    extension as loaded without torch (in the writer's process).
    """
    native = sys.modules.get("torchinstruments_core.reducers._native")
    return _compiled.KERNELS if native is None else native.KERNELS


def masked_crc32cs(messages: Sequence[bytes]) -> list[int]:
    """The CRC-32C of each message, rotated and offset as TFRecord frames store it."""
    return [
        ((((crc >> 15) | (crc << 17)) & _MASK) + 0xA282EAD8) & _MASK for crc in crc32cs(messages)
    ]


def _bytewise(message: bytes) -> int:
    """The CRC-32C of ``message``, one byte at a time."""
    table = _lists()[0]
    register = _MASK
    for byte in message:
        register = table[(register ^ byte) & 0xFF] ^ (register >> 8)
    return register ^ _MASK


def _blockwise(messages: Sequence[bytes]) -> list[int]:
    """The CRC-32C of each message of at least four bytes, a block of 256 bytes at a time."""
    blocks = [-(-len(message) // _BLOCK) for message in messages]
    pads = [count * _BLOCK - len(message) for count, message in zip(blocks, messages, strict=True)]
    joined = b"".join(bytes(pad) + message for pad, message in zip(pads, messages, strict=True))
    data = np.frombuffer(joined, dtype=np.uint8).copy()
    starts = np.cumsum([0, *blocks[:-1]]) * _BLOCK + np.array(pads)
    data[(starts[:, None] + np.arange(4)).ravel()] ^= 0xFF  # the initial register
    owns = np.bitwise_xor.reduce(_lookup(data.reshape(-1, _BLOCK)), axis=1).tolist()
    first, second, third, fourth = _lists()[1]
    crcs = []
    position = 0
    for count in blocks:
        register = 0
        for own in owns[position : position + count]:
            register = (
                first[register & 0xFF]
                ^ second[(register >> 8) & 0xFF]
                ^ third[(register >> 16) & 0xFF]
                ^ fourth[register >> 24]
                ^ own
            )
        crcs.append(register ^ _MASK)
        position += count
    return crcs
