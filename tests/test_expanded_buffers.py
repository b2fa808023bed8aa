"""A module holding an ``expand``-ed buffer: wrap says so on every rank instead of corrupting memory.

Such a buffer (``linspace(...)[:, None].expand(n, d)``, common for position
tables) has elements that share memory. Copying rank 0's values into it made
gloo write past the buffer's storage under fsdp() (a segmentation fault when
the mesh had a context-parallel dimension) and raised torch's bare "more than
one element of the written-to tensor" under ddp().
"""

from __future__ import annotations

import pytest
import torch

import stratagem as sg
from stratagem.replicas import check_writable


class Expanded(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.register_buffer("table", torch.linspace(0, 1, 8)[:, None].expand(8, 4))


def test_an_expanded_buffer_is_named_and_a_copy_of_it_is_not():
    with pytest.raises(sg.UsageError, match=r"wrap: 'table' of shape \(8, 4\) is an expanded view "
                       r"\(stride \(1, 0\)\).*\.expand\(\.\.\.\)\.clone\(\)"):  # fmt: skip
        check_writable(Expanded(), "wrap")
    copied = Expanded()
    copied.table = copied.table.clone()
    check_writable(copied, "wrap")  # no error


def wrap_each(strategy, ctx) -> dict[str, str]:
    errors = {}
    for name, other in {
        "fsdp": strategy,
        "ddp": sg.ddp(device="cpu"),
        "allreduce": sg.allreduce_grads(device="cpu"),
    }.items():
        try:
            other.wrap(Expanded(), ctx)
            errors[name] = "no error"
        except sg.UsageError as error:
            errors[name] = str(error)
    return errors


@pytest.mark.slow
def test_every_wrap_that_copies_rank_zeros_tensors_refuses_it_on_every_rank():
    for errors in sg.launch(wrap_each, sg.context_parallel(sg.fsdp_spawn(device="cpu")), devices=2):
        for name, error in errors.items():
            assert "'table' of shape (8, 4) is an expanded view" in error, name
