"""Where the engine touches the model: root scope, per-module output hooks and gradient hooks.

The root's pre- and post-hooks are the only hooks that run on an unsampled forward. The per-module
hooks are registered when a sampled root forward starts and removed when it ends, so an unsampled
forward runs no per-module hook at all. Gradients are captured with tensor hooks on the observed
outputs, which survive in-place ops that follow the module (``register_full_backward_hook`` does
not).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from torchinstruments_core._hooks import ForwardPatch, Hook, force_eager, inert_hook, run_eagerly
from torchinstruments_core._sample import Sample, Site

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    from torch import nn
    from torch.utils.hooks import RemovableHandle

    from torchinstruments_core._layers import Layer
    from torchinstruments_core._profile import CallProfile


def _same(function: Callable[..., None]) -> Callable[..., None]:
    return function


class GradientSlot:
    """The tensor hook on one observed output: hands its gradient to the observer's sample.

    ``on_gradient`` is called as it is: its owner makes it ``run_eagerly`` once (wrapping it
    for each hook cost every observed output about 10 µs a sample).
    """

    __slots__ = ("_on_gradient", "boundary", "histogram", "nested", "sample", "sentinel", "site")

    def __init__(
        self,
        on_gradient: Callable[[GradientSlot, torch.Tensor], None],
        sample: Sample,
        site: Site | None,
        histogram: bool,
        sentinel: object,
    ) -> None:
        self._on_gradient = on_gradient
        self.sample = sample
        self.site = site  # None: the hook only marks that the sample's backward started
        self.histogram = histogram
        # On a recomputed output: its gradient arrives in a nested backward (a checkpoint's).
        self.nested = False
        # Held only by this hook: when autograd frees the graph, the sentinel dies with it.
        self.sentinel = sentinel
        # profile=True: the calls whose backward this gradient starts, or ends (True).
        self.boundary: list[tuple[CallProfile, bool]] = []

    def __call__(self, grad: torch.Tensor) -> None:
        self._on_gradient(self, grad)

    def __deepcopy__(self, memo: dict[int, object]) -> None:
        return None


class Attachment:
    """The hooks and patches one observer placed on a model, removed all at once.

    Args:
        model: The observed root module.
        layers: The observed modules.
        on_enter: Called with the root's positional and keyword arguments when a root forward
            starts.
        on_exit: Called with the root output (``None`` if the forward raised) when it ends.
        on_output: Called with a layer and its output during a sampled forward.
        direct: Patch ``forward`` instead of using module hooks, so that direct
            ``module.forward(x)`` calls are observed too.
        on_input: Called with a layer, its positional and its keyword arguments when a call
            starts in a sampled forward (a forward pre-hook); ``None``: no pre-hook is armed.
    """

    def __init__(
        self,
        model: nn.Module,
        layers: list[Layer],
        *,
        on_enter: Callable[[Any, Any], None],
        on_exit: Callable[[Any], None],
        on_output: Callable[[Layer, Any], None],
        direct: bool,
        on_input: Callable[[Layer, Any, Any], None] | None = None,
    ) -> None:
        self._model: nn.Module | None = model
        self._layers = [layer for layer in layers if layer.module is not model]
        # Compiled code calls these as they are, never tracing the observer. Module hooks are
        # ``Hook``s, which run eagerly already; the forward patches call the functions directly.
        wrap = run_eagerly if direct else _same
        self._on_enter = wrap(on_enter)
        self._on_exit = wrap(on_exit)
        self._on_output = wrap(on_output)
        self._on_input = None if on_input is None else wrap(on_input)
        self._direct = direct
        self._handles: list[RemovableHandle] = []
        self._armed: list[RemovableHandle] = []
        self._patched: list[tuple[nn.Module, ForwardPatch]] = []
        self.armed = False
        self._restore_stance: Callable[[], None] = inert_hook  # set by arm()
        self._layer_hooks = [
            Hook(functools.partial(self._layer_hook, layer)) for layer in self._layers
        ]
        self._pre_hooks = [
            Hook(functools.partial(self._layer_pre_hook, layer)) for layer in self._layers
        ]

    def attach(self) -> None:
        """Place the root hooks (or the forward patches); all or nothing."""
        try:
            if self._direct and self._model is not None:
                self._patch(self._model, self._root_forward)
                for layer in self._layers:
                    self._patch(layer.module, functools.partial(self._layer_forward, layer))
            else:
                self._attach_root_hooks()
        except BaseException:
            self.detach()
            raise

    def _attach_root_hooks(self) -> None:
        assert self._model is not None, "attach after detach"
        enter = Hook(lambda _module, args, kwargs: self._on_enter(args, kwargs))
        exit_ = Hook(lambda _module, _args, output: self._on_exit(output))
        self._handles.append(self._model.register_forward_pre_hook(enter, with_kwargs=True))
        # always_call: the scope closes even when the forward raises.
        self._handles.append(self._model.register_forward_hook(exit_, always_call=True))

    def detach(self) -> None:
        """Remove every hook and restore every patched ``forward``. Safe to call twice."""
        self.disarm()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for module, patch in reversed(self._patched):
            if module.__dict__.get("forward") is not patch:
                continue  # someone patched over us; leave their forward in place
            if patch.replaced_instance_attribute:
                module.__dict__["forward"] = patch.original
            else:
                del module.__dict__["forward"]
        self._patched.clear()
        # A removed observer keeps its attachment object; it must not keep the model alive.
        self._model = None
        self._layers = []
        self._layer_hooks = []
        self._pre_hooks = []

    def arm(self) -> None:
        """Register the per-module hooks for the sampled forward that starts now.

        Until ``disarm``, compiled code runs as plain Python, so a compiled model's sampled
        forward fires the hooks without a graph of its own (``force_eager``).
        """
        if self.armed:
            return
        self._restore_stance = force_eager()
        self.armed = True
        if self._direct:
            return
        for layer, hook in zip(self._layers, self._layer_hooks, strict=True):
            self._armed.append(layer.module.register_forward_hook(hook))
        if self._on_input is not None:
            for layer, pre_hook in zip(self._layers, self._pre_hooks, strict=True):
                module = layer.module
                self._armed.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))

    def disarm(self) -> None:
        """Remove the per-module hooks; the next unsampled forward runs none."""
        if not self.armed:
            return
        self.armed = False
        restore, self._restore_stance = self._restore_stance, inert_hook
        try:
            for handle in self._armed:
                handle.remove()
            self._armed.clear()
        finally:
            restore()

    def _layer_hook(self, layer: Layer, _module: nn.Module, _args: Any, output: Any) -> None:
        self._on_output(layer, output)

    def _layer_pre_hook(self, layer: Layer, _module: nn.Module, args: Any, kwargs: Any) -> None:
        assert self._on_input is not None, "pre-hooks are armed only with on_input"
        self._on_input(layer, args, kwargs)

    def _patch(self, module: nn.Module, observe: Callable[..., Any]) -> None:
        replaced = "forward" in module.__dict__
        patch = ForwardPatch(module.forward, observe, replaced_instance_attribute=replaced)
        module.__dict__["forward"] = patch
        self._patched.append((module, patch))

    def _root_forward(self, original: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        self._on_enter(args, kwargs)
        output = None
        try:
            output = original(*args, **kwargs)
        finally:
            self._on_exit(output)
        return output

    def _layer_forward(
        self, layer: Layer, original: Callable[..., Any], args: Any, kwargs: Any
    ) -> Any:
        if self.armed and self._on_input is not None:
            self._on_input(layer, args, kwargs)
        output = original(*args, **kwargs)
        if self.armed:
            self._on_output(layer, output)
        return output


def gradient_signal_site(site: Site) -> Site:
    """The site of the gradient that flows back into an observed tensor (its signal's gradient)."""
    gradient = site.signal.gradient
    if gradient is None:
        raise ValueError(f"the signal {site.signal} has no gradient signal")
    return Site(site.layer, site.call_index, gradient, site.tensor_path)
