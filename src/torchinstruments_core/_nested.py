"""Walk the tensors inside a module output, naming where each one sits.

``output`` for a single tensor; ``output.0``, ``output.1.hidden``, ``output.logits`` inside tuples,
lists, dicts (including Hugging Face ``ModelOutput``), dataclasses and named tuples.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch

_MAX_DEPTH = 16


def iter_tensors(value: Any, path: str, depth: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(tensor_path, tensor)`` for every tensor in a nested output, depth first.

    ``path`` is the root of every path: the signal's ``tensor_root`` (``output``).

    Containers nested deeper than 16 levels are not followed (a cyclic structure stops there).
    """
    if isinstance(value, torch.Tensor):
        yield path, value
        return
    if depth >= _MAX_DEPTH:
        return
    for key, item in _children(value):
        yield from iter_tensors(item, f"{path}.{key}", depth + 1)


def _children(value: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(value, Mapping):
        for key, item in value.items():
            yield str(key), item
    elif isinstance(value, tuple) and hasattr(value, "_fields"):
        yield from zip(value._fields, value, strict=True)
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            yield str(index), item
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield field.name, getattr(value, field.name)
