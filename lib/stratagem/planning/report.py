"""`DryRun`: what one rank of a simulated world holds and sends in one optimizer step."""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from stratagem.planning.collectives import CollectiveCount
from stratagem.planning.layout import Layout

__all__ = ["MEMORY_CATEGORIES", "DryRun"]

MEMORY_CATEGORIES = (
    "parameters",
    "buffers",
    "gradients",
    "optimizer state",
    "activations",
    "temporary",
    "other",
)
"""The parts of a rank's peak memory, in the order a `DryRun` shows them."""

_MIB = 2**20


def _mib(count: float) -> str:
    return f"{count / _MIB:,.1f}"


@attrs.frozen(kw_only=True)
class DryRun:
    """One rank's memory and collectives in one optimizer step of a strategy, simulated.

    Made by `dry_run`; ``str()`` of it is a table a person reads.

    Attributes:
        strategy: the strategy's name.
        world_size: ranks in the simulated world.
        rank: the rank simulated (every rank of a symmetric stack is alike).
        micro_batches: step/backward/update calls per optimizer step.
        parameters: bytes of the parameters this rank holds (its shards).
        optimizer_state: bytes of the optimizer state this rank holds.
        peak: bytes at this rank's peak, by category (`MEMORY_CATEGORIES`).
        collectives: the collectives of one optimizer step, by kind and group size.
        layout: how the wrapped model is split (FSDP groups, tensor-parallel layers).
    """

    strategy: str
    world_size: int
    rank: int
    micro_batches: int
    parameters: int
    optimizer_state: int
    peak: Mapping[str, int]
    collectives: tuple[CollectiveCount, ...]
    layout: Layout = attrs.field(factory=Layout)

    @property
    def peak_bytes(self) -> int:
        """Return the rank's peak memory, every category together."""
        return sum(self.peak.values())

    @property
    def ring_bytes(self) -> int:
        """What this rank sends in one optimizer step under bandwidth-optimal collectives."""
        return sum(c.ring_bytes for c in self.collectives)

    def count(self, kind: str) -> int:
        """Return the calls of collective ``kind`` (``"all_gather"``, ...) in one optimizer step."""
        return sum(c.count for c in self.collectives if c.kind == kind)

    def __str__(self) -> str:
        steps = "" if self.micro_batches == 1 else f" of {self.micro_batches} micro-batches"
        lines = [
            f"dry run: {self.strategy}, rank {self.rank} of {self.world_size} (simulated)",
            f"held: parameters {_mib(self.parameters)} MiB, optimizer state "
            f"{_mib(self.optimizer_state)} MiB",
            "",
            f"{'peak memory':<18}{'MiB':>12}",
        ]
        lines += [f"  {name:<16}{_mib(self.peak[name]):>12}" for name in MEMORY_CATEGORIES]
        lines += [f"  {'total':<16}{_mib(self.peak_bytes):>12}", ""]
        lines.append(f"collectives per optimizer step{steps}")
        lines.append(f"  {'kind':<16}{'ranks':>7}{'calls':>7}{'MiB in':>12}{'MiB sent':>12}")
        for c in self.collectives:
            lines.append(
                f"  {c.kind:<16}{c.group_size:>7,}{c.count:>7,}{_mib(c.bytes):>12}"
                f"{_mib(c.ring_bytes):>12}"
            )
        if not self.collectives:
            lines.append("  (none)")
        lines.append(f"  {'sent per rank, at least (ring)':<42}{_mib(self.ring_bytes):>12}")
        return "\n".join(lines)
