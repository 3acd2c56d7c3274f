"""Default focus layers: parameterised modules spread over depth, the largest always included."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from torchinstruments_core import inject_observer
from torchinstruments_core.testing import RecordingSink

PASS_THROUGH = (nn.Flatten, nn.Identity, nn.Dropout, nn.AdaptiveAvgPool2d, nn.MaxPool2d)


def cnn(blocks: int = 4) -> nn.Sequential:
    """A torchvision-like classifier: conv-bn-relu blocks, adaptive pooling, an MLP head."""
    channels = [3, 16, 32, 64, 64, 64][: blocks + 1]
    layers: list[nn.Module] = []
    for c_in, c_out in itertools.pairwise(channels):
        layers += [nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU()]
    head = [nn.Flatten(), nn.Linear(channels[-1] * 16, 128), nn.ReLU(), nn.Linear(128, 10)]
    return nn.Sequential(*layers, nn.MaxPool2d(2), nn.AdaptiveAvgPool2d(4), *head)


def focus(model: nn.Module, wanted: int = 8) -> list[nn.Module]:
    with inject_observer(model, sink=RecordingSink(), max_focus_layers=wanted) as observer:
        names = observer.focus_layer_names
    modules = dict(model.named_modules())
    return [modules[name] for name in names]


def own_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters(recurse=False))


@pytest.mark.parametrize("wanted", [8, 4, 2, 1])
def test_cnn_focus_is_parameterised_and_keeps_the_largest_linear(wanted: int) -> None:
    """With enough parameterised modules, focus holds only those, the head's big Linear always."""
    model = cnn()
    chosen = focus(model, wanted)
    big_linear = model[15]
    assert isinstance(big_linear, nn.Linear)
    assert big_linear.in_features == 1024
    assert len(chosen) == wanted
    assert all(own_parameters(m) > 0 for m in chosen)
    assert any(m is big_linear for m in chosen)
    if wanted >= 3:  # first and last stay when there is room beside the largest
        assert chosen[0] is model[0]
        assert chosen[-1] is model[-1]


def test_cnn_focus_spreads_over_depth() -> None:
    """Eight of ten parameterised modules: every conv block and both head Linears are present."""
    model = cnn()
    chosen = focus(model)
    assert sum(isinstance(m, nn.Linear) for m in chosen) == 2
    blocks = {i // 3 for i, m in enumerate(model) if any(m is c for c in chosen) and i < 12}
    assert blocks == {0, 1, 2, 3}


def test_mlp_with_few_layers_fills_with_activations_never_dropout() -> None:
    """Three Linears for eight places: all Linears, then activations; no Dropout or Flatten."""
    model = nn.Sequential(
        nn.Flatten(),
        nn.Linear(32, 256),
        nn.ReLU(),
        nn.Dropout(0.1),
        nn.Linear(256, 256),
        nn.GELU(),
        nn.Dropout(0.1),
        nn.Linear(256, 1),
    )
    chosen = focus(model)
    assert [type(m) for m in chosen] == [nn.Linear, nn.ReLU, nn.Linear, nn.GELU, nn.Linear]
    assert not any(isinstance(m, PASS_THROUGH) for m in chosen)
    assert focus(model, 1) == [model[4]]  # one place: the module with the most parameters


def test_lightning_demo_transformer_focus_has_no_dropout() -> None:
    """Lightning's demo Transformer: focus layers are Embedding, Linear and LayerNorm modules."""
    from lightning.pytorch.demos import Transformer

    model = Transformer(vocab_size=64, ninp=16, nhead=2, nhid=32, nlayers=1)
    chosen = focus(model)
    assert len(chosen) == 8
    assert all(isinstance(m, (nn.Embedding, nn.Linear, nn.LayerNorm)) for m in chosen)
    assert chosen[0] is model.embedding
    assert chosen[-1] is model.decoder


def test_tiny_gpt2_focus_is_linear_conv1d_layernorm_or_embedding() -> None:
    """A randomly initialised tiny GPT-2: no dropout or activation among the focus layers."""
    transformers = pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D

    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    chosen = focus(model)
    assert len(chosen) == 8
    assert all(isinstance(m, (nn.Linear, Conv1D, nn.LayerNorm, nn.Embedding)) for m in chosen)


def test_focus_selector_still_decides_when_given() -> None:
    """A focus_selector overrides the default rule, even picking parameter-free modules."""
    model = cnn()
    with inject_observer(
        model,
        sink=RecordingSink(),
        focus_selector=lambda name, module: isinstance(module, nn.Flatten),
    ) as observer:
        assert observer.focus_layer_names == ("14",)
