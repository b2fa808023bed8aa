"""Law pipeline-schedule: every built-in schedule at 8 and 16 stages, a user's own, planted bugs.

The law runs nothing: it reads the order each rank runs its actions in and
simulates the messages between ranks. The order it reads for GPipe and 1F1B is
checked here against the order a real two-rank pipeline runs them in.
"""

from __future__ import annotations

import pytest
import torch

import stratagem as sg
from stratagem.strategies.pipeline_schedules import SCHEDULES
from stratagem.testing.laws import LawViolation, check_pipeline_schedule
from stratagem.testing.laws.pipeline_schedule import compute_order


def ranks_for(schedule: str, stages: int) -> int:
    return stages if not SCHEDULES[schedule].multi else stages // 2


@pytest.mark.parametrize("stages", [8, 16])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_built_in_schedule_holds_the_law(schedule, stages):
    check_pipeline_schedule(
        schedule, size=ranks_for(schedule, stages), stages=stages, microbatches=2 * stages
    )


def test_a_pipeline_strategy_is_checked_for_its_own_schedule_and_split():
    split = [[str(i)] for i in range(8)]
    strategy = sg.pipeline(stages=split, schedule="1f1b", microbatches=8, size=8, device="cpu")
    check_pipeline_schedule(strategy)
    spanning = sg.pipeline(stages=split, schedule="interleaved-1f1b", microbatches=8, device="cpu")
    check_pipeline_schedule(spanning, size=4)
    with pytest.raises(sg.UsageError, match="pass size=N"):
        check_pipeline_schedule(spanning)


def test_a_schedule_of_your_own_holds_the_law_when_it_is_sound():
    gpipe_by_hand = {
        0: ["0F0", "0F1", None, None, "0B0", "0B1"],
        1: [None, "1F0", "1F1", "1B0", "1B1"],
    }
    check_pipeline_schedule(gpipe_by_hand)
    assert compute_order(gpipe_by_hand)[1] == ["1F0", "1F1", "1B0", "1B1"]


def test_a_stage_that_skips_a_backward_breaks_the_law():
    with pytest.raises(LawViolation, match=r"stage 0: expected 2 total backwards"):
        check_pipeline_schedule({0: ["0F0", "0F1", "0B0"], 1: ["1F0", "1F1", "1B0", "1B1"]})


def test_messages_received_out_of_the_order_sent_break_the_law():
    # Lowered by torch, a receive is posted where its send is: rank 1 may run micro-batch 1
    # first. A schedule that lists its own messages runs them as listed.
    check_pipeline_schedule({0: ["0F0", "0F1", "0B1", "0B0"], 1: ["1F1", "1F0", "1B1", "1B0"]})
    crossed = {
        0: ["0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0", "0RECV_B1", "0B1"],
        1: ["1RECV_F1", "1RECV_F0", "1F0", "1B0", "1SEND_B0", "1F1", "1B1", "1SEND_B1"],
    }
    with pytest.raises(
        LawViolation,
        match=r"rank 0's message 1 to rank 1 is stage 0's forward output of micro-batch 0, "
        r"but rank 1's receive 1 from rank 0 expects stage 0's forward output of micro-batch 1",
    ):
        check_pipeline_schedule(crossed)
    in_order = {0: crossed[0], 1: ["1RECV_F0", "1RECV_F1", *crossed[1][2:]]}
    check_pipeline_schedule(in_order)
    unmatched = {0: crossed[0], 1: in_order[1][:-1]}  # the last gradient is never sent
    with pytest.raises(LawViolation, match=r"rank 1's message 2 to rank 0 is nothing more"):
        check_pipeline_schedule(unmatched)


def test_a_schedule_that_waits_on_itself_breaks_the_law():
    # Rank 0 waits for micro-batch 0's gradient, which rank 1 computes only after a forward
    # of micro-batch 1 whose input rank 0 sends after that backward.
    stuck = {0: ["0F0", "0B0", "0F1", "0B1"], 1: ["1F0", "1F1", "1B0", "1B1"]}
    with pytest.raises(
        LawViolation, match=r"never ends: rank 0 waits at 0B0 .* rank 1 waits at 1F1"
    ):
        check_pipeline_schedule(stuck)


def test_torchs_own_listing_of_1f1b_breaks_the_law_and_the_run_does_not():
    # torch 2.13's Schedule1F1B lists the last stage's forwards from micro-batch 1 (its run
    # starts at 0): the listing, given as a schedule of one's own, is caught.
    listed = {0: ["0F0", "0F1", "0B0", "0B1"], 1: [None, "1F1", "1B0", "1F2", "1B1"]}
    with pytest.raises(LawViolation, match=r"Backward for stage 1, micro-batch 0 without first"):
        check_pipeline_schedule(listed)
    check_pipeline_schedule("1f1b", size=2, microbatches=2)


@pytest.mark.parametrize(
    ("schedule", "kwargs", "message"),
    [
        ("2f2b", {"size": 2, "microbatches": 2}, r"unknown schedule '2f2b'; the built-in"),
        ("gpipe", {"size": 2}, r"needs size= .* and microbatches="),
        ("gpipe", {"size": 0, "microbatches": 2}, r"'size' must be None or a positive int, got 0"),
        ("1f1b", {"size": 4, "microbatches": 2}, r"at least as many micro-batches as stages"),
        ({0: ["0F0"], 2: ["1F0"]}, {}, r"keys must be the pipeline ranks 0, 1"),
        ({0: "0F0"}, {}, r"rank 0's actions must be a list of strings"),
        ({0: ["0F0", "0X0"]}, {}, r"rank 0, step 1: '0X0' is not an action"),
        ({0: ["0UNSHARD"]}, {}, r"'0UNSHARD' is not an action"),
        ({0: ["0F0"], 1: ["1F0"]}, {"size": 3}, r"size=3, but the schedule lists 2 ranks"),
        (42, {}, r"'schedule' must be a pipeline\(\) strategy"),
    ],
)
def test_bad_arguments_are_refused_naming_the_fix(schedule, kwargs, message):
    with pytest.raises(sg.UsageError, match=message):
        check_pipeline_schedule(schedule, **kwargs)


# --- the order the law reads is the order a real pipeline runs ---------------------------

TWO = (("0", "1", "2", "3"), ("4", "5", "6"))


def make_mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for inputs, outputs in ((6, 16), (16, 16), (16, 16)):
        layers += [torch.nn.Linear(inputs, outputs), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(16, 2))


def mse(model, batch):
    inputs, targets = batch
    return torch.nn.functional.mse_loss(model(inputs), targets)


def run_order(strategy, ctx) -> list[str]:
    """The forwards and backwards this rank's stages ran in one step, as '1F0', in order."""
    model = strategy.wrap(make_mlp(), ctx)
    order: list[str] = []
    counts: dict[tuple[int, str], int] = {}

    def note(stage: int, kind: str) -> None:
        index = counts.get((stage, kind), 0)
        counts[stage, kind] = index + 1
        order.append(f"{stage}{kind}{index}")

    for stage, names in enumerate(TWO):
        try:
            last = model.get_submodule(names[-1])
        except AttributeError:  # another rank's stage
            continue
        last.register_forward_hook(lambda *_, stage=stage: note(stage, "F"))
        last.register_full_backward_pre_hook(lambda *_, stage=stage: note(stage, "B"))
    generator = torch.Generator().manual_seed(1)
    batch = (torch.randn(8, 6, generator=generator), torch.randn(8, 2, generator=generator))
    for _ in range(2):  # the first step also runs a forward to infer the stages' shapes
        order.clear()
        counts.clear()
        loss = strategy.step(model, batch, ctx, forward=mse)
        strategy.backward(loss, model, ctx)
    return order


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_order_the_law_reads_is_the_order_a_real_pipeline_runs(schedule):
    strategy = sg.pipeline(stages=TWO, schedule=schedule, microbatches=4, timeout=60, device="cpu")
    ran = sg.launch(run_order, sg.spawned(strategy), devices=2)
    assert ran == [compute_order(schedule, size=2, microbatches=4)[rank] for rank in range(2)]
