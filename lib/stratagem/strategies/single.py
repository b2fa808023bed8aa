"""``single_device()``: one process, one device, collectives that are identities."""

from __future__ import annotations

import attrs
import torch

from stratagem import checkpoint, collectives, training
from stratagem.devices import DeviceSpec, check_device_spec, resolve_device
from stratagem.env import Context, Env, check_env
from stratagem.errors import LaunchError
from stratagem.launching import in_place
from stratagem.process_group import leave
from stratagem.sharding import keep_loader
from stratagem.strategy import Strategy

__all__ = ["UseDevice", "check_one_process", "keep_loader", "leave", "single_device"]


def check_one_process(env: Env, runs: str) -> None:
    """Refuse a world of more than one process at setup; ``runs`` says what the strategy runs."""
    if check_env(env, "setup").world_size != 1:
        raise LaunchError(
            f"{runs}, but {env.source!r} started a world of {env.world_size}; use ddp() to "
            "train on all of them."
        )


@attrs.frozen
class UseDevice:
    """Setup field of a one-process world: pick the device, join no process group."""

    device: DeviceSpec = "auto"

    def __call__(self, env: Env) -> Context:
        check_one_process(env, "single_device() runs one process")
        device = resolve_device(self.device, env.local_rank, env.local_world_size, warn=True)
        return Context(env=env, device=device)


def single_device(device: DeviceSpec = "auto") -> Strategy:
    """Train in this process on one device.

    Args:
        device: ``"auto"`` (CUDA, then MPS, then CPU), a device string such as
            ``"cpu"`` or ``"cuda:1"``, or a ``torch.device``.

    Returns:
        A `Strategy` whose collectives are identities for a world of one.

    Raises:
        UsageError: ``device`` is not a device specification.

    Example:
        >>> import torch, stratagem as sg
        >>> strategy = sg.single_device("cpu")
        >>> ctx = strategy.setup(sg.Env())
        >>> model = strategy.wrap(torch.nn.Linear(2, 1), ctx)
        >>> strategy.step(model, torch.ones(3, 2), ctx).shape
        torch.Size([3, 1])
    """
    device = check_device_spec(device)
    if isinstance(device, torch.device):
        device = str(device)  # a string keeps the record picklable and its repr short
    return Strategy(
        name="single_device",
        launch=in_place,
        setup=UseDevice(device),
        wrap=training.to_device,
        step=training.step,
        backward=training.backward,
        update=training.update,
        no_sync=training.no_sync,
        reduce=collectives.reduce,
        gather=collectives.gather,
        broadcast=collectives.broadcast,
        barrier=collectives.barrier,
        shard=keep_loader,
        save=checkpoint.save,
        load=checkpoint.load,
        teardown=leave,
    )
