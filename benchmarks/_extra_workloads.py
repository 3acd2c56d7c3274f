"""Workloads beyond the four the targets name, for checking that the figures hold on models of
other shapes: residual blocks with in-place ReLUs, a recurrent network, a Hugging Face model
(random weights, no download), an MNIST-sized MLP, the smallest model people debug on,
LeNet-5, a small CNN, and a MobileNet-style network of depthwise-separable blocks (many small
modules, each BatchNorm followed by an in-place ReLU6).

``paired.py --workload extra`` measures them; ``--workload all`` keeps to the four of the
targets. Each is built like those (``_overhead_workloads.build``: fixed seeds, AdamW).
"""

from __future__ import annotations

import importlib.util
import itertools
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F

if TYPE_CHECKING:
    from collections.abc import Callable

Batches = list[tuple[torch.Tensor, torch.Tensor]]

DESCRIPTIONS = {
    "resnet20": "CIFAR ResNet-20 (3 stages of 3 basic blocks, 16/32/64 ch, in-place ReLU, "
    "out += identity, torchvision's 1x1 projection shortcuts), 3x32x32, batch 32, AdamW",
    "lstm": "Embedding(1000, 128), 2-layer LSTM(256), Linear(256, 10) on the last step; batch 32, "
    "sequence 50, AdamW",
    "hf-gpt2": "Hugging Face GPT2LMHeadModel, random weights (4 layers, n_embd 256, 4 heads, "
    "vocab 1000, its default config otherwise: use_cache on), batch 8, sequence 64, AdamW",
    "mnist-mlp": "MLP 784-256-128-10, ReLU, batch 64, AdamW (the smallest: a 1-5 ms step)",
    "lenet": "LeNet-5 (conv 6 and 16 ch 5x5, ReLU, max-pool, 120-84-10), 1x28x28, batch 64, "
    "AdamW (a small CNN: 12 module calls, 23 tensors a sample)",
    "mobilenet": "MobileNet-v1-style CNN (a 32-ch stem, 9 depthwise-separable blocks to 512 ch, "
    "BatchNorm and in-place ReLU6 after every convolution), 3x32x32, batch 32, AdamW "
    "(60 module calls a sample)",
}


class BasicBlock(nn.Module):
    """torchvision's ResNet basic block: the ReLU in place, the shortcut added in place."""

    def __init__(self, channels_in: int, channels_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels_out)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels_out)
        self.downsample: nn.Module | None = None
        if stride != 1 or channels_in != channels_out:
            self.downsample = nn.Sequential(
                nn.Conv2d(channels_in, channels_out, 1, stride, bias=False),
                nn.BatchNorm2d(channels_out),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)  # the same module called twice a block: call_index 0 and 1


class ResNet20(nn.Module):
    """He et al.'s CIFAR ResNet-20, with torchvision's 1x1 projection shortcuts."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.relu = nn.ReLU(inplace=True)
        blocks: list[nn.Module] = []
        channels = 16
        for width, stride in ((16, 1), (32, 2), (64, 2)):
            for index in range(3):
                blocks.append(BasicBlock(channels, width, stride if index == 0 else 1))
                channels = width
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(64, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.relu(self.bn1(self.conv1(x))))
        return self.fc(torch.flatten(self.pool(x), 1))


def lenet() -> nn.Sequential:
    """LeNet-5 as people write it for MNIST: ReLU and max-pooling, the first convolution padded."""
    return nn.Sequential(
        nn.Conv2d(1, 6, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(400, 120),
        nn.ReLU(),
        nn.Linear(120, 84),
        nn.ReLU(),
        nn.Linear(84, 10),
    )


def _separable(channels_in: int, channels_out: int, stride: int) -> nn.Sequential:
    """MobileNet's block: a depthwise 3x3 convolution, then a pointwise 1x1 one."""
    return nn.Sequential(
        nn.Conv2d(channels_in, channels_in, 3, stride, 1, groups=channels_in, bias=False),
        nn.BatchNorm2d(channels_in),
        nn.ReLU6(inplace=True),
        nn.Conv2d(channels_in, channels_out, 1, bias=False),
        nn.BatchNorm2d(channels_out),
        nn.ReLU6(inplace=True),
    )


def mobilenet(classes: int = 10) -> nn.Sequential:
    """A MobileNet-v1-style network for 32x32 images (its first five blocks' widths, then 512)."""
    widths = [(32, 64, 1), (64, 128, 2), (128, 128, 1), (128, 256, 2), (256, 256, 1)]
    widths += [(256, 512, 2)] + [(512, 512, 1)] * 3
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, 1, 1, bias=False),
        nn.BatchNorm2d(32),
        nn.ReLU6(inplace=True),
        *(_separable(*width) for width in widths),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(512, classes),
    )


class LSTMClassifier(nn.Module):
    """A 2-layer LSTM over token embeddings, classified from its last step."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(1000, 128)
        self.lstm = nn.LSTM(128, 256, num_layers=2, batch_first=True)
        self.head = nn.Linear(256, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.lstm(self.embed(tokens))  # output (tensor, (h, c)): a nested output
        return self.head(hidden[:, -1])


REQUIRES = {"hf-gpt2": "transformers"}
"""The package a workload needs beyond torch (the project's dev group installs it)."""


def missing(name: str) -> str | None:
    """The package workload ``name`` needs that is not installed, if any."""
    package = REQUIRES.get(name)
    if package is None or importlib.util.find_spec(package) is not None:
        return None
    return package


def mlp(widths: tuple[int, ...], activation: Callable[[], nn.Module]) -> nn.Sequential:
    """``Flatten``, then a ``Linear`` per pair of widths, ``activation`` between them."""
    layers: list[nn.Module] = [nn.Flatten()]
    for index, (width_in, width_out) in enumerate(itertools.pairwise(widths)):
        if index:
            layers.append(activation())
        layers.append(nn.Linear(width_in, width_out))
    return nn.Sequential(*layers)


def _classification(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


def _hugging_face(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss: torch.Tensor = model(input_ids=x, labels=y).loss
    return loss


def _gpt2() -> nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(
        n_layer=4, n_embd=256, n_head=4, vocab_size=1000, n_positions=128
    )
    return transformers.GPT2LMHeadModel(config)


def parts(
    name: str,
    features: Callable[[tuple[int, ...], int], Batches],
    tokens: Callable[[int, int, int], Batches],
) -> tuple[nn.Module, Batches, Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]]:
    """The model, the batches and the loss of extra workload ``name``."""
    if name == "resnet20":
        return ResNet20(), features((32, 3, 32, 32), 10), _classification
    if name == "lstm":
        pool = [(x, y[:, -1] % 10) for x, y in tokens(32, 50, 1000)]
        return LSTMClassifier(), pool, _classification
    if name == "hf-gpt2":  # GPT2LMHeadModel shifts the labels itself
        return _gpt2(), [(x, x) for x, _ in tokens(8, 64, 1000)], _hugging_face
    if name == "mnist-mlp":
        return mlp((784, 256, 128, 10), nn.ReLU), features((64, 1, 28, 28), 10), _classification
    if name == "lenet":
        return lenet(), features((64, 1, 28, 28), 10), _classification
    if name == "mobilenet":
        return mobilenet(), features((32, 3, 32, 32), 10), _classification
    raise ValueError(f"unknown extra workload {name!r}; choose from {', '.join(DESCRIPTIONS)}")
