"""Hypothesis search strategies for the kit: modules, batches, ops, environments, records.

The only module of stratagem that imports hypothesis. Every function takes
keyword-only parameters and returns a ``SearchStrategy``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from hypothesis import strategies as st

from stratagem.combinators import accumulate, with_clipping, with_precision
from stratagem.fields import REDUCE_OPS, ReduceOp
from stratagem.strategy import Strategy

__all__ = ["batches", "envs", "modules", "reduce_ops", "strategies"]


def reduce_ops(*, floating: bool = True) -> st.SearchStrategy[ReduceOp]:
    """Reduce ops valid for a dtype class: all four for floats, no ``"mean"`` for integers."""
    return st.sampled_from([op for op in REDUCE_OPS if floating or op != "mean"])


@st.composite
def _mlp(draw: st.DrawFn, inputs: int, max_hidden: int, with_buffers: bool) -> torch.nn.Module:
    widths = draw(st.lists(st.integers(1, max_hidden), min_size=0, max_size=2))
    outputs = draw(st.integers(1, 4))
    torch.manual_seed(draw(st.integers(0, 2**16)))
    layers: list[torch.nn.Module] = []
    previous = inputs
    for width in widths:
        layers += [torch.nn.Linear(previous, width), torch.nn.Tanh()]
        previous = width
    layers.append(torch.nn.Linear(previous, outputs))
    module = torch.nn.Sequential(*layers)
    if with_buffers and draw(st.booleans()):
        # A buffer registered on a plain Sequential: it travels through state dicts,
        # broadcasts and checkpoints, without batch statistics that differ per rank.
        module.register_buffer("marker", torch.arange(draw(st.integers(1, 4)), dtype=torch.float32))
    return module


@st.composite
def _convnet(draw: st.DrawFn, inputs: int, max_hidden: int) -> torch.nn.Module:
    channels = draw(st.integers(1, max(1, max_hidden // 4)))
    torch.manual_seed(draw(st.integers(0, 2**16)))
    return torch.nn.Sequential(
        torch.nn.Unflatten(1, (1, inputs)),
        torch.nn.Conv1d(1, channels, kernel_size=1),
        torch.nn.Tanh(),
        torch.nn.Flatten(),
        torch.nn.Linear(channels * inputs, draw(st.integers(1, 4))),
    )


def modules(
    *, inputs: int = 4, max_hidden: int = 16, with_buffers: bool = True, convnets: bool = True
) -> st.SearchStrategy[torch.nn.Module]:
    """Small seeded modules taking ``(batch, inputs)`` float tensors: MLPs, optionally 1-D convnets.

    Every module is built from ``torch.nn`` classes, so it pickles to spawned
    ranks. With ``with_buffers``, some carry a buffer (``marker``).
    """
    options = [_mlp(inputs, max_hidden, with_buffers)]
    if convnets:
        options.append(_convnet(inputs, max_hidden))
    return st.one_of(options)


@st.composite
def _batch(draw: st.DrawFn, inputs: int, rows: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    scale = draw(st.sampled_from([0.1, 1.0, 10.0]))
    return torch.randn(rows, inputs, generator=generator) * scale


def batches(
    *, inputs: int = 4, world_size: int = 2, max_rows_per_rank: int = 4
) -> st.SearchStrategy[torch.Tensor]:
    """Float batches of shape ``(world_size * k, inputs)``: every rank gets an equal share."""
    return st.integers(1, max_rows_per_rank).flatmap(lambda k: _batch(inputs, world_size * k))


@st.composite
def _placed(draw: st.DrawFn, names: tuple[str, str, str, str]) -> tuple[dict[str, str], int, int]:
    """Place a rank in a world of up to 4 nodes of up to 8 ranks each.

    Returns its rank, local rank, world size and node under ``names``, with the
    world's node count and ranks per node (each launcher spells those its own way).
    """
    nodes, per_node = draw(st.integers(1, 4)), draw(st.integers(1, 8))
    node, local = draw(st.integers(0, nodes - 1)), draw(st.integers(0, per_node - 1))
    place = (node * per_node + local, local, nodes * per_node, node)
    return {name: str(value) for name, value in zip(names, place, strict=True)}, nodes, per_node


@st.composite
def _torchrun(draw: st.DrawFn) -> dict[str, str]:
    placed, _, per_node = draw(_placed(("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK")))
    return {
        **placed,
        "LOCAL_WORLD_SIZE": str(per_node),
        "MASTER_ADDR": draw(st.sampled_from(["127.0.0.1", "node0", "10.0.0.1"])),
        "MASTER_PORT": str(draw(st.integers(1, 65535))),
        "TORCHELASTIC_RUN_ID": "run",
    }


@st.composite
def _slurm(draw: st.DrawFn) -> dict[str, str]:
    names = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_NODEID")
    placed, nodes, per_node = draw(_placed(names))
    return {
        **placed,
        "SLURM_NTASKS_PER_NODE": f"{per_node}(x{nodes})",
        "SLURM_NODELIST": "gpu[001-004]",
        "SLURM_JOB_ID": str(draw(st.integers(1, 10**7))),
        "SLURM_JOB_NAME": "train",
    }


def _corrupted(valid: st.SearchStrategy[dict[str, str]]) -> st.SearchStrategy[dict[str, str]]:
    bad_values = st.one_of(
        st.text(alphabet="abcxyz.-", min_size=1, max_size=5),
        st.integers(-100, -1).map(str),
        st.just(""),
    )

    @st.composite
    def corrupt(draw: st.DrawFn) -> dict[str, str]:
        environ = draw(valid)
        numeric = sorted(k for k, v in environ.items() if v.isdigit() and k not in ("MASTER_PORT",))
        key = draw(st.sampled_from(numeric))
        if draw(st.booleans()):
            environ[key] = draw(bad_values)
        elif "RANK" in environ:
            environ["RANK"] = str(int(environ["WORLD_SIZE"]) + draw(st.integers(0, 5)))
        else:
            environ["SLURM_PROCID"] = str(int(environ["SLURM_NTASKS"]) + draw(st.integers(0, 5)))
        return environ

    return corrupt()


def envs(*, valid: bool = True) -> st.SearchStrategy[Mapping[str, str]]:
    """Environments as torchrun/TorchElastic or SLURM set them; ``valid=False`` gives broken ones.

    A broken environment has a malformed value (not an integer, negative,
    empty) or a rank at or above the world size: `detect_env` must raise
    ``EnvError`` naming the variable.
    """
    launchers = st.one_of(_torchrun(), _slurm())
    return launchers if valid else _corrupted(launchers)


Combinator = Callable[[Strategy], Strategy]

_COMBINATORS: dict[str, Combinator] = {
    "bf16-mixed": lambda s: with_precision(s, "bf16-mixed"),
    "64-true": lambda s: with_precision(s, "64-true"),
    "clip": lambda s: with_clipping(s, max_norm=1e6),
    "accumulate": lambda s: accumulate(s, 1),
}


def strategies(
    *,
    bases: Mapping[str, Callable[[], Strategy]] | None = None,
    combinators: Mapping[str, Combinator] | None = None,
    max_stack: int = 3,
) -> st.SearchStrategy[Strategy]:
    """Built-in strategies with a stack of distinct combinators applied in a random order.

    Args:
        bases: factories to start from (default: ``single_device("cpu")``).
        combinators: named ``Strategy -> Strategy`` functions to stack (default:
            bf16-mixed, 64-true, clipping, accumulation of 1; precisions are
            never stacked together, as ``with_precision`` refuses that).
        max_stack: the most combinators stacked on one base.
    """
    from stratagem.strategies.single import single_device  # here: keeps imports acyclic

    chosen_bases = bases or {"single_device": lambda: single_device("cpu")}
    chosen = dict(combinators or _COMBINATORS)

    @st.composite
    def build(draw: st.DrawFn) -> Strategy:
        strategy = chosen_bases[draw(st.sampled_from(sorted(chosen_bases)))]()
        names = draw(st.lists(st.sampled_from(sorted(chosen)), unique=True, max_size=max_stack))
        precisions = [n for n in names if n in ("bf16-mixed", "64-true")]
        for name in names:
            if name in precisions[1:]:
                continue
            strategy = chosen[name](strategy)
        return strategy

    return build()
