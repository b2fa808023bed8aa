"""Train until preempted: ``python preemptible.py RUN_DIR {spawn|single} [UNTIL]``.

The loop runs inside ``sg.on_preemption()``; at the signal every rank finishes
its step, the world saves ``RUN_DIR/checkpoints/step_N`` and exits with the
code `sg.Preempted` documents. Rank 0 marks ``RUN_DIR/ready`` once it has
trained a few steps (so the test signals a running loop) and writes the step
it stopped at to ``RUN_DIR/preempted_at``. With UNTIL, a run that is not
preempted stops after step UNTIL and writes ``RUN_DIR/resumed_from``. Every rank writes
its pid to ``RUN_DIR/pid_RANK``. With ``PREEMPTIBLE_BACKGROUND=1`` in the environment the
run saves in the background, every other step and at the signal.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

import stratagem as sg


def train(strategy: sg.StrategyLike, ctx: sg.Context, run_dir: str, until: int) -> int:
    run = Path(run_dir)
    run.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = strategy.wrap(torch.nn.Linear(8, 2), ctx)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = TensorDataset(torch.randn(64, 8, generator=torch.Generator().manual_seed(1)))
    loader = strategy.shard(DataLoader(data, batch_size=4, shuffle=True), ctx)
    state = {"model": model, "optim": optimizer, "step": 0}
    if isinstance(loader, sg.ShardedLoader):  # single_device keeps the plain DataLoader
        state["loader"] = loader
    step = resumed = sg.resume_or_start(run / "checkpoints", state, strategy, ctx)["step"]
    (run / f"pid_{ctx.rank}").write_text(str(os.getpid()))
    background = os.environ.get("PREEMPTIBLE_BACKGROUND") == "1"
    with sg.on_preemption() as preemption:
        while not until or step < until:
            for (inputs,) in loader:
                loss = strategy.step(model, inputs, ctx).pow(2).mean()
                strategy.backward(loss, model, ctx)
                strategy.update(optimizer, model, ctx)
                step += 1
                if ctx.is_main and step == resumed + 3:
                    (run / "ready").write_text("")
                stopping = preemption.requested(ctx)
                state["step"] = step
                path = run / "checkpoints" / f"step_{step:06d}"
                if background and (stopping or step % 2 == 0):
                    # The last one too: teardown waits for it to commit.
                    sg.checkpoint.save(path, state, ctx, blocking=False)
                elif stopping:
                    strategy.save(path, state, ctx)
                if stopping:
                    if ctx.is_main:
                        (run / "preempted_at").write_text(str(step))
                    preemption.exit()
                if step == until:
                    break
    if ctx.is_main:
        (run / "resumed_from").write_text(str(resumed))
    return step


if __name__ == "__main__":
    run_dir, mode = sys.argv[1], sys.argv[2]
    until = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    if mode == "spawn":
        strategy = sg.ddp_spawn(device="cpu", start=sg.Spawn(stop_grace=60.0))
        sg.launch(train, strategy, devices=2, args=(run_dir, until))
    else:
        sg.launch(train, sg.single_device("cpu"), args=(run_dir, until))
