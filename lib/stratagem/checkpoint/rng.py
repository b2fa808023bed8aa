"""The random generators a resumed run must continue: Python's, NumPy's, torch's, per rank."""

from __future__ import annotations

import random
from typing import Any, cast

import numpy as np
import torch

__all__ = ["capture", "restore"]


def capture(device: torch.device) -> dict[str, Any]:
    """Return the state of this process's global generators, as values ``weights_only`` reads back.

    Covers ``random``, NumPy's global generator, torch's CPU generator and,
    on a CUDA device, that device's generator.
    """
    version, python_state, gauss = random.getstate()
    legacy = cast(tuple[str, Any, int, int, float], np.random.get_state(legacy=True))
    kind, keys, position, has_gauss, cached = legacy
    state: dict[str, Any] = {
        "python": (version, torch.tensor(python_state, dtype=torch.int64), gauss),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, cached),
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore(state: dict[str, Any], device: torch.device) -> None:
    """Set this process's global generators to a state `capture` returned."""
    version, python_state, gauss = state["python"]
    random.setstate((version, tuple(python_state.tolist()), gauss))
    kind, keys, position, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
