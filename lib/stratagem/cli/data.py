"""The demo's datasets: scikit-learn's digits (shipped in its wheel) or generated blobs.

Nothing is downloaded: ``load_digits`` reads a file inside the installed
scikit-learn package.
"""

from __future__ import annotations

from typing import Literal

import attrs
import torch

from stratagem.errors import UsageError

__all__ = ["DATASETS", "Data", "load"]

DATASETS = ("digits", "synthetic")
NEEDS_SKLEARN = (
    "--data digits needs scikit-learn, which is not installed; "
    "run pip install 'stratagem[demo]', or pass --data synthetic."
)


@attrs.frozen(eq=False)
class Data:
    """A classification task split into train and test tensors (float features, int64 labels)."""

    name: str
    train_inputs: torch.Tensor
    train_targets: torch.Tensor
    test_inputs: torch.Tensor
    test_targets: torch.Tensor

    @property
    def features(self) -> int:
        """Input width."""
        return int(self.train_inputs.shape[1])

    @property
    def classes(self) -> int:
        """Number of labels."""
        return int(self.train_targets.max().item()) + 1


def _split(name: str, inputs: torch.Tensor, targets: torch.Tensor, test: float) -> Data:
    # One fixed shuffle before the split, so test and train are drawn alike.
    order = torch.randperm(len(inputs), generator=torch.Generator().manual_seed(0))
    inputs, targets = inputs[order], targets[order]
    cut = len(inputs) - int(len(inputs) * test)
    return Data(name, inputs[:cut], targets[:cut], inputs[cut:], targets[cut:])


def _digits() -> Data:
    try:
        from sklearn.datasets import load_digits  # type: ignore[import-untyped, import-not-found, unused-ignore]
    except ImportError:
        raise UsageError(NEEDS_SKLEARN) from None
    digits = load_digits()
    inputs = torch.as_tensor(digits.data, dtype=torch.float32) / 16.0  # pixels are 0..16
    targets = torch.as_tensor(digits.target, dtype=torch.int64)
    return _split("digits", inputs, targets, test=0.2)


def _synthetic(samples: int = 2048, features: int = 64, classes: int = 10) -> Data:
    """Gaussian blobs around random centres: learnable, but not in one step."""
    generator = torch.Generator().manual_seed(1)
    centres = torch.randn(classes, features, generator=generator)
    targets = torch.randint(0, classes, (samples,), generator=generator)
    inputs = centres[targets] + 2.0 * torch.randn(samples, features, generator=generator)
    inputs = inputs / inputs.std()  # the scale of the digits' pixels, for the same learning rate
    return _split("synthetic", inputs, targets, test=0.2)


def load(name: Literal["digits", "synthetic"]) -> Data:
    """Load a dataset by name.

    Raises:
        UsageError: ``digits`` without scikit-learn installed (the message names the fix).

    Example:
        >>> data = load("synthetic")
        >>> data.features, data.classes, len(data.train_inputs), len(data.test_inputs)
        (64, 10, 1639, 409)
    """
    return _digits() if name == "digits" else _synthetic()
