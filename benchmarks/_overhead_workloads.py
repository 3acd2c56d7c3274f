"""The workloads of ``overhead.py``: a model, its optimizer, fixed batches and one training step.

Every row of a workload builds it the same way (same seed, same initial weights, same batches), so
the only difference between two rows is the instrumentation attached to the model.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import _extra_workloads
import torch
from torch import nn
from torch.nn import functional as F

if TYPE_CHECKING:
    from collections.abc import Callable

MODEL_SEED = 0
DATA_SEED = 1234
BATCHES = 4  # a small pool, cycled: data loading is not what is measured


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """What a workload is, in words for the table."""

    name: str
    description: str
    cuda_only: bool = False
    extra: bool = False
    """Not one of the targets' workloads (``_extra_workloads``): measured on request."""


WORKLOADS: dict[str, WorkloadSpec] = {
    "mlp": WorkloadSpec("mlp", "MLP 784-1024-1024-1024-10, GELU, batch 128, AdamW"),
    "cnn": WorkloadSpec(
        "cnn", "CNN 3 conv-BN-ReLU blocks (32/64/128 ch) + linear, 3x32x32, batch 32, AdamW"
    ),
    "transformer": WorkloadSpec(
        "transformer",
        "4-layer nn.TransformerEncoder (d_model 256, nhead 8, dim_feedforward 1024, dropout 0.1, "
        "batch_first) on features, mean-pooled, Linear(256, 10); batch 32, sequence 64, AdamW",
    ),
    "small-gpt": WorkloadSpec(
        "small-gpt",
        "small GPT-style decoder (4 pre-norm causal layers, d_model 192, 4 heads, vocab 512), "
        "batch 8, sequence 64, AdamW",
    ),
    "gpt": WorkloadSpec(
        "gpt",
        "GPT-style decoder (24 pre-norm causal layers, d_model 1024, 16 heads, vocab 32000, "
        "0.34 B parameters), batch 8, sequence 512, bf16 autocast, fused AdamW",
        cuda_only=True,
    ),
    **{
        name: WorkloadSpec(name, description, extra=True)
        for name, description in _extra_workloads.DESCRIPTIONS.items()
    },
}


@dataclass(slots=True)
class Workload:
    """A built workload: call ``step()`` for one optimizer step; it returns the detached loss."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    batches: list[tuple[torch.Tensor, torch.Tensor]]
    loss_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    autocast: Callable[[], contextlib.AbstractContextManager[object]]
    _cursor: int = 0

    def step(self) -> torch.Tensor:
        """One training step on the next batch of the pool."""
        inputs, targets = self.batches[self._cursor % len(self.batches)]
        self._cursor += 1
        self.optimizer.zero_grad(set_to_none=True)
        with self.autocast():
            loss = self.loss_fn(self.model, inputs, targets)
        loss.backward()
        self.optimizer.step()
        return loss.detach()


class EncoderClassifier(nn.Module):
    """The reference workload: an ``nn.TransformerEncoder`` over features, mean-pooled, classified."""

    def __init__(self, *, width: int, heads: int, layers: int, ff: int, classes: int) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(width, heads, ff, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, classes)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(features).mean(dim=1))


class GPT(nn.Module):
    """A GPT-style decoder: learned positions, pre-norm causal blocks, a tied LM head."""

    def __init__(self, *, vocab: int, width: int, heads: int, layers: int, context: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Embedding(context, width)
        block = nn.TransformerEncoderLayer(
            width,
            heads,
            4 * width,
            dropout=0.0,
            activation="gelu",
            batch_first=True,
            norm_first=True,
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight
        for table in (self.embed, self.position):  # GPT-2's init; N(0, 1) would blow up the logits
            nn.init.normal_(table.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        positions = torch.arange(length, device=tokens.device)
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device)
        hidden = self.embed(tokens) + self.position(positions)
        return self.head(self.norm(self.blocks(hidden, mask=mask, is_causal=True)))


def _classification(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


def _language_model(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


def _mlp() -> nn.Module:
    return _extra_workloads.mlp((784, 1024, 1024, 1024, 10), nn.GELU)


def _conv_block(channels_in: int, channels_out: int) -> list[nn.Module]:
    return [
        nn.Conv2d(channels_in, channels_out, 3, padding=1),
        nn.BatchNorm2d(channels_out),
        nn.ReLU(),
    ]


def _cnn() -> nn.Module:
    return nn.Sequential(
        *_conv_block(3, 32),
        nn.MaxPool2d(2),
        *_conv_block(32, 64),
        nn.MaxPool2d(2),
        *_conv_block(64, 128),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(128, 10),
    )


def _features(shape: tuple[int, ...], classes: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(DATA_SEED)
    return [
        (
            torch.randn(shape, generator=generator),
            torch.randint(classes, (shape[0],), generator=generator),
        )
        for _ in range(BATCHES)
    ]


def _tokens(batch: int, length: int, vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(DATA_SEED)
    pool = []
    for _ in range(BATCHES):
        sequence = torch.randint(vocab, (batch, length + 1), generator=generator)
        pool.append((sequence[:, :-1].contiguous(), sequence[:, 1:].contiguous()))
    return pool


def _parts(
    name: str,
) -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]], Callable[..., torch.Tensor]]:
    """The model, the batches and the loss."""
    if name == "mlp":
        return _mlp(), _features((128, 1, 28, 28), 10), _classification
    if name == "cnn":
        return _cnn(), _features((32, 3, 32, 32), 10), _classification
    if name == "transformer":
        model: nn.Module = EncoderClassifier(width=256, heads=8, layers=4, ff=1024, classes=10)
        return model, _features((32, 64, 256), 10), _classification
    if name == "small-gpt":  # the size people debug on
        model = GPT(vocab=512, width=192, heads=4, layers=4, context=64)
        return model, _tokens(8, 64, 512), _language_model
    if name == "gpt":
        model = GPT(vocab=32000, width=1024, heads=16, layers=24, context=512)
        return model, _tokens(8, 512, 32000), _language_model
    if name in _extra_workloads.DESCRIPTIONS:
        return _extra_workloads.parts(name, _features, _tokens)
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")


def build(name: str, device: torch.device) -> Workload:
    """Build workload ``name`` on ``device`` with the fixed seeds."""
    torch.manual_seed(MODEL_SEED)
    model, batches, loss_fn = _parts(name)
    model = model.to(device).train()
    batches = [(x.to(device), y.to(device)) for x, y in batches]
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    return Workload(model, optimizer, batches, loss_fn, _autocast(name, device))


def _autocast(
    name: str, device: torch.device
) -> Callable[[], contextlib.AbstractContextManager[object]]:
    if name == "gpt" and device.type == "cuda":
        return lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext


def parameter_count(model: nn.Module) -> int:
    """Distinct parameters (a tied weight counts once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
