"""Selectors decide which modules are observed."""

from torchinstruments_core.selectors.base import Selector, SelectorFn
from torchinstruments_core.selectors.builtin import all_of, any_of, by_name, by_type, leaf_modules

__all__ = ["Selector", "SelectorFn", "all_of", "any_of", "by_name", "by_type", "leaf_modules"]
