"""Launching on Ray: the `RayLaunch` launch field (also named `ray_launcher`).

``attrs.evolve(ddp(), launch=ray_launcher(num_workers=2))`` runs the same
training function as ``ddp_spawn()``, its ranks Ray actors instead of
processes this one spawned: launch by substitution, on an engine that scales
out. Ray is an optional extra (``pip install 'stratagem[ray]'``): importing
this module does not import it, and building or calling a launcher without it
is a `LaunchError` that names the fix (`NEEDS_RAY`).

How a launch runs (each step mirrors `Spawn`, and reuses its pieces from
`stratagem._processes`):

- ``fn``, the strategy and ``args`` are pickled here, before any worker starts,
  with Ray's cloudpickle: a function defined in the script (``__main__``) or a
  lambda travels by value, an importable one by name. Each actor receives this
  process's ``sys.path``, so what is importable here is importable there.
- This process serves the rendezvous store on 127.0.0.1 (`rendezvous`), so the
  actors are placed on this node (Ray's node affinity) and join as clients of
  that store, as torchrun's ranks join their agent's.
- Each actor gets the variables a rank reads (``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``,
  ``TORCHELASTIC_USE_AGENT_STORE``; ``GLOO_SOCKET_IFNAME=lo`` unless set) in its
  ``os.environ`` and runs ``strategy.setup(detect_env(os.environ))``, ``fn``,
  then ``strategy.teardown`` as a separate call, so a teardown that hangs loses
  no result (it is killed after ``exit_timeout``).
- A rank that raises is one `RankError` naming it, with its traceback; an actor
  that dies (killed, crashed) is a `RankError` naming its rank; either way the
  other actors are killed at once. Every wait is bounded: ``start_timeout`` for
  the actors to start, ``timeout`` for the run.
- If Ray is not initialised, the launcher starts a private local instance with
  just the CPUs the workers ask for and shuts it down afterwards; call
  ``ray.init()`` yourself to keep one across launches.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import math
import os
import pickle
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs

from stratagem._processes import (
    error_message,
    error_report,
    first_cause,
    local_variables,
    pack,
    prepare_rank,
    ran,
    remote_error,
    rendezvous,
    torn_down,
)
from stratagem.env import detect_env
from stratagem.errors import LaunchError, RankError
from stratagem.launching import check_field_arguments, in_place
from stratagem.strategy import StrategyLike
from stratagem.validators import MAX_SECONDS, field, is_int, positive_number

__all__ = ["NEEDS_RAY", "OBJECT_STORE_BYTES", "RayLaunch", "ray_launcher"]

NEEDS_RAY = (
    "ray_launcher needs Ray, which is not installed ({error}); run "
    "pip install 'stratagem[ray]' (or pip install 'ray>=2.9')."
)
"""The error of a Ray launch where ``import ray`` fails."""

OBJECT_STORE_BYTES = 256 * 2**20
"""Object store of the Ray instance a launcher starts: results are small, Ray spills the rest."""

# Seconds to wait, after a rank's collective failed, for what the others did before: Ray
# learns of a dead actor from its raylet, which takes longer than a pipe's EOF.
_CAUSE_GRACE = 3.0

_SECONDS = positive_number("ray_launcher({name}=...)", unit="seconds", at_most=MAX_SECONDS)
_WORKERS = field(
    lambda v: is_int(v, 1),
    "ray_launcher({name}=...)",
    "a positive int",
    optional="None (one worker per device)",
)
_CPUS = positive_number("ray_launcher({name}=...)", unit="CPUs", at_most=1024)
_FIX = (
    "; pass picklable arguments (no open files, locks or sockets), or build them inside the "
    "function"
)


def _ray_installed() -> bool:
    with contextlib.suppress(ValueError):  # a "ray" module without a spec: not Ray
        return importlib.util.find_spec("ray") is not None
    return False


def _ray() -> Any:
    """Import Ray, or say how to install it."""
    try:
        return importlib.import_module("ray")
    except ImportError as error:
        raise LaunchError(NEEDS_RAY.format(error=error)) from None


@attrs.frozen(kw_only=True)
class RayLaunch:
    """Launch field that runs each rank in a Ray actor on this machine (also `ray_launcher`).

    Substitute it for a strategy's launch field: the training function, the
    results (in rank order) and the errors (`RankError`) are those of
    ``ddp_spawn()``. Inside a world torchrun or SLURM started, it runs in place
    instead, as `Spawn` does. Whether Ray is installed is checked at
    construction, without importing it (that takes seconds); Ray is imported
    when a launch starts.

    Attributes:
        num_workers: how many ranks (actors) to start, or ``None`` for one per
            ``devices`` given to `launch`. When set, ``devices`` must equal it.
        cpus_per_worker: the CPUs each actor asks Ray for.
        timeout: seconds the whole run may take once the workers started; past
            it the workers are killed and the launch is a `LaunchError`.
        start_timeout: seconds for Ray to place and start every worker (and for
            the rendezvous store to wait for them).
        exit_timeout: seconds a rank gets for its teardown after it returned its
            result, before it is killed (its result is kept).

    Raises:
        LaunchError: Ray is not installed (`NEEDS_RAY`).
        UsageError: a setting is out of range (the message names it).

    Example:
        ``sg.launch(train, on_ray, devices=2)`` then runs ``train`` on two Ray actors:

        >>> import attrs, stratagem as sg
        >>> on_ray = attrs.evolve(sg.ddp(), launch=sg.ray_launcher(num_workers=2))
        >>> on_ray.launch.num_workers, on_ray.launch.exit_timeout
        (2, 30.0)
    """

    num_workers: int | None = attrs.field(default=None, validator=_WORKERS)
    cpus_per_worker: float = attrs.field(default=1.0, validator=_CPUS)
    timeout: float = attrs.field(default=86_400.0, validator=_SECONDS)
    start_timeout: float = attrs.field(default=120.0, validator=_SECONDS)
    exit_timeout: float = attrs.field(default=30.0, validator=_SECONDS)

    def __attrs_post_init__(self) -> None:
        if not _ray_installed():  # refused when built, not only when a launch starts
            raise LaunchError(NEEDS_RAY.format(error="No module named 'ray'"))

    def __call__(
        self, fn: Callable[..., Any], strategy: StrategyLike, devices: int, args: Sequence[Any]
    ) -> list[Any]:
        check_field_arguments(fn, devices, args)
        if detect_env(os.environ).is_distributed:  # never a launcher inside another's world
            return in_place(fn, strategy, devices, args)
        if self.num_workers is not None and devices != self.num_workers:
            raise LaunchError(
                f"launch: devices={devices} but ray_launcher(num_workers={self.num_workers}) "
                f"starts {self.num_workers} worker(s); pass devices={self.num_workers}, or "
                "build ray_launcher() without num_workers to start one worker per device."
            )
        ray = _ray()  # after the checks that need no Ray: a mistake reads the same everywhere
        payload = pack(fn, strategy, args, dumps=ray.cloudpickle.dumps, to="Ray workers", fix=_FIX)
        cpus = math.ceil(devices * self.cpus_per_worker)
        with _local_ray(ray, cpus), rendezvous(self.start_timeout) as port:
            return _RayWorld(self, ray, devices, port, payload).run()


ray_launcher = RayLaunch
"""``ray_launcher(**settings)`` builds a `RayLaunch`: the name the docs and examples use."""


@contextlib.contextmanager
def _local_ray(ray: Any, cpus: int) -> Iterator[None]:
    """Use the Ray instance this process joined, or start a private one for this launch."""
    if ray.is_initialized():
        yield
        return
    import logging

    ray.init(
        address="local",  # a fresh local instance, never a cluster picked from the environment
        num_cpus=cpus,
        object_store_memory=OBJECT_STORE_BYTES,
        include_dashboard=False,
        logging_level=logging.ERROR,
    )
    try:
        yield
    finally:
        ray.shutdown()


class _RankActor:
    """One rank in a Ray actor: ``start``, ``run`` (setup and ``fn``), ``leave`` (teardown)."""

    def __init__(self) -> None:
        self._strategy: Any = None
        self._ctx: Any = None

    def start(self, environ: dict[str, str], path: list[str]) -> int:
        """Take the rank's variables and the launcher's import path; return this pid."""
        os.environ.update(environ)
        sys.path[:0] = [entry for entry in path if entry not in sys.path]
        return os.getpid()

    def run(self, payload: bytes) -> tuple[Any, ...]:
        """Join, run ``fn``; return ``("ok", pickled result)`` or an error report."""
        try:
            env = detect_env(os.environ)
            prepare_rank(env)
            fn, strategy, args = pickle.loads(payload)
            self._strategy = strategy
            self._ctx = strategy.setup(env)
            result = ran(fn, strategy, self._ctx, args)
            # Pickled here, so that a result that cannot travel is this rank's error.
            return ("ok", importlib.import_module("ray").cloudpickle.dumps(result))
        except BaseException as error:  # report everything, KeyboardInterrupt included
            report = error_report(error)
            with contextlib.suppress(BaseException):  # the first error is the one to report
                self.leave()
            return report

    def leave(self) -> tuple[Any, ...]:
        """Tear down the world this rank joined (once); return ``("ok",)`` or an error report."""
        ctx, self._ctx = self._ctx, None
        try:
            if ctx is not None:
                torn_down(self._strategy, ctx)
        except BaseException as error:
            return error_report(error)
        return ("ok",)


def _first_line(error: BaseException) -> str:
    """Return the first line of Ray's (long) message."""
    lines = [line.strip() for line in error_message(error).splitlines() if line.strip()]
    return lines[0] if lines else "no message"


@attrs.define
class _RayWorld:
    """The launcher's view of the actors, for one launch."""

    options: RayLaunch
    ray: Any
    devices: int
    port: int
    payload: bytes
    actors: list[Any] = attrs.field(factory=list)
    pids: list[int | None] = attrs.field(factory=list)

    def run(self) -> list[Any]:
        try:
            self._start()
            return self._collect()
        finally:
            for actor in self.actors:
                with contextlib.suppress(Exception):
                    self.ray.kill(actor, no_restart=True)

    def _start(self) -> None:
        ray = self.ray
        affinity = importlib.import_module("ray.util.scheduling_strategies")
        here = affinity.NodeAffinitySchedulingStrategy(
            node_id=ray.get_runtime_context().get_node_id(), soft=False
        )
        remote = ray.remote(_RankActor).options(
            num_cpus=self.options.cpus_per_worker,
            scheduling_strategy=here,
            max_restarts=0,
            max_task_retries=0,
        )
        self.actors = [remote.remote() for _ in range(self.devices)]
        self.pids = [None] * self.devices
        path = [entry for entry in sys.path if entry]
        started = {
            actor.start.remote(local_variables(rank, self.devices, self.port), path): rank
            for rank, actor in enumerate(self.actors)
        }
        ready, waiting = ray.wait(
            list(started), num_returns=len(started), timeout=self.options.start_timeout
        )
        for ref in ready:
            rank = started[ref]
            try:
                self.pids[rank] = ray.get(ref)
            except ray.exceptions.RayError as error:  # unschedulable here, or died starting
                raise LaunchError(
                    f"launch: Ray could not start the worker of rank {rank} "
                    f"({type(error).__name__}: {_first_line(error)}); {self._resources()}"
                ) from None
        if waiting:
            missing = ", ".join(str(started[ref]) for ref in waiting)
            raise LaunchError(
                f"launch: Ray did not start worker(s) for rank(s) {missing} within "
                f"start_timeout={self.options.start_timeout} s; {self._resources()}"
            )

    def _resources(self) -> str:
        """Say what the workers ask for and what Ray has, with the fixes."""
        free = self.ray.available_resources().get("CPU", 0)
        total = self.ray.cluster_resources().get("CPU", 0)
        return (
            f"each of the {self.devices} asks for {self.options.cpus_per_worker} CPU(s) on "
            f"this node and Ray has {free} free of {total}. Lower cpus_per_worker or "
            "num_workers, free the CPUs, or raise start_timeout."
        )

    def _collect(self) -> list[Any]:
        """Wait for every rank's result and teardown; raise on the first error or death."""
        ray, options = self.ray, self.options
        runs = {actor.run.remote(self.payload): rank for rank, actor in enumerate(self.actors)}
        # Queued behind each run: a rank tears down as soon as it returned, as a spawned one does.
        leaves = {actor.leave.remote(): rank for rank, actor in enumerate(self.actors)}
        results: dict[int, Any] = {}
        done_at: dict[int, float] = {}
        deadline = time.monotonic() + options.timeout
        watching = {**runs, **leaves}
        while watching:
            now = time.monotonic()
            for ref, rank in list(watching.items()):
                lingering = ref in leaves and rank in done_at
                if lingering and now - done_at[rank] > options.exit_timeout:
                    del watching[ref]  # its result is kept; the actor is killed at the end
            if not watching:
                break
            if all(ref in leaves and rank in done_at for ref, rank in watching.items()):
                wait = min(done_at[r] + options.exit_timeout for r in watching.values()) - now
            else:
                wait = deadline - now
                if wait <= 0:
                    running = sorted({r for ref, r in watching.items() if ref in runs})
                    raise LaunchError(
                        f"launch: rank(s) {', '.join(map(str, running))} still running after "
                        f"timeout={options.timeout} s; their Ray workers were killed. Raise "
                        "ray_launcher(timeout=...) for longer runs."
                    )
            ready, _ = ray.wait(list(watching), num_returns=1, timeout=max(0.0, wait))
            for ref in ready:
                rank = watching.pop(ref)
                outcome = self._outcome(rank, ref)
                if isinstance(outcome, RankError) and outcome.exc_type is None and rank in results:
                    continue  # died in teardown, after its result: the result stands
                if isinstance(outcome, RankError):
                    if ref in runs:
                        outcome = first_cause(outcome, results, self._late(rank, runs, results))
                    raise outcome
                if ref in runs:
                    results[rank] = pickle.loads(outcome[1])
                    done_at[rank] = time.monotonic()
        return [results[rank] for rank in range(self.devices)]

    def _outcome(self, rank: int, ref: Any) -> tuple[Any, ...] | RankError:
        """Return what a finished call of ``rank`` says: ``("ok", ...)``, or the error to raise."""
        try:
            outcome: tuple[Any, ...] = self.ray.get(ref)
        except self.ray.exceptions.RayError as error:
            return self._death(rank, error)
        if outcome[0] == "error":
            return remote_error(rank, list(outcome[1:]))
        return outcome

    def _death(self, rank: int, error: BaseException) -> RankError:
        """Describe a rank whose actor ended without reporting (killed, crashed)."""
        pid = self.pids[rank] if rank < len(self.pids) else None
        worker = "its Ray worker" + (f" (process {pid})" if pid is not None else "")
        cause = f"{type(error).__name__}: {_first_line(error)}"
        return RankError(
            rank, exc_type=None, message=f"{worker} died without reporting a result ({cause})"
        )

    def _late(
        self, rank: int, runs: dict[Any, int], results: dict[int, Any]
    ) -> Iterator[tuple[int, RankError | None]]:
        """Yield how the other runs ended before ``rank``'s error, for `first_cause`."""
        others = {ref: r for ref, r in runs.items() if r != rank and r not in results}
        if not others:
            return
        ready, _ = self.ray.wait(list(others), num_returns=len(others), timeout=_CAUSE_GRACE)
        for ref in ready:
            outcome = self._outcome(others[ref], ref)
            if not isinstance(outcome, RankError):
                yield others[ref], None  # it returned; only the fact matters now
            elif outcome.exc_type is None:
                yield others[ref], outcome  # that rank died: the cause
