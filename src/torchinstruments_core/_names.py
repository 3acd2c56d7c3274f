"""Module names as the user wrote them, with the attributes of wrappers removed.

Wrappers put the real model under an attribute (``module`` for DDP, ``_orig_mod`` for
``torch.compile``, ``_fsdp_wrapped_module`` for FSDP, ``_checkpoint_wrapped_module`` for activation
checkpointing, ``_forward_module`` for Lightning). Private names are removed wherever they stand;
``module`` only under a data-parallel wrapper, since users name their own attributes ``module`` too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch.nn.parallel import DataParallel, DistributedDataParallel

if TYPE_CHECKING:
    from collections.abc import Iterator

    from torch import nn

ROOT_NAME = "<root>"

_PRIVATE_WRAPPER_ATTRIBUTES = frozenset(
    {"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_forward_module"}
)
_DATA_PARALLEL = (DataParallel, DistributedDataParallel)


def _is_wrapper_attribute(parent: nn.Module, attribute: str) -> bool:
    if attribute in _PRIVATE_WRAPPER_ATTRIBUTES:
        return True
    return attribute == "module" and isinstance(parent, _DATA_PARALLEL)


def named_modules_clean(root: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Yield ``(clean_name, module)`` for ``root`` and every submodule, each module once.

    The root is named ``"<root>"``. A module reached only through wrappers gets the name of the
    wrapped model (``module._orig_mod.encoder`` becomes ``encoder``); the wrappers themselves are
    not yielded, so that a name stands for one module and its output is observed once.
    """
    seen: set[int] = set()
    stack: list[tuple[list[str], nn.Module]] = [([], root)]
    while stack:
        parts, module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        children = list(module.named_children())
        if not any(_is_wrapper_attribute(module, attribute) for attribute, _ in children):
            yield (".".join(parts) or ROOT_NAME), module
        for attribute, child in reversed(children):
            keep = [] if _is_wrapper_attribute(module, attribute) else [attribute]
            stack.append(([*parts, *keep], child))
