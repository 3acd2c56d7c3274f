"""Choose the observed modules and, among them, the focus layers that also get histograms."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn
from torch.nn.modules import dropout, flatten, pooling

from torchinstruments_core._config import check_positive_int
from torchinstruments_core._deprecation import renamed_argument
from torchinstruments_core._exceptions import ConfigurationError
from torchinstruments_core._names import named_modules_clean
from torchinstruments_core._records import LayerInfo

if TYPE_CHECKING:
    from torchinstruments_core.selectors import SelectorFn

# Their outputs repeat the statistics of the module before them (reshaped, subsampled or
# averaged), so a focus slot spent on one shows the previous layer a second time.
_NEVER_FOCUS: tuple[type[nn.Module], ...] = (
    nn.Identity,
    *(getattr(source, name) for source in (dropout, flatten, pooling) for name in source.__all__),
)

DEFAULT_MAX_FOCUS_LAYERS = 8
"""How many focus layers are chosen unless ``max_focus_layers`` says otherwise."""


@dataclass(slots=True)
class Layer:
    """An observed module, its clean name and whether its tensors get histograms."""

    name: str
    module: nn.Module
    histogram: bool

    def info(self) -> LayerInfo:
        """The catalog entry of this layer."""
        count = sum(p.numel() for p in self.module.parameters())
        own = tuple(name for name, _ in self.module.named_parameters(recurse=False))
        return LayerInfo(self.name, type(self.module).__name__, count, self.histogram, own)


def focus_arguments(
    owner: str,
    focus_selector: SelectorFn | None,
    max_focus_layers: int,
    histogram_selector: SelectorFn | None,
    max_histogram_modules: int | None,
) -> tuple[SelectorFn | None, int]:
    """``focus_selector`` and ``max_focus_layers`` of ``owner``, checked.

    ``histogram_selector`` and ``max_histogram_modules`` are their deprecated names: either is
    taken with a ``DeprecationWarning``, and giving both names of one argument raises.

    Raises:
        ConfigurationError: An argument is invalid or given under both names.
    """
    selector = renamed_argument(
        owner, "focus_selector", focus_selector, "histogram_selector", histogram_selector, None
    )
    if selector is not None and not callable(selector):
        raise ConfigurationError.invalid("focus_selector", selector, "a (name, module) -> bool")
    count = renamed_argument(
        owner,
        "max_focus_layers",
        max_focus_layers,
        "max_histogram_modules",
        max_histogram_modules,
        DEFAULT_MAX_FOCUS_LAYERS,
    )
    name = "max_focus_layers" if max_histogram_modules is None else "max_histogram_modules"
    return selector, check_positive_int(name, count, minimum=0)


def select_layers(
    model: nn.Module,
    selector: SelectorFn,
    focus_selector: SelectorFn | None,
    max_focus_layers: int,
) -> list[Layer]:
    """The modules ``selector`` picks, in model order, with up to ``max_focus_layers`` focus.

    Focus layers are those ``focus_selector`` picks (the first ``max_focus_layers``), or by
    default those ``default_focus`` picks.
    """
    layers = [Layer(n, m, False) for n, m in named_modules_clean(model) if selector(n, m)]
    if not layers:
        raise ConfigurationError(
            f"the selector {selector!r} selects no module of {type(model).__name__}; "
            "pass selector=leaf_modules() or a selector that matches the names in "
            "model.named_modules()"
        )
    if focus_selector is not None:
        focus = [i for i, layer in enumerate(layers) if focus_selector(layer.name, layer.module)]
        focus = focus[:max_focus_layers]
    else:
        focus = default_focus([layer.module for layer in layers], max_focus_layers)
    for index in focus:
        layers[index].histogram = True
    return layers


def default_focus(modules: list[nn.Module], wanted: int) -> list[int]:
    """Indices (in model order) of up to ``wanted`` focus modules among ``modules``.

    Modules with parameters of their own come first: ``wanted`` of them spread evenly over the
    depth, the first and the last included, and always the one with the most parameters (the
    first such, on a tie), which takes the place of the spread pick nearest to it. Parameter-free
    modules fill the remaining places only when fewer modules have parameters, spread the same
    way; ``Identity``, ``Flatten``, ``Unflatten``, dropout and pooling modules never do.

    Example:
        >>> from torch import nn
        >>> head = [nn.Flatten(), nn.Linear(512, 64), nn.ReLU(), nn.Dropout(), nn.Linear(64, 10)]
        >>> default_focus(head, 8)
        [1, 2, 4]
        >>> default_focus(head, 1)
        [1]
    """
    sizes = [_own_parameters(module) for module in modules]
    weighted = [i for i, size in enumerate(sizes) if size > 0]
    if len(weighted) >= wanted:
        picks = [weighted[i] for i in _spread(len(weighted), wanted)]
        largest = max(weighted, key=lambda i: (sizes[i], -i)) if picks else None
        return sorted(_with(picks, largest))
    fillers = [i for i, module in enumerate(modules) if sizes[i] == 0 and not _never_focus(module)]
    extra = [fillers[i] for i in _spread(len(fillers), wanted - len(weighted))]
    return sorted(weighted + extra)


def _own_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters(recurse=False))


def _never_focus(module: nn.Module) -> bool:
    return isinstance(module, _NEVER_FOCUS)


def _with(picks: list[int], largest: int | None) -> list[int]:
    """``picks`` with ``largest`` in place of the nearest pick, the first and last kept if able."""
    if largest is None or largest in picks:
        return picks
    inner = picks[1:-1] or picks[:-1] or picks
    nearest = min(inner, key=lambda i: abs(i - largest))
    return [largest if i == nearest else i for i in picks]


def _spread(count: int, wanted: int) -> list[int]:
    if wanted <= 0:
        return []
    if wanted >= count:
        return list(range(count))
    if wanted == 1:
        return [0]
    return sorted({round(i * (count - 1) / (wanted - 1)) for i in range(wanted)})
