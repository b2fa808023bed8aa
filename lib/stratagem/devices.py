"""Choosing a `torch.device` from what a user wrote and what the machine has."""

from __future__ import annotations

import contextlib

import torch

from stratagem.errors import UsageError, describe

__all__ = ["DeviceSpec", "check_device_spec", "resolve_device"]

DeviceSpec = str | torch.device
"""``"auto"``, a device string such as ``"cpu"`` or ``"cuda:1"``, or a ``torch.device``."""


def check_device_spec(device: object, argument: str = "device") -> DeviceSpec:
    """Validate a device specification at construction, before any process starts.

    Raises:
        UsageError: ``device`` is neither ``"auto"``, a device string, nor a ``torch.device``.
    """
    # isinstance first: an array compared with a str is an array, whose truth value raises.
    if isinstance(device, torch.device) or (isinstance(device, str) and device == "auto"):
        return device
    if isinstance(device, str):
        with contextlib.suppress(RuntimeError):  # not a device name: refused just below
            torch.device(device)
            return device
    raise UsageError(
        f"'{argument}' must be 'auto', a device string such as 'cpu' or 'cuda:0', or a "
        f"torch.device (got {describe(device)})."
    )


def _mps_available() -> bool:
    backend = getattr(torch.backends, "mps", None)
    return backend is not None and bool(backend.is_available())


def resolve_device(device: DeviceSpec, local_rank: int = 0) -> torch.device:
    """Turn a `DeviceSpec` into a device; ``"auto"`` picks ``cuda:local_rank``, MPS, then CPU.

    Raises:
        UsageError: the device names an accelerator this machine does not have.
    """
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank % torch.cuda.device_count())
        if _mps_available():
            return torch.device("mps")
        return torch.device("cpu")
    resolved = torch.device(device)
    available = {"cuda": torch.cuda.is_available, "mps": _mps_available}.get(resolved.type)
    if available is not None and not available():
        raise UsageError(
            f"device {str(resolved)!r} was asked for, but {resolved.type.upper()} is not "
            "available on this machine; use device='cpu' or 'auto'."
        )
    return resolved
