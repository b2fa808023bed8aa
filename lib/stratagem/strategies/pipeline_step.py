"""The per-step fields of `pipeline`: step runs the schedule, backward checks, update averages.

A pipeline's training step is one call of the schedule: it runs the forward
and the backward of every micro-batch, interleaved as the schedule orders
them. So ``step`` does both, ``backward`` has nothing left to do (it checks
that it was given the loss ``step`` returned, so an extra loss term is an
error and not silently dropped), and ``update`` averages each stage's
gradients over its data-parallel replicas, then steps the optimizer.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist

from stratagem.env import Context, check_context
from stratagem.errors import UsageError, describe
from stratagem.fields import ForwardFn
from stratagem.replicas import bucketed
from stratagem.strategies.pipeline_loss import FORWARD_NOT_HONOURED
from stratagem.strategies.pipeline_stages import run_of
from stratagem.training import check_module, check_update, move_batch
from stratagem.trees import map_tensors, tensors_in
from stratagem.validators import require

__all__ = [
    "FORWARD_NOT_HONOURED",
    "NEEDS_A_FORWARD",
    "NOT_THE_STEP_LOSS",
    "pipeline_backward",
    "pipeline_no_sync",
    "pipeline_step",
    "pipeline_update",
]

NEEDS_A_FORWARD = (
    "step: a pipeline needs forward=fn(model, batch) -> loss (got forward=None): its step "
    "runs the backward of every micro-batch, so it must compute the loss; pass the forward "
    "your ddp() loop passes, e.g. forward=lambda m, b: mse_loss(m(b[0]), b[1])."
)

NOT_THE_STEP_LOSS = (
    "backward: a pipeline's step already ran the backward of every micro-batch, so backward "
    "accepts only the loss step returned (got {got}); a term added to it afterwards would "
    "never reach the stages' gradients. Compute the whole loss in the forward given to step."
)

_BUCKET_BYTES = 25 * 1024 * 1024  # DDP's default bucket


def _micro_batches(batch: Any, microbatches: int) -> list[Any]:
    wanted = "a pair (inputs, targets) with inputs a tensor, batch first"
    ok = isinstance(batch, (tuple, list)) and len(batch) == 2
    require(ok and isinstance(batch[0], torch.Tensor), "step: 'batch'", wanted, batch)
    rows = batch[0].shape[0] if batch[0].dim() else 0
    sizes = {t.shape[0] if t.dim() else 0 for t in tensors_in(batch)}
    if sizes != {rows}:
        raise UsageError(
            f"step: every tensor of a pipeline's batch must have the batch first, of one size, "
            f"to be split into micro-batches (got leading sizes {sorted(sizes)})."
        )
    if rows % microbatches:
        raise UsageError(
            f"step: pipeline(microbatches={microbatches}) does not divide this batch of {rows} "
            f"rows into equal micro-batches; use a batch size that is a multiple of "
            f"{microbatches}, or a number of micro-batches that divides {rows}."
        )
    size = rows // microbatches
    return [_micro_batch(batch, i * size, size) for i in range(microbatches)]


def _micro_batch(batch: Any, start: int, size: int) -> Any:
    return map_tensors(lambda t: t.narrow(0, start, size), batch)


def _users_own(error: RuntimeError) -> BaseException:
    """Return what the user's module raised, if torch wrapped it; else ``error`` itself.

    A stage wraps any exception of its module's forward in a RuntimeError that
    only says where; under ``ddp()`` the same loop raises the module's own error.
    """
    cause = error.__cause__
    if isinstance(cause, Exception) and "failed to run forward" in str(error):
        where = str(error).strip().splitlines()[0]
        cause.add_note(f"(in the pipeline's schedule: {where})")
        return cause
    return error


def pipeline_step(
    module: torch.nn.Module, batch: Any, ctx: Context, *, forward: ForwardFn | None = None
) -> torch.Tensor:
    """Run one step of the schedule (forward and backward of every micro-batch); return the loss.

    Every rank of a pipeline takes the same batch, ``(inputs, targets)``: the
    first stage feeds ``inputs``, split into micro-batches, and the last stage
    calls ``forward(model, micro_batch)`` on each, with a ``model`` whose call
    returns the pipeline's output for that micro-batch (`FORWARD_NOT_HONOURED`).

    Returns:
        The mean of the micro-batches' losses, detached, on every rank of the
        pipeline (broadcast from the last stage).

    Raises:
        UsageError: ``module`` is not a pipeline's, ``forward`` is missing or does
            not call the model as a pipeline can, or the batch does not split.
    """
    check_module(module, "step")
    check_context(ctx, "step")
    run = run_of(module, "step")
    if forward is None:
        raise UsageError(NEEDS_A_FORWARD)
    require(callable(forward), "step: 'forward'", "a function forward(model, batch)", forward)
    batch = move_batch(batch, ctx.device)
    run.chunks = _micro_batches(batch, run.microbatches)
    run.forward = forward
    losses: list[torch.Tensor] = []
    target = torch.arange(run.microbatches, device=ctx.device) if run.last else None
    inputs = (batch[0],) if run.first else ()
    earlier = _set_aside_gradients(module)
    try:
        run.schedule.step(*inputs, target=target, losses=losses, return_outputs=False)
    except RuntimeError as error:
        raise _users_own(error) from None
    finally:
        run.forward, run.chunks = None, []
        _add_back(earlier)
    if run.last:
        loss = torch.stack([item.detach() for item in losses]).mean()
    else:
        loss = torch.empty((), device=ctx.device, dtype=batch[0].dtype)
    if dist.get_world_size(run.pp_group) > 1:
        dist.broadcast(loss, src=run.last_rank, group=run.pp_group)
    run.loss = loss
    return loss


def _set_aside_gradients(module: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Take away the gradients of earlier steps (two steps before an update accumulate).

    The schedule divides each parameter's whole gradient by the number of
    micro-batches at its end, which would divide an earlier step's again.
    """
    earlier: list[tuple[torch.Tensor, torch.Tensor]] = [
        (p, p.grad) for p in module.parameters() if p.grad is not None
    ]
    for parameter, _ in earlier:
        parameter.grad = None
    return earlier


def _add_back(earlier: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for parameter, grad in earlier:
        if parameter.grad is None:
            parameter.grad = grad
        else:
            parameter.grad.add_(grad)  # earlier + this step's, as autograd accumulates


def pipeline_backward(loss: torch.Tensor, module: torch.nn.Module, ctx: Context) -> None:
    """Check the arguments; the schedule already backpropagated (see `NOT_THE_STEP_LOSS`).

    Raises:
        UsageError: ``module`` is not a pipeline's, ``ctx`` not a `Context`, or
            ``loss`` is not the tensor the last ``step`` returned.
    """
    check_context(ctx, "backward")
    run = run_of(check_module(module, "backward"), "backward")
    if run.loss is None or loss is not run.loss:
        raise UsageError(NOT_THE_STEP_LOSS.format(got=describe(loss)))


def pipeline_update(
    optimizer: torch.optim.Optimizer, module: torch.nn.Module, ctx: Context
) -> None:
    """Average this rank's gradients over its data-parallel replicas, step, clear the gradients.

    Raises:
        UsageError: ``optimizer`` cannot step or holds none of this stage's
            parameters (`OPTIMIZER_NOT_FOR_MODULE`), ``module`` is not a
            pipeline's, or ``ctx`` is not a `Context`.
    """
    check_update(optimizer, module, ctx)
    run = run_of(check_module(module, "update"), "update")
    if run.dp_group is not None:
        grads = [p.grad for p in module.parameters() if p.grad is not None]

        def average(flat: torch.Tensor) -> None:
            dist.all_reduce(flat, group=run.dp_group)  # gloo has no AVG: sum, then divide
            flat.div_(run.dp_size)

        bucketed(grads, _BUCKET_BYTES, average)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def pipeline_no_sync(
    module: torch.nn.Module, ctx: Context
) -> contextlib.AbstractContextManager[None]:
    """No-sync field: nothing to skip, as replicas synchronise in ``update`` only.

    Raises:
        UsageError: ``module`` is not a pipeline's, or ``ctx`` not a `Context`.
    """
    check_context(ctx, "no_sync")
    run_of(check_module(module, "no_sync"), "no_sync")
    return contextlib.nullcontext()
