"""Built-in selectors: leaf modules, by type, by name glob, and their combinations."""

from __future__ import annotations

import fnmatch

from torch import nn

from torchinstruments_core._exceptions import ConfigurationError
from torchinstruments_core.selectors.base import Selector, SelectorFn, describe


def leaf_modules() -> Selector:
    """Select modules without children (``Linear``, ``Conv2d``, ``LayerNorm``, activations …).

    Example:
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        >>> [n for n, m in model.named_modules() if leaf_modules()(n, m)]
        ['0', '1']
    """
    return Selector(lambda _name, module: next(module.children(), None) is None, "leaf_modules()")


def by_type(*types: type[nn.Module]) -> Selector:
    """Select instances of any of ``types`` (subclasses included)."""
    if not types or not all(isinstance(t, type) and issubclass(t, nn.Module) for t in types):
        raise ConfigurationError.invalid("types", types, "one or more nn.Module subclasses")
    names = ", ".join(t.__name__ for t in types)
    return Selector(lambda _name, module: isinstance(module, types), f"by_type({names})")


def by_name(*patterns: str) -> Selector:
    """Select modules whose clean name matches any of the shell-style ``patterns``.

    Example:
        >>> by_name("encoder.*.attn")("encoder.3.attn", None)
        True
    """
    if not patterns or not all(isinstance(p, str) and p for p in patterns):
        raise ConfigurationError.invalid("patterns", patterns, "one or more non-empty glob strings")
    text = ", ".join(repr(p) for p in patterns)
    return Selector(
        lambda name, _module: any(fnmatch.fnmatchcase(name, p) for p in patterns),
        f"by_name({text})",
    )


def all_of(*selectors: SelectorFn) -> Selector:
    """Select modules that every one of ``selectors`` selects."""
    _check_selectors(selectors)
    text = ", ".join(describe(s) for s in selectors)
    return Selector(lambda n, m: all(s(n, m) for s in selectors), f"all_of({text})")


def any_of(*selectors: SelectorFn) -> Selector:
    """Select modules that at least one of ``selectors`` selects."""
    _check_selectors(selectors)
    text = ", ".join(describe(s) for s in selectors)
    return Selector(lambda n, m: any(s(n, m) for s in selectors), f"any_of({text})")


def _check_selectors(selectors: tuple[SelectorFn, ...]) -> None:
    if not selectors or not all(callable(s) for s in selectors):
        raise ConfigurationError.invalid("selectors", selectors, "one or more callables")
