"""Choose the observed modules and the focus modules that also get histograms."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torchinstruments_core._exceptions import ConfigurationError
from torchinstruments_core._names import named_modules_clean
from torchinstruments_core._records import LayerInfo

if TYPE_CHECKING:
    from torch import nn

    from torchinstruments_core.selectors import SelectorFn


@dataclass(slots=True)
class Layer:
    """An observed module, its clean name and whether its tensors get histograms."""

    name: str
    module: nn.Module
    histogram: bool

    def info(self) -> LayerInfo:
        """The catalog entry of this layer."""
        count = sum(p.numel() for p in self.module.parameters())
        return LayerInfo(self.name, type(self.module).__name__, count, self.histogram)


def select_layers(
    model: nn.Module,
    selector: SelectorFn,
    histogram_selector: SelectorFn | None,
    max_histogram_modules: int,
) -> list[Layer]:
    """The modules ``selector`` picks, in model order, with up to ``max_histogram_modules`` focus.

    Focus modules are those ``histogram_selector`` picks (the first ``max_histogram_modules``), or
    by default that many spread evenly over the selected modules, first and last included, so
    that the histograms show the whole depth of the model.
    """
    layers = [Layer(n, m, False) for n, m in named_modules_clean(model) if selector(n, m)]
    if not layers:
        raise ConfigurationError(
            f"the selector {selector!r} selects no module of {type(model).__name__}; "
            "pass selector=leaf_modules() or a selector that matches the names in "
            "model.named_modules()"
        )
    if histogram_selector is not None:
        focus = [
            i for i, layer in enumerate(layers) if histogram_selector(layer.name, layer.module)
        ]
        focus = focus[:max_histogram_modules]
    else:
        focus = _spread(len(layers), max_histogram_modules)
    for index in focus:
        layers[index].histogram = True
    return layers


def _spread(count: int, wanted: int) -> list[int]:
    if wanted <= 0:
        return []
    if wanted >= count:
        return list(range(count))
    if wanted == 1:
        return [0]
    return sorted({round(i * (count - 1) / (wanted - 1)) for i in range(wanted)})
