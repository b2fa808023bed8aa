"""The loss of a pipeline's step: the user's ``forward``, run on the last stage per micro-batch.

The schedule calls its loss function with the last stage's output and the
micro-batch's index; `MicroLoss` hands the user's ``forward`` a stand-in
``model`` whose call returns that output (`FORWARD_NOT_HONOURED` says what
the forward may do with it), so the forward of a ``ddp()`` loop serves as it is.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from stratagem.errors import UsageError
from stratagem.training import check_loss

__all__ = ["FORWARD_NOT_HONOURED", "MicroLoss", "micro_loss"]

FORWARD_NOT_HONOURED = (
    "step: under a pipeline, forward(model, batch) runs on the last stage once per "
    "micro-batch, and its 'model' stands for the whole pipeline applied to the micro-batch's "
    "inputs (batch[0]); it must call model(batch[0]) exactly once, with nothing else, "
    "and compute the loss from the result ({what}). Move work on the inputs into the module."
)


@attrs.define
class _PipelineOutput:
    """What the user's forward sees as ``model`` on the last stage: a call gives the output."""

    output: Any
    inputs: torch.Tensor
    calls: int = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) != 1 or kwargs or args[0] is not self.inputs:
            raise UsageError(
                FORWARD_NOT_HONOURED.format(what="it called model with other arguments")
            )
        self.calls += 1
        if self.calls > 1:
            raise UsageError(FORWARD_NOT_HONOURED.format(what="it called model twice"))
        return self.output


def micro_loss(run: Any, output: Any, index: int) -> torch.Tensor:
    """Return the user's forward's loss on micro-batch ``index``, given the last stage's output."""
    chunk = run.chunks[index]
    stand_in = _PipelineOutput(output, chunk[0])
    assert run.forward is not None  # set by step for the schedule it runs
    loss = run.forward(stand_in, chunk)  # a stand-in for the module
    if stand_in.calls != 1:
        raise UsageError(FORWARD_NOT_HONOURED.format(what="it never called model"))
    return check_loss(loss, "step (the loss forward returned)")


@attrs.frozen
class MicroLoss:
    """The schedule's loss function: the user's forward on one micro-batch of the step."""

    run: Any  # the PipelineRun of the step (pipeline_stages imports this module)

    def __call__(self, output: Any, index: torch.Tensor) -> torch.Tensor:
        return micro_loss(self.run, output, int(index[0]))
