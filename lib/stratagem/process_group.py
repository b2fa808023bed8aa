"""Joining and leaving a multi-process world: setup and teardown of ddp, fsdp, allreduce_grads.

`JoinProcessGroup` picks the device, serves or reaches the rendezvous store and
initialises the default process group; `leave_process_group` destroys it once
nothing uses it any more.
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Mapping
from datetime import timedelta
from typing import TypedDict

import attrs
import torch
import torch.distributed as dist
from torch.distributed import (  # type: ignore[attr-defined]  # exported at run time
    HashStore,
    PrefixStore,
    Store,
    TCPStore,
)

from stratagem import pending
from stratagem.arrivals import DEFAULT_TIMEOUT, Arrivals, check_arrival_timeout
from stratagem.devices import DeviceSpec, check_device_spec, resolve_device
from stratagem.env import Context, Env, check_context, check_env
from stratagem.errors import LaunchError, UsageError
from stratagem.validators import MAX_SECONDS, positive_number, require

__all__ = [
    "BACKENDS",
    "DEFAULT_JOIN_TIMEOUT",
    "NEVER_JOINED",
    "JoinProcessGroup",
    "WorldOptions",
    "check_backend",
    "collective_timeout",
    "default_backend",
    "join_world",
    "leave",
    "leave_process_group",
]

NEVER_JOINED = (
    "setup: rank(s) {missing} of a world of {world_size} did not join within {timeout:g} s "
    "(rank {rank} waited at the rendezvous store {where}; joined: {joined}). Check that every "
    "rank started (its logs, the scheduler) and that all use the same MASTER_ADDR and "
    "MASTER_PORT; if a rank is just slow to start, raise {bound}."
)

DEFAULT_JOIN_TIMEOUT = 300.0
_JOINED = "stratagem/joined"

BACKENDS = ("gloo", "nccl", "mpi", "ucc", "xccl")


def _to_timedelta(value: float | timedelta) -> timedelta:
    """Return ``value`` (seconds, or a timedelta) as a timedelta of at most `MAX_SECONDS`."""
    if not isinstance(value, timedelta):
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        wanted = "seconds (a number) or a datetime.timedelta"
        require(number, "'timeout'", wanted, value)
        if not -MAX_SECONDS <= value <= MAX_SECONDS:  # NaN, infinity: timedelta cannot hold them
            raise UsageError(_timeout_range(f"{value} seconds"))
        value = timedelta(seconds=value)
    # gloo refuses larger values (a negative count after conversion) deep inside init;
    # the same bound for every backend, as no real collective should wait 11 days.
    if not 0 < value.total_seconds() <= MAX_SECONDS:
        raise UsageError(_timeout_range(f"{value.total_seconds()} seconds"))
    return value


def _timeout_range(shown: str) -> str:
    return (
        f"'timeout' must be positive and at most {MAX_SECONDS} seconds (got {shown}); "
        "a collective that waits longer has hung."
    )


def _backend_names() -> tuple[str, ...]:
    # torch's list includes backends registered at run time (Backend.register_backend).
    names = [str(n) for n in getattr(dist.Backend, "backend_list", ()) if n != "undefined"]
    return tuple(dict.fromkeys([*BACKENDS, *names]))


def check_backend(value: object, argument: str = "backend") -> str | None:
    """Return ``value`` if `init_process_group` would take it as a backend string.

    Accepted: ``None`` (gloo on the CPU; ``"cpu:gloo,cuda:nccl"`` on CUDA), a
    backend name (``"gloo"``, ``"nccl"``, ...), or torch's device mapping, comma
    separated ``device:backend`` pairs (``"cpu:gloo,cuda:nccl"``, ``"cuda:gloo"``).

    Raises:
        UsageError: anything else, naming the argument, the value and the forms.
    """
    if value is None:
        return None
    names = _backend_names()
    known = ", ".join(map(repr, names))
    forms = f"None, one of {known}, or device:backend pairs such as 'cpu:gloo,cuda:nccl'"
    text = value.strip().lower() if isinstance(value, str) else ""
    require(":" in text or text in names, f"'{argument}'", forms, value)
    if ":" not in text:
        return text
    pairs: dict[str, str] = {}  # device type -> its backend
    for pair in text.split(","):
        device, _, name = (part.strip() for part in pair.partition(":"))
        if name not in names or not device:
            raise UsageError(
                f"'{argument}': {pair.strip()!r} in {value!r} is not a device:backend pair "
                f"with a backend among {known}; write e.g. 'cpu:gloo,cuda:nccl'."
            )
        try:
            torch.device(device)
        except RuntimeError:
            raise UsageError(
                f"'{argument}': {device!r} in {value!r} is not a device type; write e.g. "
                "'cpu:gloo,cuda:nccl'."
            ) from None
        if device in pairs:
            raise UsageError(
                f"'{argument}': device {device!r} is mapped twice in {value!r}; give each "
                "device type one backend."
            )
        pairs[device] = name
    return ",".join(f"{device}:{name}" for device, name in pairs.items())


def default_backend(device: torch.device) -> str:
    """Return the backend ``backend=None`` means on ``device``.

    On CUDA it is torch's own default, NCCL for CUDA tensors with gloo beside
    it for CPU ones, so checkpoints, results and flags need no group of their own.
    """
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def _uses(backend: str, name: str) -> bool:
    return name in (part.rpartition(":")[2] for part in backend.split(","))


def _serves_cpu(group: dist.ProcessGroup) -> bool:
    # Which device types a group's backends serve: DCP's async save asks the same question.
    types = getattr(group, "_device_types", None)
    return types is None or torch.device("cpu") in types


_JOIN_TIMEOUT = positive_number(
    "'{name}'",
    unit="seconds",
    at_most=MAX_SECONDS,
    hint="; it bounds how long setup waits for every rank to join the world",
)


@attrs.frozen(kw_only=True)
class JoinProcessGroup:
    """Setup field of a multi-process world: choose the device, join the default process group.

    Every rank connects to the store at ``master_addr:master_port``; rank 0
    hosts it unless a launcher agent already does (``env.agent_store``). A
    world of one uses an in-memory store and needs no port. The store also
    serves the `Arrivals` checks of save, load and barrier, which give up
    after ``arrival_timeout`` seconds.

    Joining waits at most ``join_timeout`` seconds (and never longer than
    ``timeout``) to reach the store and for every rank to sign in there; a rank
    that never comes is a `LaunchError` naming it (`NEVER_JOINED`), on every
    rank that did.

    Its fields are the world options (`WorldOptions`) that every multi-process
    built-in takes as keywords and passes here whole.

    Attributes:
        device: ``"auto"`` (``cuda:LOCAL_RANK`` where the host has a GPU per
            local rank, else the CPU) or a device.
        backend: ``None`` picks gloo on the CPU and ``"cpu:gloo,cuda:nccl"`` on
            CUDA; or any string ``init_process_group`` takes, device mappings
            included. Without a CPU backend (``"nccl"``), setup adds a gloo
            group for CPU traffic (``ctx.cpu_group``).
        timeout: seconds (or a ``timedelta``) that process-group init and every
            collective wait before failing.
        arrival_timeout: seconds that ``save``, ``load`` and ``barrier`` wait
            for every rank to call them before raising `CollectiveCallError`
            (the mark of a call made on some ranks only).
        join_timeout: seconds that setup waits for every rank to join the
            world; a rank that never comes is a `LaunchError` naming it.

    Raises:
        UsageError: ``env`` is not an `Env`, or the device is not available.
        LaunchError: a multi-rank world without a port, a process group already
            initialised, a store that cannot be served or reached, or ranks that
            did not join within ``join_timeout``.
    """

    device: DeviceSpec = attrs.field(default="auto", converter=check_device_spec)
    backend: str | None = attrs.field(default=None, converter=check_backend)
    timeout: timedelta = attrs.field(default=timedelta(minutes=30), converter=_to_timedelta)
    arrival_timeout: float = attrs.field(default=DEFAULT_TIMEOUT, converter=check_arrival_timeout)
    join_timeout: float = attrs.field(default=DEFAULT_JOIN_TIMEOUT, validator=_JOIN_TIMEOUT)

    def __call__(self, env: Env) -> Context:
        check_env(env, "setup")
        if dist.is_initialized() and is_simulated(dist.group.WORLD):
            return _join_simulated(env, self.device)
        if env.world_size > 1 and env.master_port == 0:
            # Port 0 would let rank 0's store pick any port, which the others cannot know.
            raise LaunchError(
                f"setup: a world of {env.world_size} needs a rendezvous port, but "
                f"master_port is 0 ({env.source!r}); set MASTER_PORT, or launch with "
                "ddp_spawn(), which picks one."
            )
        device = resolve_device(  # a spawn launcher warned already, before its ranks started
            self.device,
            env.local_rank,
            env.local_world_size,
            warn=env.source != "spawn",
            bound_per_task=env.source == "slurm" and "CUDA_VISIBLE_DEVICES" in os.environ,
        )
        backend = self.backend or default_backend(device)
        if backend == "nccl" and device.type != "cuda":
            raise UsageError(
                f"setup: backend 'nccl' runs on CUDA devices only, but this rank's device is "
                f"{str(device)!r} (CUDA available: {torch.cuda.is_available()}, NCCL built: "
                f"{dist.is_nccl_available()}); use backend=None (gloo on the CPU) or 'gloo'."
            )
        if _uses(backend, "nccl") and not dist.is_nccl_available():
            raise UsageError(
                f"setup: backend {backend!r} needs NCCL, which this torch was built without "
                f"(CUDA available: {torch.cuda.is_available()}); use backend=None (gloo on "
                "the CPU) or 'gloo'."
            )
        if dist.is_initialized():
            raise LaunchError(
                "setup: a default process group is already initialised in this process; "
                "call torch.distributed.destroy_process_group() first, or let stratagem own it."
            )
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if env.world_size == env.local_world_size > 1 and sys.platform == "linux":
            # A world on one host: gloo's interface is the loopback one. Left to guess, gloo picks
            # the host name's address, and a world torchrun restarts then fails to connect.
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        store: Store
        # A torchrun agent's store outlives a restart: each attempt signs in under its own prefix.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        if env.world_size == 1:
            store = HashStore()
        else:
            joining = timedelta(seconds=min(self.join_timeout, self.timeout.total_seconds()))
            bound = _join_bound(self.join_timeout, self.timeout)
            hosting = env.rank == 0 and not env.agent_store
            try:
                store = TCPStore(
                    env.master_addr,
                    env.master_port,
                    world_size=env.world_size,
                    is_master=hosting,
                    timeout=joining,
                    wait_for_workers=False,
                )
            except RuntimeError as error:  # DistNetworkError, DistStoreError
                raise LaunchError(_store_failure(env, hosting, error, bound)) from error
            _await_every_rank(PrefixStore(f"attempt_{attempt}", store), env, joining, bound)
        try:
            # Under its own prefix too: the keys of the last attempt's group are still in the
            # agent's store, and a rank reading one would dial a process that has died.
            dist.init_process_group(
                backend,
                store=PrefixStore(f"attempt_{attempt}/group", store),
                rank=env.rank,
                world_size=env.world_size,
                timeout=self.timeout,
            )
        finally:
            store.set_timeout(self.timeout)  # the store's later users wait as collectives do
        arrivals = Arrivals(PrefixStore(f"attempt_{attempt}", store), timeout=self.arrival_timeout)
        world = dist.group.WORLD
        assert world is not None  # just initialised
        # NCCL alone (or "cuda:gloo") carries no CPU tensor: checkpoints, results and flags then
        # travel over a gloo group of the same ranks, made once here, as torchtitan does.
        cpu_group = (
            None if _serves_cpu(world) else dist.new_group(backend="gloo", timeout=self.timeout)
        )
        _timeouts[world] = self.timeout
        return Context(env=env, device=device, group=world, arrivals=arrivals, cpu_group=cpu_group)


_timeouts: dict[dist.ProcessGroup, timedelta] = {}


def is_simulated(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group`` belongs to a simulated world (torch's ``fake`` backend, as in `dry_run`).

    A fake group sends nothing: an all-gather gives every rank this rank's
    tensor, a reduction leaves it as it is.
    """
    return group is not None and dist.get_backend(group) == "fake"


def _join_simulated(env: Env, device: DeviceSpec) -> Context:
    """Join the simulated world in place (see `stratagem.planning`), as its rank ``env.rank``."""
    world = dist.group.WORLD
    assert world is not None  # the caller found it initialised
    if (dist.get_world_size(), dist.get_rank()) != (env.world_size, env.rank):
        raise LaunchError(
            f"setup: the simulated world in place is rank {dist.get_rank()} of "
            f"{dist.get_world_size()}, but the Env says rank {env.rank} of {env.world_size}; "
            "describe the same world to both."
        )
    device = resolve_device(device, env.local_rank, env.local_world_size, warn=False)
    # No store to meet at: nothing is sent, so save, load and barrier have no one to wait for.
    arrivals = Arrivals(HashStore(), timeout=DEFAULT_TIMEOUT)
    return Context(env=env, device=device, group=world, arrivals=arrivals)


WorldOptions = TypedDict(  # noqa: UP013  # a type for keywords, not a class to derive from
    "WorldOptions",
    {
        "device": DeviceSpec,
        "backend": "str | None",
        "timeout": "float | timedelta",
        "arrival_timeout": float,
        "join_timeout": float,
    },
    total=False,
)
"""How a multi-process built-in joins its world: the fields of `JoinProcessGroup`.

``ddp()``, ``fsdp()``, ``allreduce_grads()`` and ``pipeline()`` take them as
``**world`` keywords and pass them through whole; they are documented once,
on `JoinProcessGroup`.
"""


def join_world(factory: str, world: Mapping[str, object]) -> JoinProcessGroup:
    """Return the setup field that joins the world ``world`` describes, for ``factory()``.

    Raises:
        TypeError: a keyword is neither the factory's own nor a `WorldOptions` key.
        UsageError: a value is malformed (see `JoinProcessGroup`).
    """
    unknown = sorted(set(world) - WorldOptions.__annotations__.keys())
    if unknown:
        raise TypeError(
            f"{factory}() got an unexpected keyword argument {unknown[0]!r}; besides its own "
            f"options it takes the world's: {', '.join(WorldOptions.__annotations__)}."
        )
    return JoinProcessGroup(**world)  # type: ignore[arg-type]  # keys checked just above


def collective_timeout(group: dist.ProcessGroup | None) -> timedelta | None:
    """Return the ``timeout`` the world of ``group`` was joined with (None: torch's default).

    Groups made later for the same world (a background save's) wait as long as its
    collectives do, not torch's default 30 minutes.
    """
    return _timeouts.get(group) if group is not None else None


def _join_bound(join_timeout: float, timeout: timedelta) -> str:
    """Name the setting that bounded the join, the one worth raising."""
    if join_timeout <= timeout.total_seconds():
        return "the setup's join_timeout"
    return (
        f"the setup's timeout ({timeout.total_seconds():g} s), which bounds joining too "
        f"(join_timeout={join_timeout:g} s is above it and cannot help)"
    )


def _await_every_rank(store: Store, env: Env, timeout: timedelta, bound: str) -> None:
    """Sign this rank in at the store and wait for the others, or name those that never came.

    Each rank leaves its own key (for the names) and counts itself in; the last
    one sets the key everyone waits for, so a rank waits on one key, not on N.
    """
    done = f"{_JOINED}/all"
    where = f"{env.master_addr}:{env.master_port}"
    try:
        store.set(f"{_JOINED}/rank/{env.rank}", str(os.getpid()))
        if store.add(f"{_JOINED}/count", 1) >= env.world_size:
            store.set(done, "")
        store.wait([done], timeout)
        return
    except RuntimeError as error:  # DistStoreError: the wait timed out, or the store went away
        failure = error
    try:
        if store.check([done]):  # the last one came just after the deadline
            return
        joined = [r for r in range(env.world_size) if store.check([f"{_JOINED}/rank/{r}"])]
    except RuntimeError:
        raise LaunchError(
            f"setup: rank {env.rank} lost the rendezvous store at {where} while it waited for "
            f"the other ranks to join ({failure}); the process that hosts it (rank 0, or the "
            "launcher) has ended: see its error."
        ) from failure
    missing = [r for r in range(env.world_size) if r not in joined]
    if not missing:  # all signed in, the last one is counting itself in
        store.wait([done], timeout)
        return
    raise LaunchError(
        NEVER_JOINED.format(
            missing=_ranks(missing),
            world_size=env.world_size,
            timeout=timeout.total_seconds(),
            rank=env.rank,
            where=where,
            joined=_ranks(joined),
            bound=bound,
        )
    ) from None


def _ranks(ranks: list[int]) -> str:
    if len(ranks) > 8:  # a world of thousands: the first few say enough
        return f"{', '.join(map(str, ranks[:8]))}, ... ({len(ranks)} in all)"
    return ", ".join(map(str, ranks))


def _store_failure(env: Env, hosting: bool, error: RuntimeError, bound: str) -> str:
    where = f"{env.master_addr}:{env.master_port}"
    if hosting:
        return (
            f"setup: rank 0 could not serve the rendezvous store on port {env.master_port}: "
            f"it is in use or not available ({error}). Set MASTER_PORT to a free port "
            "(under SLURM the default port comes from the job id)."
        )
    return (
        f"setup: rank {env.rank} could not reach the rendezvous store at {where} within "
        f"the join timeout ({error}); check MASTER_ADDR/MASTER_PORT and that rank 0 started "
        f"(or raise {bound})."
    )


def leave_process_group(ctx: Context) -> None:
    """Teardown field: destroy the process group once nothing uses it any more."""
    check_context(ctx, "teardown")
    try:
        pending.settle()  # a save still writing finishes first: it writes over this world
    finally:
        # A DDP reducer still alive when a gloo group is destroyed can deadlock: collect first.
        gc.collect()
        _timeouts.clear()
        if dist.is_initialized():
            dist.destroy_process_group()


def leave(ctx: Context) -> None:
    """Teardown field of a world with nothing to release.

    Raises:
        UsageError: ``ctx`` is not a `Context` (as on N ranks).
    """
    check_context(ctx, "teardown")
    pending.settle()
