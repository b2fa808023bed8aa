"""Throughput and model FLOPs utilisation (MFU) for a training loop to print.

`step_flops` counts the FLOPs of one forward and backward with torch's
``FlopCounterMode`` (matrix multiplies, convolutions, attention: the work MFU
is defined over) and leaves the module as it found it. `rates` turns a step's
time into tokens per second and MFU against a device's peak, given or taken
from `peak_flops`'s table of dense peaks. MFU is per rank: each rank's FLOPs
against one device's peak.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch

from stratagem.errors import UsageError, describe
from stratagem.validators import is_number, refusal, require

__all__ = ["PEAK_FLOPS", "Rates", "peak_flops", "peak_of", "rates", "step_flops"]

PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H200", 989e12),
    ("H100", 989e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("A10G", 70e12),
    ("L4", 121e12),
)
"""Dense 16-bit (bfloat16 and float16) tensor-core peaks, FLOP/s, from the vendors' data
sheets (SXM parts unless named), by a part of the device's name: the first found wins, so the
specific names come first."""


def peak_of(name: str) -> float | None:
    """Return the dense 16-bit peak FLOP/s of the device called ``name``, or None where unknown.

    Example:
        >>> peak_of("NVIDIA H100 80GB HBM3") / 1e12
        989.0
    """
    return next((peak for known, peak in PEAK_FLOPS if known in name), None)


def peak_flops(device: torch.device | str, dtype: torch.dtype = torch.bfloat16) -> float | None:
    """Return the dense peak FLOP/s of ``device`` in ``dtype``, or None where it is not known.

    The table holds 16-bit peaks: for float32 (TF32 or not) pass your own to `rates`.

    Example:
        >>> peak_flops("cpu") is None
        True
    """
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        what = "a torch.device or its name, e.g. 'cuda:0'"
        raise refusal("peak_flops: 'device'", what, device) from None
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return None
    if not torch.cuda.is_available():
        return None
    return peak_of(torch.cuda.get_device_name(device))


def step_flops(
    module: torch.nn.Module,
    batch: Any,
    forward: Callable[[torch.nn.Module, Any], torch.Tensor] | None = None,
) -> int:
    """Return the FLOPs of one forward and backward of ``module`` on ``batch``.

    Pass the plain module (before ``wrap``, or `stratagem.unwrap` of it): a
    wrapped one would run its collectives. ``forward(module, batch)`` returns the
    loss (default: ``module(batch).sum()``). The module is left as it was: its
    gradients, buffers (BatchNorm statistics) and the random generators are put
    back, so a run that counts first trains exactly as one that does not.

    Raises:
        UsageError: ``module`` is not a module, or ``forward`` returns no scalar tensor.
    """
    from torch.utils.flop_counter import FlopCounterMode

    ok = isinstance(module, torch.nn.Module)
    require(ok, "step_flops: 'module'", "a torch.nn.Module", module)
    grads = [(p, p.grad) for p in module.parameters()]
    for parameter, _ in grads:  # backward would add to a held gradient in place
        parameter.grad = None
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    cuda = sorted({t.device.index or 0 for t in module.parameters() if t.is_cuda})
    with torch.random.fork_rng(devices=cuda), FlopCounterMode(display=False) as counter:
        loss = forward(module, batch) if forward is not None else module(batch).sum()
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise UsageError(
                f"step_flops: 'forward' must return the loss, a tensor of one element "
                f"(got {describe(loss)})."
            )
        torch.autograd.backward(loss)
    with torch.no_grad():
        for parameter, grad in grads:
            parameter.grad = grad
        for buffer, saved in buffers:
            buffer.copy_(saved)
    return int(counter.get_total_flops())


@attrs.frozen
class Rates:
    """One step's rates: tokens and FLOPs per second on this rank, and MFU (None: no peak)."""

    tokens_per_second: float
    flops_per_second: float
    mfu: float | None

    def __str__(self) -> str:
        shown = "n/a" if self.mfu is None else f"{self.mfu:.1%}"
        return f"{self.tokens_per_second:,.0f} tokens/s, MFU {shown}"


def rates(*, flops: int, tokens: int, seconds: float, peak: float | None = None) -> Rates:
    """Return the rates of a step of ``flops`` and ``tokens`` (this rank's) that took ``seconds``.

    Raises:
        UsageError: a count is negative, ``seconds`` or ``peak`` is not positive.

    Example:
        >>> str(rates(flops=2 * 10**12, tokens=4096, seconds=0.5, peak=10**13))
        '8,192 tokens/s, MFU 40.0%'
    """
    for name, value in (("flops", flops), ("tokens", tokens)):
        require(is_number(value) and value >= 0, f"rates: '{name}'", "a count >= 0", value)
    require(is_number(seconds, above=0), "rates: 'seconds'", "a number above 0", seconds)
    ok = peak is None or is_number(peak, above=0)
    require(ok, "rates: 'peak'", "FLOP/s above 0 or None", peak)
    achieved = flops / seconds
    return Rates(tokens / seconds, achieved, None if peak is None else achieved / peak)
