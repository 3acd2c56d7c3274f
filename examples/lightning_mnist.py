"""Train a small CNN on MNIST with Lightning and TelemetryMonitor, then read the telemetry.

    uv run examples/lightning_mnist.py                     # downloads MNIST into data/mnist
    uv run examples/lightning_mnist.py --data-dir ~/mnist  # or reads the four IDX files there

When MNIST cannot be fetched (no network) it says so and trains on the real handwritten digits
that ship inside scikit-learn (``load_digits``, 1,797 images of 8x8 pixels) instead, so it runs
offline on a fresh machine. Training takes about two minutes on two CPU cores once the
environment is installed (the first ``uv run`` installs it from uv.lock, PyTorch's CUDA build
included: about 5 GB; see the README for a CPU-only install). Ends by printing where the files
are, how to open TensorBoard, and a per-layer table of the run.
"""

from __future__ import annotations

import argparse
import gzip
import struct
import urllib.request
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchinstruments_core.run_directory import summarize_run
from torchinstruments_lightning import TelemetryMonitor

MNIST_URL = "https://ossci-datasets.s3.amazonaws.com/mnist/"
MNIST_FILES = {
    "train_images": "train-images-idx3-ubyte.gz",
    "train_labels": "train-labels-idx1-ubyte.gz",
    "test_images": "t10k-images-idx3-ubyte.gz",
    "test_labels": "t10k-labels-idx1-ubyte.gz",
}


class SmallCNN(pl.LightningModule):
    """Two conv blocks and an MLP head; works for 28x28 MNIST and 8x8 digits alike."""

    def __init__(self, lr: float = 2e-3) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
        )  # fmt: skip
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(512, 64), nn.ReLU(), nn.Linear(64, 10))
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        images, labels = batch
        loss = nn.functional.cross_entropy(self(images), labels)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> None:
        images, labels = batch
        accuracy = (self(images).argmax(1) == labels).float().mean()
        self.log("val/accuracy", accuracy, prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def load_mnist(folder: Path) -> tuple[TensorDataset, TensorDataset]:
    """Read (downloading first if needed) MNIST's IDX files from ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for name, file in MNIST_FILES.items():
        path = folder / file
        if not path.exists():
            with urllib.request.urlopen(MNIST_URL + file, timeout=15) as response:
                data = response.read()
            path.write_bytes(data)
        arrays[name] = _read_idx(path)
    return (
        _dataset(arrays["train_images"], arrays["train_labels"]),
        _dataset(arrays["test_images"], arrays["test_labels"]),
    )


def _read_idx(path: Path) -> np.ndarray:
    raw = gzip.decompress(path.read_bytes())
    dims = raw[3]
    shape = struct.unpack(f">{dims}I", raw[4 : 4 + 4 * dims])
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def _dataset(images: np.ndarray, labels: np.ndarray) -> TensorDataset:
    x = torch.from_numpy(images.astype(np.float32) / images.max()).unsqueeze(1)
    return TensorDataset((x - 0.5) / 0.5, torch.from_numpy(labels.astype(np.int64)))


def load_digits_fallback() -> tuple[TensorDataset, TensorDataset]:
    """scikit-learn's 8x8 handwritten digits, split 80/20."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images, labels = digits.images.astype(np.float32), digits.target
    order = np.random.default_rng(0).permutation(len(labels))
    split = int(0.8 * len(labels))
    train, test = order[:split], order[split:]
    return _dataset(images[train], labels[train]), _dataset(images[test], labels[test])


def datasets(data_dir: Path) -> tuple[TensorDataset, TensorDataset, str]:
    try:
        train, test = load_mnist(data_dir)
        return train, test, "MNIST"
    except OSError as error:
        print(f"MNIST could not be fetched ({error}); training on scikit-learn's digits instead.")
        train, test = load_digits_fallback()
        return train, test, "scikit-learn digits"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=Path("data/mnist"),
        help="folder of MNIST's four IDX .gz files, downloaded there when missing "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--log-dir",
        type=Path,
        default=Path("runs/lightning_mnist"),
        help="TensorBoardLogger's folder: each run writes version_<n>/ there, telemetry/ inside "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--every-n-steps",
        type=int,
        default=25,
        help="sample every this many optimizer steps (default: %(default)s)",
    )
    parser.add_argument(
        "--max-epochs",
        type=int,
        default=None,
        help="epochs to train (default: 1 on MNIST, limited to 700 batches; 15 on the digits)",
    )
    args = parser.parse_args()

    pl.seed_everything(0, verbose=False)
    train, test, name = datasets(args.data_dir)
    mnist = name == "MNIST"
    logger = TensorBoardLogger(args.log_dir, name="")
    monitor = TelemetryMonitor(every_n_steps=args.every_n_steps)
    trainer = pl.Trainer(
        max_epochs=args.max_epochs or (1 if mnist else 15),
        limit_train_batches=700 if mnist else None,
        accelerator="cpu",
        logger=logger,
        callbacks=[monitor],
        log_every_n_steps=10,
        enable_model_summary=False,
    )
    trainer.fit(
        SmallCNN(),
        DataLoader(train, batch_size=64, shuffle=True),
        DataLoader(test, batch_size=256),
    )
    telemetry = monitor.run_directory
    assert telemetry is not None
    print(f"\ntrained on {name}; telemetry of every {args.every_n_steps}th step in {telemetry}/")
    print("  history.parquet, samples.parquet, result.json, index.md")
    print(f"TensorBoard (loss and telemetry): uv run tensorboard --logdir {logger.log_dir}\n")
    print(summarize_run(telemetry))


if __name__ == "__main__":
    main()
