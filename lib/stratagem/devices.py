"""Choosing a `torch.device` from what a user wrote and what the machine has."""

from __future__ import annotations

import contextlib
import warnings

import torch

from stratagem.errors import UsageError
from stratagem.validators import refusal

__all__ = [
    "FALLS_BACK_TO_CPU",
    "DeviceFallbackWarning",
    "DeviceSpec",
    "asked_device",
    "check_device_spec",
    "cuda_device_count",
    "falls_back_to_cpu",
    "resolve_device",
    "warn_fallback",
]

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
    what = "'auto', a device string such as 'cpu' or 'cuda:0', or a torch.device"
    raise refusal(f"'{argument}'", what, device)


def _mps_available() -> bool:
    backend = getattr(torch.backends, "mps", None)
    return backend is not None and bool(backend.is_available())


class DeviceFallbackWarning(UserWarning):
    """``device="auto"`` put every rank on the CPU: this host has fewer CUDA devices than ranks."""


FALLS_BACK_TO_CPU = (
    "device='auto': this host has {cuda} CUDA device(s) for {ranks} local ranks, so every "
    "rank runs on the CPU (gloo). To train on the GPU(s), launch devices={cuda}; to share "
    "one GPU, pass device='cuda:0', backend='gloo'; to silence this, pass device='cpu'."
)
"""What `DeviceFallbackWarning` says (formatted with ``cuda`` and ``ranks``)."""


def cuda_device_count() -> int:
    """Return how many CUDA devices this process sees (0 where CUDA is not available)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def falls_back_to_cpu(
    device: DeviceSpec | None, local_world_size: int, *, cuda_devices: int | None = None
) -> bool:
    """Return whether ``device`` is ``"auto"`` on a host with CUDA but fewer devices than ranks.

    Args:
        device: what the strategy asks for (``None``: it does not say).
        local_world_size: the ranks on this host.
        cuda_devices: the CUDA devices this host has; ``None`` asks torch.
    """
    if not (isinstance(device, str) and device == "auto"):
        return False
    count = cuda_device_count() if cuda_devices is None else cuda_devices
    return 0 < count < local_world_size


def warn_fallback(
    device: DeviceSpec | None,
    local_world_size: int,
    *,
    cuda_devices: int | None = None,
    stacklevel: int = 2,
) -> None:
    """Warn (`DeviceFallbackWarning`) when `falls_back_to_cpu`; launchers call it once per launch.

    ``stacklevel`` counts from the caller of this function, as in `warnings.warn`.
    """
    count = cuda_device_count() if cuda_devices is None else cuda_devices
    if falls_back_to_cpu(device, local_world_size, cuda_devices=count):
        warnings.warn(
            FALLS_BACK_TO_CPU.format(cuda=count, ranks=local_world_size),
            DeviceFallbackWarning,
            stacklevel=stacklevel + 1,
        )


def asked_device(setup: object) -> DeviceSpec | None:
    """Return the `DeviceSpec` a setup field asks for, looking through the setups it wraps.

    The built-in setups hold it as ``device``; the setups of combinators and
    meshes wrap another as ``inner`` or ``join``. ``None``: a setup that does not say.
    """
    for _ in range(32):  # a chain of wrappers, never a cycle
        device = getattr(setup, "device", None)
        if isinstance(device, (str, torch.device)):
            return device
        setup = getattr(setup, "inner", None) or getattr(setup, "join", None)
        if setup is None:
            return None
    return None


def resolve_device(
    device: DeviceSpec,
    local_rank: int = 0,
    local_world_size: int = 1,
    *,
    cuda_devices: int | None = None,
    warn: bool = False,
    bound_per_task: bool = False,
) -> torch.device:
    """Turn a `DeviceSpec` into the device of local rank ``local_rank`` of ``local_world_size``.

    ``"auto"`` is ``cuda:local_rank`` when this host has a CUDA device for each
    local rank; every rank on the CPU when it has CUDA but fewer devices than
    local ranks (`DeviceFallbackWarning`, if ``warn``); otherwise MPS, then CPU.

    Args:
        device: ``"auto"``, a device string, or a ``torch.device``.
        local_rank: this process's rank on this host.
        local_world_size: the ranks on this host.
        cuda_devices: the CUDA devices this host has; ``None`` asks torch (0
            where CUDA is not available). Tests pass a count here.
        warn: warn on local rank 0 when ``"auto"`` falls back to the CPU (so
            once per host); launchers that warned before starting the ranks pass False.
        bound_per_task: the scheduler gave this process devices of its own (SLURM's
            ``--gpus-per-task`` sets ``CUDA_VISIBLE_DEVICES`` per task): fewer
            devices than local ranks is then no reason for the CPU; its first is used.

    Raises:
        UsageError: the device names an accelerator this machine does not have.

    Example:
        >>> resolve_device("auto", 1, 2, cuda_devices=2)
        device(type='cuda', index=1)
        >>> resolve_device("auto", 1, 2, cuda_devices=1)
        device(type='cpu')
        >>> resolve_device("auto", 1, 2, cuda_devices=1, bound_per_task=True)
        device(type='cuda', index=0)
    """
    if device == "auto":
        count = cuda_device_count() if cuda_devices is None else cuda_devices
        ranks = max(local_world_size, local_rank + 1)
        if count >= ranks:
            return torch.device("cuda", local_rank)
        if count > 0 and bound_per_task:
            return torch.device("cuda", 0)
        if warn and local_rank == 0:  # it warns only where there are CUDA devices, too few
            warn_fallback(device, ranks, cuda_devices=count, stacklevel=2)
        return torch.device("mps" if count == 0 and _mps_available() else "cpu")
    resolved = torch.device(device)
    available = {"cuda": torch.cuda.is_available, "mps": _mps_available}.get(resolved.type)
    if available is not None and not available():
        raise UsageError(
            f"device {str(resolved)!r} was asked for, but {resolved.type.upper()} is not "
            "available on this machine; use device='cpu' or 'auto'."
        )
    return resolved
