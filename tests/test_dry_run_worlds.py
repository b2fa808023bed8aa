"""sg.dry_run against real gloo worlds of 1, 2 and 4 ranks: the same figures, or within the stated bound.

For each stack the real world runs the step a plan simulates, on the same model
and batch: the bytes held (parameter shards and optimizer state) and the
collectives (kind, group size, count, bytes put in, counted at torch's
dispatcher as the real calls pass) must be equal; the peak memory, recorded from
the CPU allocator's events as benchmarks/memory.py does, must bound the plan's
as docs/planning.md states.
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import dry_run_models as M
import stratagem as sg
from stratagem.planning.collectives import CollectiveRecorder
from stratagem.strategies import allreduce_hooks

pytestmark = pytest.mark.slow

# docs/planning.md states this bound: the plan's peak is at most 8 % below the real one and
# at most 1 % above. Measured here: 0.96-1.00 for float32 stacks (0.93 for allreduce_grads),
# 0.93-0.96 under bf16-mixed.
BELOW, ABOVE = 0.92, 1.01


def local_bytes(tensor: torch.Tensor) -> int:
    held = tensor.to_local() if isinstance(tensor, torch.distributed.tensor.DTensor) else tensor
    return held.numel() * held.element_size()


def rank_zero_agrees(clean: bool) -> bool:
    """Rank 0's `clean`, on every rank."""
    flag = torch.tensor([float(clean)])
    if torch.distributed.is_initialized():
        torch.distributed.broadcast(flag, src=0)
    return bool(flag.item())


def real_step(strategy, ctx, micro_batches: int):
    """Rank 0's held bytes, collectives and cleanest peak over one optimizer step, for real."""
    model = strategy.wrap(M.blocks(), ctx)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inputs = M.batch()

    def step() -> None:
        for _ in range(micro_batches):
            loss = strategy.step(model, inputs, ctx, forward=M.loss)
            strategy.backward(loss, model, ctx)
            strategy.update(optimizer, model, ctx)

    step()
    step()  # DDP regroups its buckets in its second step, once: a plan shows the steady step
    recorder = CollectiveRecorder()
    with recorder.recording():
        step()
    parameters = sum(local_bytes(p) for p in model.parameters())
    state = sum(
        local_bytes(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)
    )
    # A tensor freed on a gloo thread is not recorded (benchmarks/memory.py): a step that leaves
    # nothing unreleased is true. Steps run until rank 0 records one (at most 20, as many on
    # every rank since each is collective; a loaded machine loses frees more often).
    records = []
    while len(records) < 20:
        gc.collect()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as recorded:
            step()
        events = [e for e in recorded.profiler.kineto_results.events() if e.name() == "[memory]"]
        live = peak = 0
        for event in sorted(events, key=lambda e: e.start_ns()):
            live += event.nbytes()
            peak = max(peak, live)
        records.append((live, peak))
        if rank_zero_agrees(live == 0):
            break
    _, peak = min(records)
    # DDP's buckets (made by wrap) and allreduce_grads' (by the first step) are held through
    # every step after: no event of the step shows them.
    reducer = getattr(model, "reducer", None)
    ddp_buckets = [] if reducer is None else reducer._get_zeros_like_grad_buckets()
    hooks = allreduce_hooks._HOOKS.get(model)
    flats = [b.buffer() for b in ddp_buckets] + [b.flat for b in (hooks.buckets if hooks else [])]
    held = parameters + state + sum(local_bytes(flat) for flat in flats)
    return parameters, state, recorder.counts(), held + peak, [r[0] for r in records]


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_plans_match_real_worlds(stratagem_world_of, world_size):
    world = stratagem_world_of(world_size)
    for name, (strategy, micro_batches) in M.stacks(world_size).items():
        parameters, state, collectives, peak, unreleased = world.run(
            real_step, strategy, micro_batches
        )[0]
        plan = sg.dry_run(
            strategy,
            M.blocks,
            M.batch(),
            world_size=world_size,
            forward=M.loss,
            micro_batches=micro_batches,
        )
        assert plan.parameters == parameters, name
        assert plan.optimizer_state == state, name
        assert plan.collectives == collectives, name
        assert min(unreleased) == 0, f"{name}: every recorded step lost a free: {unreleased}"
        ratio = plan.peak_bytes / peak
        print(
            f"{world_size} ranks, {name}: plan {plan.peak_bytes:,} B, real {peak:,} B ({ratio:.3f})"
        )
        assert BELOW <= ratio <= ABOVE, (name, plan.peak_bytes, peak)
