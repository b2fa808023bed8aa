"""``dp()``: one process driving several GPUs through ``torch.nn.DataParallel``.

``dp()`` is ``single_device()`` with two fields substituted: ``setup`` picks
the first GPU (the CPU when there is none), and ``wrap`` wraps the module in
``DataParallel``, which scatters each batch over the GPUs and gathers the
outputs on the first. Without CUDA, ``DataParallel`` calls the module as it
is, so ``dp()`` still runs (on the CPU) and trains exactly as ``single_device("cpu")``.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch
from torch.nn.parallel import DataParallel

from stratagem import training
from stratagem.devices import cuda_device_count
from stratagem.env import Context, Env
from stratagem.errors import UsageError, describe
from stratagem.strategies.single import check_one_process, single_device
from stratagem.strategy import Strategy
from stratagem.validators import is_int

__all__ = ["UseDataParallelDevices", "WrapDataParallel", "dp"]


def _device_ids(value: object) -> tuple[int, ...] | None:
    if value is None:
        return None
    ids = tuple(value) if isinstance(value, Sequence) and not isinstance(value, str) else None
    if not ids or not all(is_int(i, 0) for i in ids) or len(set(ids)) != len(ids):
        raise UsageError(
            f"'device_ids' must be None (every GPU) or a non-empty list of distinct GPU "
            f"indices, e.g. [0, 1] (got {describe(value)})."
        )
    return ids


@attrs.frozen
class UseDataParallelDevices:
    """Setup field of ``dp()``: one process; its device is the first GPU used, else the CPU."""

    device_ids: tuple[int, ...] | None = attrs.field(default=None, converter=_device_ids)

    def __call__(self, env: Env) -> Context:
        check_one_process(env, "dp() drives every GPU from one process")
        count = cuda_device_count()
        if self.device_ids is None:
            device = torch.device("cuda", 0) if count else torch.device("cpu")
            return Context(env=env, device=device)
        missing = [i for i in self.device_ids if i >= count]
        if missing:
            raise UsageError(
                f"dp(device_ids={list(self.device_ids)}) asks for GPU {missing[0]}, but this "
                f"machine has {count} CUDA device(s); pass device_ids=None to use what there is."
            )
        return Context(env=env, device=torch.device("cuda", self.device_ids[0]))


@attrs.frozen
class WrapDataParallel:
    """Wrap field of ``dp()``: move the module to the first device, wrap it in ``DataParallel``."""

    device_ids: tuple[int, ...] | None = attrs.field(default=None, converter=_device_ids)

    def __call__(self, module: torch.nn.Module, ctx: Context) -> torch.nn.Module:
        module = training.to_device(module, ctx)
        ids = None if self.device_ids is None else list(self.device_ids)
        return DataParallel(module, device_ids=ids)


def dp(*, device_ids: Sequence[int] | None = None) -> Strategy:
    """Train in one process on several GPUs with ``torch.nn.DataParallel``.

    Each step scatters the batch over the GPUs, runs a replica of the module
    on each, and gathers the outputs on the first GPU; gradients are summed
    into the module there. A module whose forward returns a scalar (a loss)
    gives one value per GPU: take their ``.mean()`` in your ``forward``.
    The collectives are those of a world of one. On a machine without CUDA
    it runs on the CPU, equal to ``single_device("cpu")``.

    ``DataParallel`` holds the module as its ``module`` attribute, so torch's
    ``get_model_state_dict(model)`` of the wrapped model has ``module.``-prefixed
    keys (``module.weight``), where ``ddp()`` and ``fsdp()`` give the plain ones.
    Take a state dict of ``sg.unwrap(model)``, the plain module, for the plain
    keys; ``sg.checkpoint.save`` already stores plain keys under every strategy.

    Args:
        device_ids: GPU indices to use, the first one holding the module;
            ``None`` uses every visible GPU (or the CPU when there is none).

    Returns:
        A `Strategy` that runs in place (``launch(..., devices=1)``).

    Raises:
        UsageError: ``device_ids`` is not ``None`` or a non-empty list of
            distinct non-negative ints.

    Example:
        >>> import torch, stratagem as sg
        >>> strategy = sg.dp()
        >>> ctx = strategy.setup(sg.Env())
        >>> model = strategy.wrap(torch.nn.Linear(2, 1), ctx)
        >>> type(model).__name__, strategy.step(model, torch.ones(3, 2), ctx).shape
        ('DataParallel', torch.Size([3, 1]))
        >>> sorted(model.state_dict()), sorted(sg.unwrap(model).state_dict())
        (['module.bias', 'module.weight'], ['bias', 'weight'])
    """
    # Replicas' gradients are summed in backward: no_sync has nothing to defer, as on one device.
    return attrs.evolve(
        single_device(),
        name="dp",
        setup=UseDataParallelDevices(device_ids),  # each converter checks device_ids
        wrap=WrapDataParallel(device_ids),
    )
