"""The selector extension point: which modules are observed.

A selector is any ``(name, module) -> bool`` callable; ``name`` is the module's clean name (wrapper
attributes removed, the root is ``"<root>"``). ``Selector`` adds ``&``, ``|`` and ``~`` so that
built-in selectors combine: ``leaf_modules() & ~by_name("*.dropout")``.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

SelectorFn = Callable[[str, nn.Module], bool]


class Selector:
    """A named predicate over ``(name, module)`` that combines with ``&``, ``|`` and ``~``."""

    def __init__(self, predicate: SelectorFn, description: str) -> None:
        self._predicate = predicate
        self._description = description

    def __call__(self, name: str, module: nn.Module) -> bool:
        """Return whether the module is selected."""
        return bool(self._predicate(name, module))

    def __and__(self, other: SelectorFn) -> Selector:
        return Selector(lambda n, m: self(n, m) and other(n, m), f"({self} & {_describe(other)})")

    def __or__(self, other: SelectorFn) -> Selector:
        return Selector(lambda n, m: self(n, m) or other(n, m), f"({self} | {_describe(other)})")

    def __invert__(self) -> Selector:
        return Selector(lambda n, m: not self(n, m), f"~{self}")

    def __repr__(self) -> str:
        return self._description


def _describe(selector: SelectorFn) -> str:
    if isinstance(selector, Selector):
        return repr(selector)
    return getattr(selector, "__qualname__", None) or repr(selector)


def describe(selector: SelectorFn) -> str:
    """A short human-readable description of any selector, for reports."""
    return _describe(selector)
