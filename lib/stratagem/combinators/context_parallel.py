"""``context_parallel``: split each sequence over a ``"cp"`` mesh dimension, for long contexts.

``context_parallel(fsdp(), size=2)`` adds a dimension ``"cp"`` of ``size``
ranks to the mesh (between the data-parallel dimensions and ``"tp"``, as
torchtitan orders them). The ranks of a context-parallel group take the same
batches (``shard`` deals by `Context.data_parallel`); ``step`` gives each of
them a share of every sequence, and each attention call
(``F.scaled_dot_product_attention``) inside the forward gathers the keys and
values of the whole sequence over ``"cp"`` (the all-gather variant of context
parallelism, torchtitan's ``"allgather"`` rotation), masked by the tokens'
positions when it is causal. FSDP shards over ``shard`` and ``cp`` flattened
(`Context.data_mesh`), so gradients average over every rank of a sequence too:
each rank's loss is the mean over its own tokens, and the mean of those is the
whole batch's.

Why not torch's ``context_parallel`` (ring attention): in torch 2.13 it
dispatches only the CUDA attention kernels (flash, memory-efficient, cuDNN),
and it must be active from the forward through the backward, which in a
stratagem loop are two calls (``step``, ``backward``). Gathering keys and
values makes the backward an ordinary autograd graph (the gradient of an
all-gather is a reduce-scatter), so it runs on any device and backend. Its
cost is memory: each rank holds the whole sequence's keys and values, though
queries, activations and the MLPs stay split.

Each sequence is cut into ``2 * size`` chunks and rank ``r`` takes chunks
``r`` and ``2 * size - 1 - r`` (``load_balance=True``, torchtitan's head-tail
order: a causal mask then gives every rank the same work), or one contiguous
chunk each. A model that computes positions itself (``arange(seq_len)``) sees
only its share: give it positions in the batch, or as a buffer named in
``buffers``, which ``step`` splits the same way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import attrs
import torch

from stratagem.combinators._base import (
    CombinatorError,
    check_strategy,
    mesh_under,
    waited,
    with_mesh,
)
from stratagem.env import Context
from stratagem.errors import UsageError
from stratagem.fields import ForwardFn, StepFn
from stratagem.meshes import mesh_with
from stratagem.strategy import Strategy
from stratagem.trees import map_tensors, tensors_in
from stratagem.validators import is_int, require

__all__ = ["ContextParallelStep", "context_parallel", "sequence_positions"]

NOT_ON_A_MESH = (
    "context_parallel: {name!r} does not build a device mesh (its setup is {setup}); context "
    "parallelism adds a 'cp' dimension to the mesh of fsdp()'s setup (JoinMesh), whose wrap "
    "shards over the data-parallel and context-parallel ranks together: "
    "context_parallel(sg.fsdp(), size=2)."
)


def sequence_positions(length: int, rank: int, size: int, load_balance: bool) -> torch.Tensor:
    """Return the positions of a sequence of ``length`` that rank ``rank`` of ``size`` holds.

    Example:
        >>> sequence_positions(8, 0, 2, load_balance=True).tolist()
        [0, 1, 6, 7]
        >>> sequence_positions(8, 1, 2, load_balance=False).tolist()
        [4, 5, 6, 7]
    """
    # The chunks the rank holds: head and tail of 2 * size, or one of size.
    held = (rank, 2 * size - 1 - rank) if load_balance else (rank,)
    chunk = length // (size * len(held))
    return torch.cat([torch.arange(index * chunk, (index + 1) * chunk) for index in held])


def _gather(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """All-gather ``tensor`` over ``group`` along its sequence dimension (-2), with autograd.

    The gradient is a reduce-scatter, a sum over the group's queries; it runs in
    float32 whatever autocast computed (as FSDP's policy reduces in float32),
    since a sum of bfloat16 gradients loses what one process keeps.
    ``torch.distributed.nn.functional.all_gather``'s backward addresses a
    subgroup by global ranks on gloo, so it fails there.
    """
    from torch.distributed._functional_collectives import all_gather_single_autograd

    wide = torch.float32 if tensor.dtype in (torch.bfloat16, torch.float16) else tensor.dtype
    along = tensor.to(wide).contiguous()
    gathered = all_gather_single_autograd(along, gather_dim=along.dim() - 2, group=group)
    return waited(gathered).to(tensor.dtype)


@attrs.define
class _GatheredAttention:
    """``F.scaled_dot_product_attention`` inside a context-parallel forward: whole keys and values.

    ``queries`` and ``keys`` are the sequence positions of this rank's queries
    and of the gathered keys, in order (the causal mask compares them).
    """

    original: Any
    group: Any
    queries: torch.Tensor
    keys: torch.Tensor
    calls: int = 0

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        **options: Any,
    ) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        if attn_mask is not None:
            raise UsageError(
                "step: context_parallel splits the sequence, so an attention mask of the "
                f"local shape {tuple(attn_mask.shape)} cannot be placed; use is_causal=True "
                "or no mask."
            )
        if any(isinstance(t, DTensor) for t in (query, key, value)):
            raise UsageError(
                "step: context_parallel gathers plain tensors; a tensor-parallel plan "
                "passes DTensors to attention here: give its styles use_local_output=True."
            )
        length = query.size(-2)
        if length != self.queries.numel():
            raise UsageError(
                f"step: attention over {length} positions, but this rank holds "
                f"{self.queries.numel()} of each sequence; context_parallel splits the batch's "
                "sequence dimension (its 'seq_dim'), which must be attention's."
            )
        keys, values = _gather(key, self.group), _gather(value, self.group)
        mask = None
        if is_causal:
            mask = self.queries.to(query.device)[:, None] >= self.keys.to(query.device)[None, :]
        self.calls += 1
        out: torch.Tensor = self.original(
            query, keys, values, attn_mask=mask, dropout_p=dropout_p, **options
        )
        return out


@contextlib.contextmanager
def _attention_gathered(group: Any, queries: torch.Tensor, keys: torch.Tensor) -> Iterator[None]:
    """Route ``F.scaled_dot_product_attention`` through `_GatheredAttention` for the block.

    torch's own ``context_parallel`` reaches attention the same way (it
    replaces the function in ``torch.nn.functional``), so a model must call it
    as ``F.scaled_dot_product_attention``, not by a name imported earlier.
    """
    functional = torch.nn.functional
    original = functional.scaled_dot_product_attention
    gathered = _GatheredAttention(original, group, queries, keys)
    functional.scaled_dot_product_attention = gathered  # type: ignore[assignment]
    try:
        yield
    finally:
        functional.scaled_dot_product_attention = original
    if not gathered.calls:
        raise UsageError(
            "step: the forward under context_parallel called no "
            "torch.nn.functional.scaled_dot_product_attention, so no rank saw the whole "
            "sequence: attention written by hand (softmax(q @ k.T)) or called by a name "
            "imported before the step attends only to this rank's share; call "
            "F.scaled_dot_product_attention in the model."
        )


@contextlib.contextmanager
def _split_buffers(
    module: torch.nn.Module, buffers: Mapping[str, int], positions: torch.Tensor, length: int
) -> Iterator[None]:
    """Hold this rank's share of each named buffer in ``module`` for the block's duration."""
    from stratagem.checkpoint.entries import unwrap

    root = unwrap(module)
    kept: list[tuple[torch.nn.Module, str, torch.Tensor]] = []
    try:
        for name, dim in buffers.items():
            owner_name, _, leaf = name.rpartition(".")
            try:
                owner = root.get_submodule(owner_name)
                whole = dict(owner.named_buffers(recurse=False)).get(leaf)
            except AttributeError:
                whole = None
            if whole is None:
                raise UsageError(
                    f"step: context_parallel(buffers=...) names {name!r}, which is no buffer "
                    f"of the model (its buffers: {[n for n, _ in root.named_buffers()]}); use "
                    "a name model.named_buffers() gives."
                )
            if whole.dim() <= dim or whole.size(dim) != length:
                raise UsageError(
                    f"step: context_parallel(buffers=...) splits buffer {name!r} of shape "
                    f"{tuple(whole.shape)} along dim {dim}, which must hold the batch's "
                    f"{length} sequence positions; name the buffer's sequence dimension, or "
                    "check the strategy's seq_dim."
                )
            kept.append((owner, leaf, whole))
            # setattr on a buffer's name replaces the buffer (persistent or not, as it was)
            setattr(owner, leaf, whole.index_select(dim, positions.to(whole.device)))
        yield
    finally:
        for owner, leaf, whole in kept:
            setattr(owner, leaf, whole)


@attrs.frozen
class ContextParallelStep:
    """Step field: run ``inner`` on this rank's share of each sequence, attention gathered.

    Attributes:
        inner: the step it wraps.
        seq_dim: the sequence dimension of every tensor in a batch.
        buffers: module buffers (names, as ``named_buffers`` gives them) to their
            sequence dimension, split the same way for the forward.
        load_balance: head-tail chunks (``True``) or one contiguous chunk per rank.
    """

    inner: StepFn
    seq_dim: int = 1
    buffers: tuple[tuple[str, int], ...] = ()
    load_balance: bool = True
    in_reference: ClassVar[bool] = False  # it distributes: the reference sees whole sequences
    # Attention per share of the queries sums in another order than one process (the kit's
    # low-precision margins widen for it).
    reorders_model_sums: ClassVar[bool] = True

    def __call__(
        self, module: torch.nn.Module, batch: Any, ctx: Context, *, forward: ForwardFn | None = None
    ) -> Any:
        mesh, names = mesh_with(ctx, "cp", "step", "context_parallel")
        group_mesh = mesh[names.cp]
        group = group_mesh.get_group()
        size, rank = group_mesh.size(), group_mesh.get_local_rank()
        length = self._length(batch, size)
        mine = sequence_positions(length, rank, size, self.load_balance)
        every = torch.cat([sequence_positions(length, r, size, self.load_balance)
                           for r in range(size)])  # fmt: skip
        share = map_tensors(lambda t: t.index_select(self.seq_dim, mine.to(t.device)), batch)
        with (
            _split_buffers(module, dict(self.buffers), mine, length),
            _attention_gathered(group, mine, every),
        ):
            output = self.inner(module, share, ctx, forward=forward)
        order = torch.argsort(every)
        return map_tensors(lambda t: self._whole(t, group, mine.numel(), order), output)

    def _whole(self, tensor: torch.Tensor, group: Any, share: int, order: torch.Tensor) -> Any:
        """Return what one process would have: a loss's value averaged, a sequence gathered.

        A scalar (a mean over this rank's tokens) keeps its gradient, and its
        value becomes the mean over the group's ranks, the whole sequence's
        mean. A tensor along the sequence is gathered whole, in order; its
        gradient then sums over the group, which the data mesh's average
        over ``cp`` makes the whole sequence's gradient again.
        """
        from torch.distributed import _functional_collectives as funcol

        if tensor.dim() == 0 and tensor.is_floating_point():
            total = waited(funcol.all_reduce(tensor.detach(), "sum", group))
            return tensor + (total / torch.distributed.get_world_size(group) - tensor.detach())
        if tensor.dim() > self.seq_dim and tensor.size(self.seq_dim) == share:
            along = tensor.movedim(self.seq_dim, 0).contiguous()
            gathered = waited(funcol.all_gather_single_autograd(along, gather_dim=0, group=group))
            return gathered.index_select(0, order.to(tensor.device)).movedim(0, self.seq_dim)
        return tensor

    def _length(self, batch: Any, size: int) -> int:
        tensors = list(tensors_in(batch))
        lengths = {t.size(self.seq_dim) if t.dim() > self.seq_dim else None for t in tensors}
        if not tensors or None in lengths or len(lengths) != 1:
            shapes = [tuple(t.shape) for t in tensors]
            raise UsageError(
                f"step: context_parallel splits every tensor of a batch along seq_dim="
                f"{self.seq_dim}, which needs tensors with one length there (got shapes "
                f"{shapes}); put the sequences' dimension at seq_dim, and anything else in "
                "the module."
            )
        length = lengths.pop()
        assert length is not None
        chunks = 2 * size if self.load_balance else size
        if length % chunks:
            fix = "or load_balance=False" if self.load_balance and length % size == 0 else ""
            raise UsageError(
                f"step: context_parallel cuts a sequence of {length} into {chunks} equal "
                f"chunks ({size} ranks{', two chunks each' if self.load_balance else ''}); "
                f"use a length divisible by {chunks}{' ' + fix if fix else ''}."
            )
        return length


def context_parallel(
    strategy: Strategy,
    *,
    size: int = 2,
    seq_dim: int = 1,
    buffers: Mapping[str, int] | None = None,
    load_balance: bool = True,
) -> Strategy:
    """Split every sequence over ``size`` ranks: attention over the whole, the rest on a share.

    Fields touched: ``setup`` (the mesh gains a dimension ``"cp"`` of ``size``
    ranks, before ``"tp"``; ``ctx.data_parallel`` is then the world over
    ``"cp"``, and `Context.data_mesh`, what FSDP shards over, flattens
    ``shard`` and ``cp``) and ``step`` (`ContextParallelStep`). Composes with
    `tensor_parallel` in either order, and with the other combinators in any
    order (their setup layers stay around the mesh's).

    Args:
        strategy: an ``fsdp()`` or ``hsdp()`` strategy (possibly tensor
            parallel), its ``wrap`` possibly substituted.
        size: ranks per context-parallel group; must divide the data-parallel world.
        seq_dim: the sequence dimension of every tensor in a batch (``(batch,
            seq)`` tokens and targets: 1).
        buffers: module buffers with a sequence dimension (rotary tables:
            ``{"freqs_cis": 0}``), split the same way while the forward runs.
        load_balance: cut each sequence into ``2 * size`` chunks and give rank
            ``r`` chunks ``r`` and ``2 * size - 1 - r``, so a causal mask leaves
            every rank the same work; ``False``: one contiguous chunk each.

    Raises:
        UsageError: an argument is malformed.
        CombinatorError: ``strategy``'s setup (under the layers of other
            combinators) builds no mesh, or it is already context parallel.
    """
    check_strategy(strategy, "context_parallel")
    require(is_int(size, 2), "context_parallel: 'size'", "an int of at least 2", size)
    require(is_int(seq_dim, 0), "context_parallel: 'seq_dim'", "a non-negative int", seq_dim)
    require(
        isinstance(load_balance, bool), "context_parallel: 'load_balance'", "a bool", load_balance
    )
    named = dict(buffers or {})
    for name, dim in named.items():
        require(isinstance(name, str) and bool(name), "context_parallel: a key of 'buffers'",
                "a buffer's name", name)  # fmt: skip
        require(is_int(dim, 0), f"context_parallel: buffers[{name!r}]", "a non-negative int", dim)
    under = mesh_under(strategy, "context_parallel", ContextParallelStep, NOT_ON_A_MESH)
    if under[1].expert_parallel > 1:
        raise CombinatorError(
            f"context_parallel: {strategy.name!r} is expert parallel, beside which sequences "
            "are not split yet; use one of the two."
        )
    step = ContextParallelStep(strategy.step, seq_dim, tuple(named.items()), load_balance)
    return with_mesh(strategy, under, f"cp{size}", {"context_parallel": size}, step=step)
