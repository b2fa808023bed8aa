"""A save inside an accumulation window is refused: its gradients would be in no checkpoint.

Reported as a sibling of issue 34's first item (stratagem keeping a counter the user also
keeps): ``accumulate`` counts micro-batches in ``ctx.extras["accumulation"]``, which no
checkpoint holds. A save after micro-batch 10 of windows of 4 kept the weights of update 8;
the run resumed with its count at 0 and stepped after micro-batches 14, 18, ... where the
uninterrupted run stepped after 12, 16, ...: different training, without a word.
"""

from __future__ import annotations

import pytest
import torch

import stratagem as sg


def loss_of(module, batch):
    return module(batch).square().mean()


def micro_batch(strategy, model, optimizer, ctx, seed):
    batch = torch.randn(4, 3, generator=torch.Generator().manual_seed(seed))
    strategy.backward(strategy.step(model, batch, ctx, forward=loss_of), model, ctx)
    strategy.update(optimizer, model, ctx)


def test_a_save_between_updates_is_refused_and_one_after_an_update_resumes_exactly(tmp_path):
    strategy = sg.accumulate(sg.single_device("cpu"), 4)

    def run(resume_at=None):
        ctx = strategy.setup(sg.Env())
        torch.manual_seed(0)
        model = strategy.wrap(torch.nn.Linear(3, 2), ctx)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        start = 0
        if resume_at is not None:
            strategy.load(tmp_path / "c", {"model": model, "optimizer": optimizer}, ctx)
            start = resume_at
        for index in range(start, 12):
            micro_batch(strategy, model, optimizer, ctx, index)
            if resume_at is None and index + 1 == 6:
                with pytest.raises(sg.UsageError) as caught:
                    strategy.save(tmp_path / "c", {"model": model, "optimizer": optimizer}, ctx)
                assert str(caught.value) == (
                    "save: 2 of accumulate's 4 micro-batches are backpropagated but not yet "
                    "stepped; their gradients would be in no checkpoint, and a resumed run would "
                    "step after other micro-batches than this one. Save right after an update "
                    "that steps (when the micro-batches so far are a multiple of 4)."
                )
                assert not (tmp_path / "c").exists()  # nothing written
            if resume_at is None and index + 1 == 8:
                strategy.save(tmp_path / "c", {"model": model, "optimizer": optimizer}, ctx)
        return model.weight.detach().clone()

    uninterrupted = run()
    assert torch.equal(run(resume_at=8), uninterrupted)
