"""What several test modules share: free ports, a launcher's environment, models, data, contexts."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

import stratagem as sg

LIB = Path(sg.__file__).resolve().parent.parent
# Variables of an enclosing launcher that must not leak into the agents.
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def agent_env(tmp_path: Path) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in LAUNCHER_VARIABLES and not k.startswith(("TORCHELASTIC_", "SLURM_", "MASTER_"))
    }
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(LIB) if not path else os.pathsep.join([str(LIB), path])
    env["GLOO_SOCKET_IFNAME"] = "lo"
    env["OMP_NUM_THREADS"] = "1"
    env["TMPDIR"] = str(tmp_path)
    return env


# ------------------------------------------------------------------- models, data, contexts
# Spawned ranks unpickle what the tests send them by module name; `helpers` is importable there
# as the test modules are (the spawn start method hands the parent's sys.path to the children).


def make_model(
    *,
    seed: int = 7,
    features: int = 6,
    hidden: int = 16,
    outputs: int = 2,
    activation: Callable[[], torch.nn.Module] = torch.nn.Tanh,
    nested: bool = False,
) -> torch.nn.Module:
    """Seed torch's global generator with `seed` and build a two-layer perceptron.

    With `nested`, a ``Sequential(Linear(hidden, hidden), activation())`` block sits
    between the two layers, so that a module holds a child that holds parameters.
    """
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(features, hidden), activation()]
    if nested:
        layers.append(torch.nn.Sequential(torch.nn.Linear(hidden, hidden), activation()))
    layers.append(torch.nn.Linear(hidden, outputs))
    return torch.nn.Sequential(*layers)


def make_batches(
    *,
    steps: int,
    size: int = 8,
    features: int = 6,
    outputs: int = 2,
    seed: int = 11,
    labels: bool = False,
    seed_targets: bool = True,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` batches of `size` inputs and their targets, drawn from a generator seeded with `seed`.

    Targets are ``(size, outputs)`` values, or with `labels` ``(size,)`` class indices
    below `outputs`. Each batch draws its inputs, then its targets. With
    ``seed_targets=False`` the targets come from torch's global generator instead, so
    they follow whatever seeded it last (test_allreduce's data, whose tolerances were
    measured on it).
    """
    generator = torch.Generator().manual_seed(seed)
    targets_from = generator if seed_targets else None
    batches = []
    for _ in range(steps):
        inputs = torch.randn(size, features, generator=generator)
        if labels:
            targets = torch.randint(0, outputs, (size,), generator=targets_from)
        else:
            targets = torch.randn(size, outputs, generator=targets_from)
        batches.append((inputs, targets))
    return batches


def make_inputs(
    *, steps: int, size: int = 8, features: int = 6, seed: int = 11
) -> list[torch.Tensor]:
    """`steps` batches of `size` inputs and no targets, drawn from a generator seeded with `seed`."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(size, features, generator=generator) for _ in range(steps)]


def filled_linear(value: float) -> torch.nn.Linear:
    """A ``Linear(4, 4)`` with every weight ``value`` and every bias ``-value``."""
    model = torch.nn.Linear(4, 4)
    with torch.no_grad():
        model.weight.fill_(value)
        model.bias.fill_(-value)
    return model


def local_ctx() -> sg.Context:
    """The CPU context of a plain process (``Env()``), without a process group."""
    return sg.Context(env=sg.Env(), device=torch.device("cpu"))


def rank_ctx(rank: int, world_size: int) -> sg.Context:
    """The CPU context of `rank` in a one-node spawned world of `world_size`, without a process group."""
    env = sg.Env(
        rank=rank,
        local_rank=rank,
        world_size=world_size,
        local_world_size=world_size,
        source="spawn",
    )
    return sg.Context(env=env, device=torch.device("cpu"))


class Block(torch.nn.Module):
    """A small transformer block: pre-norm causal attention and an MLP, each with a residual.

    Attention projections carry no bias: a key bias does not change attention, so its
    gradient is zero and an optimizer like Adam would amplify rounding noise in it.
    """

    def __init__(self, width: int = 16, head: int = 4) -> None:
        super().__init__()
        self.head = head
        self.norm = torch.nn.LayerNorm(width)
        self.q, self.k, self.v = (torch.nn.Linear(width, width, bias=False) for _ in range(3))
        self.o = torch.nn.Linear(width, width)
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, _ = x.shape
        h = self.norm(x)
        # -1 heads: under tensor parallelism each rank holds width / tp of the features.
        q, k, v = (
            m(h).view(batch, time, -1, self.head).transpose(1, 2) for m in (self.q, self.k, self.v)
        )
        attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(attended.transpose(1, 2).reshape(batch, time, -1))
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def make_block(seed: int = 0) -> Block:
    torch.manual_seed(seed)
    return Block()


def block_plan() -> dict[str, object]:
    """Megatron's split of `Block`: column-wise into attention and the MLP, row-wise out."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "q": ColwiseParallel(),
        "k": ColwiseParallel(),
        "v": ColwiseParallel(),
        "o": RowwiseParallel(),
        "up": ColwiseParallel(),
        "down": RowwiseParallel(),
    }


def matches_shown_output(shown: str, printed: str) -> bool:
    """Whether ``printed`` is what a page shows: ``...`` stands for anything, timings are ignored.

    Pages show real output; times differ from run to run, so ``12.3ms`` and
    ``11,338 samples/s`` are compared as placeholders on both sides. So are
    SHA-256 digests of parameters: they name bits, and another CPU's vector
    kernels round in another order (the losses shown still agree).
    """
    import doctest
    import re

    def steady(text: str) -> str:
        text = re.sub(r"\b\d[\d,]*(\.\d+)?\s*(ms|s|samples/s|tokens/s)\b", "<time>", text)
        text = re.sub(r"\b[0-9a-f]{64}\b", "<digest>", text)
        return "\n".join(line.rstrip() for line in text.strip().splitlines()) + "\n"

    checker = doctest.OutputChecker()
    return checker.check_output(steady(shown), steady(printed), doctest.ELLIPSIS)


def train_a_little(strategy: sg.Strategy, ctx: sg.Context) -> float:
    """Three steps of a Linear(4, 2) from seed 0; the weights' sum, which ranks must agree on."""
    torch.manual_seed(0)
    model = strategy.wrap(torch.nn.Linear(4, 2), ctx)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        loss = strategy.step(model, torch.randn(8, 4), ctx).pow(2).mean()
        strategy.backward(loss, model, ctx)
        strategy.update(optimizer, model, ctx)
    return float(sg.unwrap(model).weight.detach().sum())


# Training a split model against one process (tensor, context and expert parallelism).


def mse(model, batch):
    inputs, targets = batch
    return torch.nn.functional.mse_loss(model(inputs), targets)


def whole(tensor: torch.Tensor) -> torch.Tensor:
    full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    return full.detach().cpu().clone()


def whole_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, torch.Tensor]:
    """Every parameter and AdamW slot (but the step count), gathered whole, by name."""
    plain = sg.unwrap(model)  # names without a wrapper's prefix (DDP's "module.")
    names = {id(p): n for n, p in plain.named_parameters()}
    state = {f"model.{n}": whole(p) for n, p in plain.named_parameters()}
    for parameter, slots in optimizer.state.items():
        for slot, value in slots.items():
            if slot != "step":
                state[f"optimizer.{names[id(parameter)]}.{slot}"] = whole(value)
    return state


def trained_alone(module: torch.nn.Module, batches: Iterable) -> dict[str, torch.Tensor]:
    """One process's training on the whole batches (AdamW, mse): what every split must equal."""
    strategy = sg.single_device("cpu")
    ctx = strategy.setup(sg.Env())
    model = strategy.wrap(module, ctx)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for batch in batches:
        loss = strategy.step(model, batch, ctx, forward=mse)
        strategy.backward(loss, model, ctx)
        strategy.update(optimizer, model, ctx)
    return whole_state(model, optimizer)


def assert_equal_to_reference(results, expected) -> None:
    for rank, result in enumerate(results):
        assert sorted(result["state"]) == sorted(expected), rank
        for key, value in expected.items():
            torch.testing.assert_close(
                result["state"][key], value, rtol=1e-5, atol=1e-6, msg=f"rank {rank}: {key}"
            )
