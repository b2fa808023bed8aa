"""The model, batch and stacks that the dry-run tests plan and then run for real."""

from __future__ import annotations

import torch

import stratagem as sg
from helpers import Block, block_plan

WIDTH, DEPTH, BATCH, TIME = 32, 3, 4, 8


def blocks() -> torch.nn.Module:
    """A stack of `Block`s: every stack below shards, checkpoints or splits each block."""
    torch.manual_seed(0)
    return torch.nn.Sequential(*(Block(WIDTH) for _ in range(DEPTH)))


def batch() -> torch.Tensor:
    return torch.randn(BATCH, TIME, WIDTH, generator=torch.Generator().manual_seed(1))


def loss(model: torch.nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    return model(inputs).pow(2).mean()


BLOCKS = sg.every_module_of(Block)


def tp_plan() -> dict[str, object]:
    """Megatron's split of every block (`block_plan`), by the paths of the stack."""
    return {f"{i}.{name}": style for i in range(DEPTH) for name, style in block_plan().items()}


def stacks(world_size: int) -> dict[str, tuple[sg.Strategy, int]]:
    """Each stack the tests plan on ``world_size`` ranks, with its micro-batches per step."""
    fsdp = sg.fsdp(device="cpu", shard_when=BLOCKS)
    made = {
        "ddp": (sg.ddp(device="cpu"), 1),
        "ddp, 48 KiB buckets": (sg.ddp(device="cpu", bucket_cap_mb=3 / 64), 1),
        "allreduce_grads": (sg.allreduce_grads(device="cpu", bucket_mb=3 / 64), 1),
        "fsdp": (fsdp, 1),
        "accumulate(fsdp, 2)": (sg.accumulate(fsdp, 2), 2),
        "checkpointed fsdp": (sg.with_activation_checkpointing(fsdp, BLOCKS), 1),
        "bf16-mixed fsdp": (sg.with_precision(fsdp, "bf16-mixed"), 1),
    }
    if world_size % 2 == 0:
        made["fsdp x tp"] = (sg.tensor_parallel(fsdp, tp_plan(), size=2), 1)
    if world_size >= 4:
        made["hsdp"] = (
            sg.hsdp(device="cpu", replicate=2, shard=world_size // 2, shard_when=BLOCKS),
            1,
        )
    return made


def gpt_small() -> torch.nn.Module:
    """A GPT-2-small-sized stack of 162M parameters: embeddings, 12 `Block`s of 768, a head."""
    return Gpt(vocab=50304, width=768, depth=12)


class Gpt(torch.nn.Module):
    def __init__(self, vocab: int, width: int, depth: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.blocks = torch.nn.Sequential(*(Block(width, head=32) for _ in range(depth)))
        self.head = torch.nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))


def gpt_batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 50304, (4, 256), generator=torch.Generator().manual_seed(0))
    return tokens, tokens.roll(-1, dims=1)


def gpt_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    tokens, targets = batch
    return torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())


def gpt_tp_plan() -> dict[str, object]:
    return {f"blocks.{i}.{name}": style for i in range(12) for name, style in block_plan().items()}


def gpt_stacks(world_size: int) -> dict[str, sg.Strategy]:
    """fsdp, hsdp (8-rank shard groups) and FSDP x TP (tp=8) over every block of `gpt_small`."""
    fsdp = sg.fsdp(device="cpu", shard_when=BLOCKS)
    return {
        "fsdp": fsdp,
        "hsdp": sg.hsdp(device="cpu", replicate=world_size // 8, shard=8, shard_when=BLOCKS),
        "fsdp x tp": sg.tensor_parallel(fsdp, gpt_tp_plan(), size=8),
    }
