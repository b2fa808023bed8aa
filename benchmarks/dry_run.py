"""dry_run: ``sg.dry_run`` of a 162M-parameter GPT at 8, 64 and 1,024 ranks, and by hand.

**Model.** The GPT of ``examples/gpt/train.py`` at GPT-2-small size (12
blocks of 768, 256 positions, a 50,304-token vocabulary, an untied head:
162.5M parameters), one rank's micro-batch 4 x 256 tokens, AdamW.

**Stacks.** ``fsdp`` over every block; ``hsdp`` with shard groups of 8;
``fsdp x tp`` with tensor parallelism of 8 over each block's MLP (column-wise
into ``c_fc``, row-wise out of ``c_proj``; the attention's fused projection
is left whole).

**Method.** Each dry run is timed whole (world, meta build, wrap, fake
materialisation, three simulated steps), ``runs`` times. For ``fsdp`` the
same work written by hand with the torch pieces (a ``fake`` process group,
``fully_shard`` on the meta device, ``FakeTensorMode``, ``MemTracker`` and
``CommDebugMode`` over one step each after a first) is timed alternately:
the ratio is what the library's record, checks and report cost. The figure,
``dry_run.png`` (copied to ``docs/images/``), stacks rank 0's peak memory by
category against the world size for the three stacks.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import stratagem as sg
from benchmarks.gpt_step import example
from benchmarks.report import Case, Result, compare
from benchmarks.timing import interleave
from stratagem.planning.report import MEMORY_CATEGORIES

NAME = "dry_run"
RANKS = (8, 64, 1024)
BUDGET_S = 30.0  # issue 38: each dry run of this model under 30 s on the 2-core CPU host
RESULTS = Path(__file__).resolve().parent / "results"
DOCS_IMAGES = Path(__file__).resolve().parents[1] / "docs" / "images"


def model() -> torch.nn.Module:
    gpt = example()
    config = gpt.Config(n_layer=12, n_head=12, n_embd=768, block_size=256, dropout=0.0)
    return gpt.GPT(config, 50304)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 50304, (4, 256), generator=torch.Generator().manual_seed(0))
    return tokens, tokens.roll(-1, dims=1)


def loss(module: torch.nn.Module, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return module(*inputs)[1]


def mlp_plan(module: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    for block in module.transformer.h:
        parallelize_module(
            block.mlp, mesh, {"c_fc": ColwiseParallel(), "c_proj": RowwiseParallel()}
        )
    return module


def stacks(world_size: int) -> dict[str, sg.Strategy]:
    blocks = sg.every_module_of(example().Block)
    fsdp = sg.fsdp(device="cpu", shard_when=blocks)
    return {
        "fsdp": fsdp,
        "hsdp": sg.hsdp(device="cpu", replicate=world_size // 8, shard=8, shard_when=blocks),
        "fsdp x tp": sg.tensor_parallel(fsdp, mlp_plan, size=8),
    }


def by_hand(world_size: int) -> None:
    """The fsdp dry run with torch's pieces alone, as the issue measured it."""
    import torch.testing._internal.distributed.fake_pg  # registers "fake"
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.debug import CommDebugMode

    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=world_size)
    try:
        with torch.device("meta"):
            module = model()
        for block in module.transformer.h:
            fully_shard(block)
        fully_shard(module)
        with FakeTensorMode(allow_non_fake_inputs=True) as fake:
            module.to_empty(device="cpu")
            inputs = tuple(fake.from_tensor(t) for t in batch())
            optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)

            def step() -> None:
                loss(module, inputs).backward()
                optimizer.step()
                optimizer.zero_grad()

            step()
            with CommDebugMode():
                step()
            tracker = MemTracker()
            tracker.track_external(module, optimizer)
            with tracker:
                step()
    finally:
        dist.destroy_process_group()


def draw(rows: list[dict[str, Any]], out: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    names = list(dict.fromkeys(row["stack"] for row in rows))
    figure, axes = plt.subplots(1, len(names), figsize=(11, 4), sharey=True)
    for axis, name in zip(axes, names, strict=True):
        mine = [row for row in rows if row["stack"] == name]
        bottom = [0.0] * len(mine)
        labels = [str(row["ranks"]) for row in mine]
        for category in MEMORY_CATEGORIES:
            values = [row["peak"][category] / 2**30 for row in mine]
            if any(values):
                axis.bar(labels, values, bottom=bottom, label=category)
                bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        axis.set_title(name)
        axis.set_xlabel("ranks")
    axes[0].set_ylabel("GiB at rank 0's peak")
    axes[-1].legend(fontsize=8)
    figure.suptitle("sg.dry_run: GPT-2-small (162M), 4 x 256 tokens per rank, AdamW")
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return out


def timed(call: Any) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def timings(
    name: str, strategy: sg.Strategy, world_size: int, runs: int, plans: list[sg.DryRun]
) -> tuple[list[float], list[float]]:
    """Seconds per dry run, and per run by hand (fsdp) or the budget (the others)."""

    def ours() -> None:
        plans.append(sg.dry_run(strategy, model, batch(), world_size=world_size, forward=loss))

    if name != "fsdp":
        return [timed(ours) for _ in range(runs)], [BUDGET_S] * runs
    return interleave(
        lambda: timed(ours), lambda: timed(lambda: by_hand(world_size)), rounds=runs, warmup=0
    )


def run(quick: bool = False) -> Result:
    runs = 1 if quick else 3
    cases: list[Case] = []
    rows: list[dict[str, Any]] = []
    for world_size in RANKS:
        for name, strategy in stacks(world_size).items():
            plans: list[sg.DryRun] = []
            mine, theirs = timings(name, strategy, world_size, runs, plans)
            plan = plans[-1]
            versus = "the same with torch's pieces by hand" if name == "fsdp" else "the 30 s budget"
            cases.append(
                compare(
                    f"dry_run {name} at {world_size} ranks, against {versus}",
                    "s",
                    mine,
                    theirs,
                    target=1.0 if name != "fsdp" else None,
                    notes=(
                        f"held {plan.parameters / 2**20:.1f} MiB params, peak "
                        f"{plan.peak_bytes / 2**30:.2f} GiB, sends {plan.ring_bytes / 2**20:,.0f} "
                        f"MiB/step; {[(c.kind, c.group_size, c.count) for c in plan.collectives]}"
                    ),
                )
            )
            rows.append(
                {
                    "stack": name,
                    "ranks": world_size,
                    "seconds": mine,
                    "parameters": plan.parameters,
                    "optimizer_state": plan.optimizer_state,
                    "peak": dict(plan.peak),
                    "collectives": [
                        [c.kind, c.group_size, c.count, c.bytes, c.ring_bytes]
                        for c in plan.collectives
                    ],
                }
            )
    out = RESULTS / "quick" if quick else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    (out / "dry_run.json").write_text(json.dumps(rows, indent=2) + "\n")
    drawn = draw(rows, out / "dry_run.png")
    if drawn is not None and not quick:
        DOCS_IMAGES.mkdir(exist_ok=True)
        shutil.copy(drawn, DOCS_IMAGES / "dry_run.png")
    return Result(
        benchmark=NAME,
        description=(__doc__ or "").strip().splitlines()[0],
        config={"ranks": RANKS, "runs": runs, "budget_s": BUDGET_S},
        cases=cases,
        quick=quick,
    )
