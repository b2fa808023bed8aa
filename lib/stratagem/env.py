"""The world a process belongs to: `Env` (what the launcher says) and `Context` (the joined world).

`detect_env` is a pure function of a mapping, so it is tested on generated
environments without touching ``os.environ``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Literal, get_args

import attrs
import torch
import torch.distributed as dist

from stratagem.arrivals import Arrivals
from stratagem.errors import EnvError, UsageError
from stratagem.validators import (
    a_bool,
    choice,
    field,
    instance_of,
    non_negative_int,
    positive_int,
    refusal,
    require,
)

__all__ = [
    "Context",
    "Env",
    "EnvSource",
    "MeshNames",
    "check_context",
    "check_env",
    "detect_env",
    "host_group",
    "mesh_names",
]

_DIM_NAME = field(lambda v: isinstance(v, str) and bool(v), "MeshNames.{name}", "a non-empty str")


@attrs.frozen(kw_only=True)
class MeshNames:
    """What a strategy's mesh calls each dimension, by role: stratagem's names, or yours.

    Every field that looks a dimension up asks the context
    (``ctx.mesh[ctx.mesh_names.tp]``), so a mesh named as torchtitan names it
    (``MeshNames(replicate="dp_replicate", shard="dp_shard")``) works throughout.

    Example:
        >>> MeshNames(shard="dp", tp="model").model_parallel
        ('model', 'pp')

    Raises:
        UsageError: a name is not a non-empty str, or two roles share one.
    """

    replicate: str = attrs.field(default="replicate", validator=_DIM_NAME)
    shard: str = attrs.field(default="shard", validator=_DIM_NAME)
    tp: str = attrs.field(default="tp", validator=_DIM_NAME)
    pp: str = attrs.field(default="pp", validator=_DIM_NAME)
    cp: str = attrs.field(default="cp", validator=_DIM_NAME)
    ep: str = attrs.field(default="ep", validator=_DIM_NAME)

    def __attrs_post_init__(self) -> None:
        names = attrs.astuple(self)
        if len(set(names)) != len(names):
            raise UsageError(
                f"MeshNames: each role needs a name of its own (got {attrs.asdict(self)}); "
                "rename the dimensions that share one."
            )

    @property
    def model_parallel(self) -> tuple[str, str]:
        """The dimensions whose ranks hold parts of one model and take the same batches."""
        return (self.tp, self.pp)

    @property
    def same_batch(self) -> tuple[str, str, str]:
        """The dimensions whose ranks take the same batches: the model-parallel ones and ``cp``.

        A context-parallel group splits each batch's sequence, not the batches.
        """
        return (self.tp, self.pp, self.cp)


def mesh_names(names: object) -> MeshNames:
    """Convert ``None``, a mapping of roles to names, or `MeshNames` to `MeshNames`.

    Raises:
        UsageError: ``names`` is none of these, or names a role that does not exist.
    """
    if names is None:
        return MeshNames()
    if isinstance(names, MeshNames):
        return names
    roles = [f.name for f in attrs.fields(MeshNames)]
    if not isinstance(names, Mapping) or not set(names) <= set(roles):
        what = f"a MeshNames or a mapping of roles {roles} to dimension names"
        raise refusal("'mesh_names'", f"{what}, e.g. {{'shard': 'dp', 'tp': 'model'}}", names)
    return MeshNames(**names)


EnvSource = Literal["single", "torchrun", "slurm", "spawn"]

# SLURM job names that mean "an interactive shell", where the user starts processes by hand.
_INTERACTIVE_JOB_NAMES = frozenset({"bash", "sh", "zsh", "interactive"})
# Ports derived from a SLURM job id fall in [_SLURM_PORT_BASE, _SLURM_PORT_BASE + _SLURM_PORT_SPAN).
_SLURM_PORT_BASE = 15000
_SLURM_PORT_SPAN = 20000


_COUNT = non_negative_int("Env.{name}", error=EnvError)
_POSITIVE = positive_int("Env.{name}", error=EnvError)
_SOURCE = choice("Env.{name}", get_args(EnvSource), subclasses=True, error=EnvError)
_FLAG = a_bool("Env.{name}", error=EnvError)
_ADDRESS = field(
    lambda v: isinstance(v, str) and v != "",
    "Env.{name}",
    "a non-empty host name or address",
    error=EnvError,
)


@attrs.frozen(kw_only=True)
class Env:
    """What the launcher or cluster says about this process.

    Attributes:
        rank: global rank, ``0 <= rank < world_size``.
        local_rank: rank on this node, ``0 <= local_rank < local_world_size``.
        world_size: number of processes in the world.
        local_world_size: number of processes on this node.
        node_rank: index of this node.
        master_addr: host of the rendezvous store.
        master_port: port of the rendezvous store (0 when there is none).
        source: who described the world: ``"single"`` (a plain process),
            ``"torchrun"``, ``"slurm"`` or ``"spawn"`` (stratagem's own launcher).
        agent_store: whether a launcher agent (torchrun, or stratagem's spawn
            parent) already hosts the store at ``master_addr:master_port``, so
            every rank connects to it as a client.

    Raises:
        EnvError: a field has the wrong type or range, or the fields contradict
            each other (``rank >= world_size``, ...).
    """

    rank: int = attrs.field(default=0, validator=_COUNT)
    local_rank: int = attrs.field(default=0, validator=_COUNT)
    world_size: int = attrs.field(default=1, validator=_POSITIVE)
    local_world_size: int = attrs.field(default=1, validator=_POSITIVE)
    node_rank: int = attrs.field(default=0, validator=_COUNT)
    master_addr: str = attrs.field(default="127.0.0.1", validator=_ADDRESS)
    master_port: int = attrs.field(default=0, validator=_COUNT)
    source: EnvSource = attrs.field(default="single", validator=_SOURCE)
    agent_store: bool = attrs.field(default=False, validator=_FLAG)

    def __attrs_post_init__(self) -> None:
        for name, limit in (("rank", "world_size"), ("local_rank", "local_world_size")):
            value, bound = getattr(self, name), getattr(self, limit)
            if value >= bound:
                raise EnvError(
                    f"Env.{name} must be below {limit} (got {name}={value}, {limit}={bound})."
                )
        if self.local_world_size > self.world_size:
            raise EnvError(
                f"Env.local_world_size must not exceed world_size (got local_world_size="
                f"{self.local_world_size}, world_size={self.world_size})."
            )
        if self.master_port > 65535:
            raise EnvError(f"Env.master_port must be at most 65535 (got {self.master_port}).")

    @property
    def is_distributed(self) -> bool:
        """Whether a launcher outside this process started the world."""
        return self.source != "single"


def _read_only(extras: object) -> Mapping[str, Any]:
    if not isinstance(extras, Mapping) or not all(isinstance(key, str) for key in extras):
        hint = "; add state with ctx.with_extras(name=value)"
        raise refusal("Context.extras", "a mapping with str keys", extras, hint=hint)
    return MappingProxyType(dict(extras))


def _as_device(value: object) -> object:
    """Turn a device string (``"cpu"``, ``"cuda:0"``) into a ``torch.device``; leave the rest."""
    try:
        return torch.device(value) if isinstance(value, str) else value
    except RuntimeError:
        return value


_context_field = functools.partial(instance_of, "Context.{name}")
_USE_AN_ENV = "; use detect_env(os.environ), or Env() for a single process"
_CONTEXT_ENV = _context_field(Env, "an Env", hint=_USE_AN_ENV)
_CONTEXT_DEVICE = _context_field(
    torch.device, "a torch.device or a device string", hint=", e.g. torch.device('cpu') or 'cuda:0'"
)
_CONTEXT_GROUP = _context_field(
    dist.ProcessGroup, "a torch.distributed.ProcessGroup", optional="None (a world of one)"
)
_CONTEXT_CPU_GROUP = _context_field(
    dist.ProcessGroup,
    "a torch.distributed.ProcessGroup with a CPU backend",
    optional="None (group carries CPU tensors itself)",
)
_CONTEXT_ARRIVALS = _context_field(
    Arrivals, "an Arrivals", optional="None", hint="; the setup that joins the world builds it"
)


@attrs.frozen(kw_only=True)
class Context:
    """A joined world: the `Env`, this process's device and its process group.

    `setup` returns it; every other field of a strategy receives it. It is
    frozen; per-run objects that combinators need (a ``GradScaler``, a device
    mesh) live in ``extras``, a read-only mapping added to with `with_extras`.
    ``cpu_group`` carries CPU tensors and pickled objects (checkpoint planning,
    results, flags) where ``group`` cannot: under NCCL alone, a gloo group over
    the same ranks that setup made; ``None`` when ``group`` serves the CPU too
    (gloo, ``"cpu:gloo,cuda:nccl"``). `host_group` picks the right one.
    ``arrivals`` lets `save`, `load` and `barrier` find out within a bounded
    time that some ranks did not call them (`stratagem.arrivals`); a Context
    built by hand has none, and those calls then wait as the backend does.

    Raises:
        UsageError: a field has the wrong type (``env`` not an `Env`, ``device``
            not a ``torch.device``, ...).
    """

    env: Env = attrs.field(validator=_CONTEXT_ENV)
    device: torch.device = attrs.field(converter=_as_device, validator=_CONTEXT_DEVICE)
    group: dist.ProcessGroup | None = attrs.field(default=None, validator=_CONTEXT_GROUP)
    extras: Mapping[str, Any] = attrs.field(factory=dict, converter=_read_only)
    arrivals: Arrivals | None = attrs.field(default=None, validator=_CONTEXT_ARRIVALS, repr=False)
    cpu_group: dist.ProcessGroup | None = attrs.field(
        default=None, validator=_CONTEXT_CPU_GROUP, repr=False
    )

    @functools.cached_property
    def device_type(self) -> str:
        """``device.type``, kept: autocast takes it each step, and torch makes it anew each read."""
        return self.device.type

    def with_extras(self, **extras: Any) -> Context:
        """Return a copy with more per-run state (a grad scaler, a mesh, ...), keyed by name.

        Combinators that need state for a run add it in their ``setup`` and read it
        back from ``ctx.extras`` in the other fields, so the record itself stays
        stateless.

        Raises:
            UsageError: a key is already present (two combinators would share state).
        """
        clash = sorted(set(extras) & set(self.extras))
        if clash:
            raise UsageError(
                f"Context.extras already holds {clash}; the same state was added twice "
                "(is a combinator applied twice?)."
            )
        return attrs.evolve(self, extras={**self.extras, **extras})

    def print(self, *values: Any, **options: Any) -> None:
        """Print on the main rank only (global rank 0), as ``print`` would; a no-op elsewhere.

        Output is flushed at once, so lines from ranks and launchers interleave
        in the order they happened.

        Example:
            >>> import stratagem as sg
            >>> ctx = sg.single_device("cpu").setup(sg.Env())
            >>> ctx.print("epoch", 1, "loss", 0.25)
            epoch 1 loss 0.25
        """
        if self.env.rank == 0:
            print(*values, **{"flush": True, **options})

    @property
    def rank(self) -> int:
        """Global rank of this process."""
        return self.env.rank

    @property
    def local_rank(self) -> int:
        """Rank of this process on its node."""
        return self.env.local_rank

    @property
    def world_size(self) -> int:
        """Number of processes in the world."""
        return self.env.world_size

    @property
    def is_main(self) -> bool:
        """Whether this is global rank 0, the rank that prints and writes."""
        return self.env.rank == 0

    @property
    def mesh(self) -> Any:
        """The world's ``DeviceMesh``, its dimensions named (``ctx.extras["mesh"]``), or ``None``.

        A strategy's ``setup`` declares the dimensions: ``("shard",)`` for
        ``fsdp()``, ``("replicate", "shard")`` for hybrid sharding, with
        ``"tp"`` last under `tensor_parallel`. ``ctx.mesh["tp"]`` is the
        sub-mesh of a dimension, ``ctx.mesh["tp"].get_group()`` its process group.
        """
        return self.extras.get("mesh")

    @property
    def mesh_names(self) -> MeshNames:
        """What ``mesh`` calls each dimension, by role (``extras["mesh_names"]``, or defaults)."""
        names = self.extras.get("mesh_names")
        return names if isinstance(names, MeshNames) else MeshNames()

    @property
    def data_mesh(self) -> Any:
        """The sub-mesh of ``mesh``'s data-parallel dimensions, what FSDP shards over; or ``None``.

        The whole mesh when it has no model-parallel dimension (`MeshNames.model_parallel`).
        Under `context_parallel` (`expert_parallel`) the ``shard`` and ``cp``
        (``ep``) dimensions count as one, ``shard_cp`` (``shard_ep``), built by
        the setup as ``extras["data_mesh"]`` (`meshes.flattened_data_mesh`):
        gradients average over every rank of a sequence (every expert group) too.
        A wrap of your own that shards (``fully_shard(..., mesh=ctx.data_mesh)``)
        then composes with `tensor_parallel` and `context_parallel` as the built-in one does.
        """
        mesh = self.mesh
        if mesh is None or "data_mesh" in self.extras:  # a setup that built it (flattened)
            return self.extras.get("data_mesh")
        names = mesh.mesh_dim_names or ()
        model = self.mesh_names.model_parallel
        data = tuple(n for n in names if n not in model)
        return mesh if data == names else mesh[data]

    @property
    def data_parallel(self) -> tuple[int, int]:
        """``(index, size)`` of this rank among the ranks that take different batches.

        Without a mesh, or on a mesh of data-parallel dimensions only, it is
        ``(rank, world_size)``. The ranks of one model-parallel group
        (`MeshNames.model_parallel`) hold parts of one model and take the same batch,
        as do those of a context-parallel group (`MeshNames.same_batch`):
        on a ``(shard=2, tp=2)`` mesh, ranks 0 and 1 are ``(0, 2)`` and ranks 2 and
        3 are ``(1, 2)``.
        """
        mesh = self.mesh
        names = getattr(mesh, "mesh_dim_names", None) or ()
        model = self.mesh_names.same_batch
        if not set(names) & set(model):
            return self.rank, self.world_size
        coordinate = mesh.get_coordinate()
        index, size = 0, 1
        for dim, (name, at) in enumerate(zip(names, coordinate, strict=True)):
            if name not in model:
                extent = mesh.size(dim)
                index, size = index * extent + at, size * extent
        return index, size


def check_context(ctx: object, function: str) -> Context:
    """Return ``ctx`` if it is a `Context`; the first line of every field that takes one.

    Raises:
        UsageError: it is not (an `Env`, arguments in the wrong order, ...).
    """
    if not isinstance(ctx, Context):
        what = "the Context that the strategy's setup returned"
        hint = "; launch passes it to your function after the strategy"
        raise refusal(f"{function}: 'ctx'", what, ctx, hint=hint)
    return ctx


def check_env(env: object, function: str) -> Env:
    """Return ``env`` if it is an `Env`; the first line of every ``setup`` field.

    Raises:
        UsageError: it is not.
    """
    if not isinstance(env, Env):
        raise refusal(f"{function}: 'env'", "an Env", env, hint=_USE_AN_ENV)
    return env


def _int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    """Read variable ``name`` as a non-negative int; ``default`` if given and it is not set."""
    if default is not None and name not in environ:
        return default
    raw = environ[name]
    try:
        value = int(raw.strip())
    except ValueError:
        raise EnvError(f"environment variable {name} must be an integer (got {raw!r}).") from None
    if value < 0:
        raise EnvError(f"environment variable {name} must be non-negative (got {raw!r}).")
    return value


def _require(environ: Mapping[str, str], names: tuple[str, ...], launcher: str) -> None:
    missing = [name for name in names if name not in environ]
    if missing:
        raise EnvError(
            f"{launcher} environment is incomplete: {', '.join(missing)} not set "
            f"(found {', '.join(n for n in names if n in environ)}). Set all of "
            f"{', '.join(names)}, or none to run as a single process."
        )


_TASKS_PER_NODE = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def _slurm_tasks_on_node(environ: Mapping[str, str], node: int, world_size: int) -> int:
    """Read SLURM_NTASKS_PER_NODE / SLURM_TASKS_PER_NODE, e.g. ``"4"``, ``"2(x3),1"``.

    Without either, every task is on this node: ``world_size``.
    """
    spec = environ.get("SLURM_NTASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    if spec is None:
        return world_size
    counts: list[int] = []
    for part in spec.split(","):
        match = _TASKS_PER_NODE.match(part.strip())
        if match is None:
            raise EnvError(
                f"environment variable SLURM_NTASKS_PER_NODE is malformed (got {spec!r}); "
                "expected a form such as '4' or '2(x3),1'."
            )
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    if len(counts) == 1:
        return counts[0]
    if node >= len(counts):
        raise EnvError(
            f"SLURM_NODEID={node} but SLURM_NTASKS_PER_NODE={spec!r} describes {len(counts)} nodes."
        )
    return counts[node]


# One host expression of a node list: a name, optionally with a bracketed list of numbers and
# ranges ("gpu[003-005,9]"), optionally followed by more name ("n[1-2]-ib"); the whole list is
# such expressions separated by commas. Anything else ("n[1-", "n]") was taken as host "n".
_HOST_RANGE = r"\d+(?:-\d+)?"
_HOST_EXPR = rf"[^,\[\]]+(?:\[{_HOST_RANGE}(?:,{_HOST_RANGE})*\][^,\[\]]*)?"
_NODELIST = re.compile(rf"^{_HOST_EXPR}(?:,{_HOST_EXPR})*$")
_FIRST_HOST = re.compile(r"^([^,\[]+)(?:\[(\d+)[^\]]*\]([^,\[\]]*))?")


def _slurm_first_host(nodelist: str) -> str:
    """First host of a SLURM node list: ``"gpu[003-005,9],cpu1"`` gives ``"gpu003"``."""
    text = nodelist.strip()
    first = _FIRST_HOST.match(text)
    if _NODELIST.match(text) is None or first is None:
        raise EnvError(
            f"environment variable SLURM_NODELIST is malformed (got {nodelist!r}); expected a "
            "form such as 'gpu[003-005,9],cpu1', or set MASTER_ADDR to the first node's host."
        )
    prefix, number, suffix = first.groups()
    return prefix if number is None else prefix + number + suffix


def _launched(environ: Mapping[str, str], source: Literal["torchrun", "slurm"]) -> Env:
    """Read the world torchrun or SLURM describes.

    Each value is read first, so a malformed one is named as such; a
    contradiction the `Env` finds among them is restated in terms of the
    variables it comes from that are set.
    """
    if source == "torchrun":
        required: tuple[str, ...] = ("RANK", "WORLD_SIZE")
        _require(environ, required, "torchrun")
        rank, world_size = _int(environ, "RANK"), _int(environ, "WORLD_SIZE")
        local_rank = _int(environ, "LOCAL_RANK", default=rank)
        local_world_size = _int(environ, "LOCAL_WORLD_SIZE", default=world_size)
        node_rank = _int(environ, "GROUP_RANK", default=0)
        port = _int(environ, "MASTER_PORT", default=29500)
        addr = environ.get("MASTER_ADDR", "127.0.0.1")
        agent_store = environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        shown = (*required, "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    else:
        required = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_NODELIST")
        _require(environ, required, "SLURM")
        rank, local_rank = _int(environ, "SLURM_PROCID"), _int(environ, "SLURM_LOCALID")
        world_size = _int(environ, "SLURM_NTASKS")
        node_rank = _int(environ, "SLURM_NODEID", default=0)
        local_world_size = _slurm_tasks_on_node(environ, node_rank, world_size)
        if "MASTER_PORT" in environ:
            port = _int(environ, "MASTER_PORT")
        elif "SLURM_JOB_ID" in environ:
            port = _SLURM_PORT_BASE + _int(environ, "SLURM_JOB_ID") % _SLURM_PORT_SPAN
        else:
            raise EnvError(
                "SLURM environment has neither MASTER_PORT nor SLURM_JOB_ID; set MASTER_PORT."
            )
        addr = environ.get("MASTER_ADDR") or _slurm_first_host(environ["SLURM_NODELIST"])
        agent_store = False  # rank 0 serves the store
        shown = (*required, "SLURM_NODEID", "SLURM_NTASKS_PER_NODE")
    try:
        return Env(
            rank=rank,
            local_rank=local_rank,
            world_size=world_size,
            local_world_size=local_world_size,
            node_rank=node_rank,
            master_addr=addr,
            master_port=port,
            source=source,
            agent_store=agent_store,
        )
    except EnvError as error:
        values = ", ".join(f"{name}={environ[name]!r}" for name in shown if name in environ)
        raise EnvError(f"contradictory environment ({values}): {error}") from None


def detect_env(environ: Mapping[str, str]) -> Env:
    """Describe the world this process belongs to from its environment variables.

    torchrun / TorchElastic variables win over SLURM ones (torchrun inside a
    SLURM allocation is a torchrun world). A SLURM interactive shell
    (``SLURM_JOB_NAME`` of ``bash``, ``interactive``, ...) counts as a single
    process. Without either, the process is a world of one.

    Args:
        environ: the variables, usually ``os.environ``.

    Returns:
        The `Env` they describe.

    Raises:
        EnvError: a variable is malformed (not an integer, negative, not a str) or
            the variables contradict each other (``RANK >= WORLD_SIZE``); the
            message names the variables and values.
        UsageError: ``environ`` is not a mapping.

    Example:
        >>> detect_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}).rank
        1
        >>> detect_env({}).source
        'single'
    """
    wanted = "a mapping of variable names to str, usually os.environ"
    require(isinstance(environ, Mapping), "detect_env: 'environ'", wanted, environ)
    # os.environ holds only str; a hand-made mapping may not, and would fail deep in parsing.
    for name, value in environ.items():
        label = f"environment variable {name}"
        require(isinstance(value, str), label, "a str, as in os.environ", value, error=EnvError)
    if "RANK" in environ or "WORLD_SIZE" in environ or "TORCHELASTIC_RUN_ID" in environ:
        return _launched(environ, "torchrun")
    in_a_job = "SLURM_NTASKS" in environ or "SLURM_PROCID" in environ
    if in_a_job and environ.get("SLURM_JOB_NAME", "") not in _INTERACTIVE_JOB_NAMES:
        return _launched(environ, "slurm")
    return Env()


def host_group(ctx: Context) -> dist.ProcessGroup | None:
    """Return the group that carries CPU tensors and objects in ``ctx``'s world.

    A world joined over NCCL alone has no CPU backend in its default group:
    every collective on CPU data (checkpoint planning, gathered results, a
    preemption flag) goes over ``ctx.cpu_group`` instead.
    """
    return ctx.group if ctx.cpu_group is None else ctx.cpu_group
