"""Bad input to every public function: a clear error naming the argument, the value and the fix.

One row per (function, bad input, error type, fragments of the message). Each
error must be raised by stratagem's own code (the last frame of its traceback
lies in the package), never by torch deep below. The fields of every built-in
strategy are swept the same way by generated rows: a wrong first argument and
a wrong ``ctx``. What is documented behaviour rather than an error (a NaN loss
under ``"16-mixed"``) is tested after the table, and listed in docs/faults.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import stratagem as sg
from stratagem.checkpoint import describe, latest
from stratagem.strategy import FIELD_SIGNATURES

PACKAGE = Path(sg.__file__).resolve().parent


@attrs.define
class Kit:
    """What a row needs: a world of one on the CPU, a model, its optimizer, a directory."""

    tmp: Path
    monkeypatch: pytest.MonkeyPatch
    strategy: sg.Strategy = attrs.field(factory=lambda: sg.single_device("cpu"))
    ctx: sg.Context = attrs.field(
        factory=lambda: sg.Context(env=sg.Env(), device=torch.device("cpu"))
    )
    model: torch.nn.Module = attrs.field(factory=lambda: torch.nn.Linear(3, 2))
    optimizer: torch.optim.Optimizer = attrs.field(init=False)
    batch: torch.Tensor = attrs.field(factory=lambda: torch.ones(4, 3))

    def __attrs_post_init__(self) -> None:
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)

    def loss(self) -> torch.Tensor:
        return self.model(self.batch).pow(2).mean()

    def env(self) -> sg.Env:
        """What a user passes where the Context belongs, by mistake."""
        return sg.Env()


@pytest.fixture
def kit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Kit:
    return Kit(tmp_path, monkeypatch)


@attrs.frozen
class Row:
    function: str  # as a user would name it: "launch", "ddp().setup", "Spawn"
    bad: str
    call: Callable[[Kit], object]
    error: type[BaseException]
    fragments: tuple[str, ...]

    @property
    def id(self) -> str:
        return f"{self.function}: {self.bad}"


_experts = sg.every_module_of(torch.nn.Linear)


def _linear() -> torch.nn.Module:
    return torch.nn.Linear(3, 2)


def fn(strategy: Any, ctx: Any) -> int:
    return ctx.rank


def torchrun_world(kit: Kit, local_world_size: int) -> None:
    for name, value in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": str(local_world_size),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "MASTER_PORT": "29500",
    }.items():
        kit.monkeypatch.setenv(name, value)


def launch_under_torchrun(kit: Kit, devices: int) -> object:
    torchrun_world(kit, 2)
    return sg.launch(fn, sg.ddp(device="cpu"), devices=devices)


TWO_RANKS = sg.Env(rank=0, world_size=2, local_world_size=2, source="torchrun", master_port=29500)
NO_PORT = sg.Env(rank=0, world_size=2, local_world_size=2, source="torchrun", master_port=0)
THREE_RANKS = sg.Env(rank=0, world_size=3, local_world_size=3, source="torchrun", master_port=1)
META = torch.ones(4, 3, device="meta")
EMPTY = DataLoader(TensorDataset(torch.empty(0, 3)), batch_size=2)
NO_PARAMETERS = torch.nn.ReLU


def loss_without_parameters(kit: Kit) -> object:
    module = kit.strategy.wrap(NO_PARAMETERS(), kit.ctx)
    loss = kit.strategy.step(module, kit.batch, kit.ctx).sum()
    return kit.strategy.backward(loss, module, kit.ctx)


def save(kit: Kit, **options: Any) -> object:
    return kit.strategy.save(kit.tmp / "ckpt", {"model": kit.model}, kit.ctx, **options)


def load(kit: Kit, **options: Any) -> object:
    save(kit)
    return kit.strategy.load(kit.tmp / "ckpt", {"model": kit.model}, kit.ctx, **options)


def _requested_without_context() -> object:
    with sg.on_preemption() as preemption:
        return preemption.requested(None)  # type: ignore[arg-type]


def sharded(kit: Kit) -> sg.ShardedLoader:
    loader = sg.ddp(device="cpu").shard(DataLoader(TensorDataset(torch.arange(4))), kit.ctx)
    assert isinstance(loader, sg.ShardedLoader)
    return loader


def _plan() -> dict[str, object]:
    from torch.distributed.tensor.parallel import ColwiseParallel

    return {"0": ColwiseParallel()}


U, E, L = sg.UsageError, sg.EnvError, sg.LaunchError
S, C = sg.StrategyFieldError, sg.CombinatorError

ROWS: list[Row] = [
    # --- launch: devices, worlds that do not match the environment -----------------------
    Row("launch", "devices=0", lambda k: sg.launch(fn, k.strategy, devices=0), U,
        ("'devices' must be a positive int or 'auto'", "got 0, an int")),
    Row("launch", "devices=-2", lambda k: sg.launch(fn, k.strategy, devices=-2), U,
        ("'devices'", "got -2, an int")),
    Row("launch", "devices=True", lambda k: sg.launch(fn, k.strategy, devices=True), U,
        ("'devices'", "got True, a bool")),
    Row("launch", "devices='2'", lambda k: sg.launch(fn, k.strategy, devices="2"), U,
        ("'devices'", "got '2', a str")),
    Row("launch", "devices=2.0", lambda k: sg.launch(fn, k.strategy, devices=2.0), U,
        ("'devices'", "got 2.0, a float")),
    Row("launch", "fn not callable", lambda k: sg.launch(3, k.strategy), U,
        ("'fn' must be callable", "got 3, an int")),
    Row("launch", "not a strategy", lambda k: sg.launch(fn, "ddp"), U,
        ("'strategy' must be a Strategy", "got 'ddp', a str")),
    Row("launch", "args a str", lambda k: sg.launch(fn, k.strategy, args="ab"), U,
        ("'args' must be a tuple or list", "got 'ab', a str")),
    Row("launch", "devices=2 in a plain process", lambda k: sg.launch(fn, k.strategy, devices=2),
        L, ("devices=2", "started 1 process(es)", "torchrun --nproc-per-node 2", "ddp_spawn()")),
    Row("launch", "devices=3 where torchrun started 2", lambda k: launch_under_torchrun(k, 3), L,
        ("devices=3", "'torchrun' started 2", "pass devices=2 (or 'auto')")),
    Row("launch field", "in_place devices=0", lambda k: k.strategy.launch(fn, k.strategy, 0, ()),
        U, ("'devices' must be a positive int", "got 0, an int", "'auto'")),
    Row("launch field", "Spawn devices=-1",
        lambda k: sg.ddp_spawn(device="cpu").launch(fn, sg.ddp_spawn(device="cpu"), -1, ()), U,
        ("'devices' must be a positive int", "got -1, an int")),
    Row("launch field", "Spawn fn not callable",
        lambda k: sg.ddp_spawn(device="cpu").launch(None, sg.ddp_spawn(device="cpu"), 2, ()), U,
        ("'fn' must be callable", "got None")),
    Row("Spawn", "stop_grace=0", lambda k: sg.Spawn(stop_grace=0), U,
        ("Spawn.stop_grace must be a positive number of seconds", "got 0, an int")),
    Row("Spawn", "store_timeout=inf", lambda k: sg.Spawn(store_timeout=math.inf), U,
        ("Spawn.store_timeout", "at most 1000000", "got inf, a float")),
    Row("Spawn", "exit_timeout=nan", lambda k: sg.Spawn(exit_timeout=math.nan), U,
        ("Spawn.exit_timeout", "got nan, a float")),
    Row("ddp_spawn", "start=3", lambda k: sg.ddp_spawn(start=3, device="cpu"), U,
        ("'start' must be None or a Spawn", "got 3, an int", "Spawn(stop_grace=10)")),
    Row("fsdp_spawn", "start=False", lambda k: sg.fsdp_spawn(start=False, device="cpu"), U,
        ("'start' must be None or a Spawn", "got False, a bool")),
    Row("allreduce_grads_spawn", "start='spawn'",
        lambda k: sg.allreduce_grads_spawn(start="spawn", device="cpu"), U, ("'start'", "got 'spawn', a str")),
    # --- setup: a world the strategy cannot join ----------------------------------------
    Row("single_device().setup", "a world of 2", lambda k: k.strategy.setup(TWO_RANKS), L,
        ("single_device() runs one process", "world of 2", "use ddp()")),
    Row("dp().setup", "a world of 2", lambda k: sg.dp().setup(TWO_RANKS), L,
        ("dp() drives every GPU from one process", "world of 2", "use ddp()")),
    Row("ddp().setup", "a world of 2 without a port", lambda k: sg.ddp(device="cpu").setup(NO_PORT), L,
        ("world of 2 needs a rendezvous port", "master_port is 0", "set MASTER_PORT")),
    Row("fsdp().setup", "shard_size=2 on 3 ranks",
        lambda k: sg.fsdp(shard_size=2, device="cpu").setup(THREE_RANKS), U,
        ("shard_size=2", "does not divide the world of 3", "[1, 3]")),
    Row("dp().setup", "device_ids=[5] without CUDA",
        lambda k: sg.dp(device_ids=[5]).setup(sg.Env()), U,
        ("asks for GPU 5", "pass device_ids=None")),
    *[Row("single_device().setup", "cuda without CUDA",
          lambda k: sg.single_device("cuda:0").setup(sg.Env()), U,
          ("'cuda:0' was asked for", "CUDA is not available", "use device='cpu'"))]
    * (not torch.cuda.is_available()),
    # --- factories ------------------------------------------------------------------------
    Row("single_device", "device=3", lambda k: sg.single_device(3), U,
        ("'device' must be 'auto', a device string", "got 3, an int")),
    Row("single_device", "device='gpu'", lambda k: sg.single_device("gpu"), U,
        ("'device'", "got 'gpu', a str")),
    Row("dp", "device_ids=[]", lambda k: sg.dp(device_ids=[]), U,
        ("'device_ids' must be None", "got [], a list", "e.g. [0, 1]")),
    Row("dp", "device_ids=[0, 0]", lambda k: sg.dp(device_ids=[0, 0]), U,
        ("'device_ids'", "distinct", "got [0, 0]")),
    Row("ddp", "timeout=inf", lambda k: sg.ddp(timeout=math.inf, device="cpu"), U,
        ("'timeout' must be positive and at most 1000000 seconds", "got inf seconds")),
    Row("ddp", "timeout=nan", lambda k: sg.ddp(timeout=math.nan, device="cpu"), U,
        ("'timeout' must be positive", "got nan seconds")),
    Row("ddp", "timeout=timedelta.max", lambda k: sg.ddp(timeout=timedelta.max, device="cpu"), U,
        ("'timeout' must be positive and at most 1000000 seconds",)),
    Row("ddp", "timeout=-1", lambda k: sg.ddp(timeout=-1, device="cpu"), U, ("'timeout' must be positive",)),
    Row("ddp", "timeout='1h'", lambda k: sg.ddp(timeout="1h", device="cpu"), U,
        ("'timeout' must be seconds (a number) or a datetime.timedelta", "got '1h', a str")),
    Row("ddp", "backend='tcp'", lambda k: sg.ddp(backend="tcp", device="cpu"), U,
        ("'backend' must be None", "'gloo'", "got 'tcp', a str")),
    Row("ddp", "bucket_cap_mb=0", lambda k: sg.ddp(bucket_cap_mb=0, device="cpu"), U,
        ("ddp(bucket_cap_mb=...) must be None or a positive number of MiB", "got 0, an int")),
    Row("ddp", "bucket_cap_mb=nan", lambda k: sg.ddp(bucket_cap_mb=math.nan, device="cpu"), U,
        ("ddp(bucket_cap_mb=...) must be None or a positive number", "finite", "got nan, a float")),
    Row("ddp", "static_graph='yes'", lambda k: sg.ddp(static_graph="yes", device="cpu"), U,
        ("ddp(static_graph=...) must be True or False", "got 'yes', a str")),
    Row("fsdp", "shard_size=0", lambda k: sg.fsdp(shard_size=0, device="cpu"), U,
        ("'shard_size' must be 'world', 'node' or a positive int", "got 0, an int")),
    Row("fsdp", "shard_when=3", lambda k: sg.fsdp(shard_when=3, device="cpu"), U,
        ("fsdp(shard_when=...) must be None (shard the root only)", "every_module_of(MyBlock)", "got 3, an int")),
    Row("fsdp", "reshard_after_forward=1", lambda k: sg.fsdp(reshard_after_forward=1, device="cpu"), U,
        ("fsdp(reshard_after_forward=...)", "at least 2", "got 1, an int")),
    Row("fsdp", "mp_policy='bf16'", lambda k: sg.fsdp(mp_policy="bf16", device="cpu"), U,
        ("fsdp(mp_policy=...) must be None or a torch.distributed.fsdp.MixedPrecisionPolicy",
         "got 'bf16', a str")),
    Row("allreduce_grads", "bucket_mb=-1", lambda k: sg.allreduce_grads(bucket_mb=-1, device="cpu"), U,
        ("allreduce_grads(bucket_mb=...) must be a positive number of MiB", "got -1, an int")),
    Row("allreduce_grads", "compression='int8'",
        lambda k: sg.allreduce_grads(compression="int8", device="cpu"), U,
        ("allreduce_grads(compression=...) must be None", "'bf16', 'fp16'", "got 'int8', a str")),
    Row("every_module_of", "no types", lambda k: sg.every_module_of(), U,
        ("pass one or more torch.nn.Module subclasses", "got nothing")),
    Row("every_module_of", "an instance", lambda k: sg.every_module_of(torch.nn.Linear(1, 1)), U,
        ("torch.nn.Module subclasses", "a Linear")),
    Row("above_parameters", "count=-1", lambda k: sg.above_parameters(-1), U,
        ("'count' must be a non-negative int", "got -1, an int")),
    Row("shard_group", "no names", lambda k: sg.shard_group(), U,
        ("name one or more submodules, each once", "got (), a tuple")),
    Row("shard_group", "reshard_after_forward=1",
        lambda k: sg.shard_group("norm", reshard_after_forward=1), U,
        ("reshard_after_forward", "got 1, an int")),
    Row("ShardGroup", "modules as one str", lambda k: sg.ShardGroup("norm"), U,
        ("name one or more submodules", "got 'norm', a str")),
    Row("step_flops", "module not a module", lambda k: sg.step_flops("net", torch.ones(1)), U,
        ("'module' must be a torch.nn.Module", "got 'net', a str")),
    Row("step_flops", "forward returns no loss",
        lambda k: sg.step_flops(torch.nn.Linear(2, 2), torch.ones(1, 2), lambda m, b: m(b)), U,
        ("'forward' must return the loss, a tensor of one element", "a Tensor")),
    Row("rates", "seconds=0", lambda k: sg.rates(flops=1, tokens=1, seconds=0), U,
        ("'seconds' must be a number above 0", "got 0, an int")),
    Row("rates", "tokens=-1", lambda k: sg.rates(flops=1, tokens=-1, seconds=1), U,
        ("'tokens' must be a count >= 0", "got -1, an int")),
    Row("peak_flops", "device='gpu'", lambda k: sg.peak_flops("gpu"), U,
        ("peak_flops: 'device' must be", "got 'gpu', a str")),
    Row("dry_run", "world_size=0",
        lambda k: sg.dry_run(k.strategy, _linear, torch.ones(1, 3), world_size=0), U,
        ("dry_run: 'world_size' must be a positive int", "got 0, an int")),
    Row("dry_run", "a model, not its factory",
        lambda k: sg.dry_run(k.strategy, "net", torch.ones(1, 3), world_size=2), U,
        ("dry_run: 'model' must be a function that builds the model", "got 'net', a str")),
    Row("dry_run", "a factory returning no module",
        lambda k: sg.dry_run(k.strategy, lambda: 3, torch.ones(1, 3), world_size=1), U,
        ("'model' must be a function that returns a torch.nn.Module", "got 3, an int")),
    Row("dry_run", "micro_batches=0",
        lambda k: sg.dry_run(k.strategy, _linear, torch.ones(1, 3), world_size=2,
                             micro_batches=0), U,
        ("dry_run: 'micro_batches' must be a positive int", "got 0, an int")),
    Row("dry_run", "strategy named by a string",
        lambda k: sg.dry_run("fsdp", _linear, torch.ones(1, 3), world_size=2), U,
        ("dry_run: 'strategy' must be a Strategy", "write sg.fsdp()")),
    # --- combinators: unknown precision, bad options, not a strategy ----------------------
    Row("with_precision", "'fp8'", lambda k: sg.with_precision(k.strategy, "fp8"), U,
        ("'precision' must be one of '32-true'", "'16-mixed'", "got 'fp8', a str")),
    Row("with_precision", "None", lambda k: sg.with_precision(k.strategy, None), U,
        ("'precision' must be one of", "got None, a NoneType")),
    Row("with_precision", "not a strategy", lambda k: sg.with_precision("ddp", "16-mixed"), U,
        ("with_precision: 'strategy' must be a Strategy", "got 'ddp', a str", "write sg.ddp()")),
    Row("with_precision", "twice",
        lambda k: sg.with_precision(sg.with_precision(k.strategy, "16-mixed"), "bf16-mixed"), C,
        ("already has precision '16-mixed'", "apply with_precision once")),
    Row("hsdp", "replicate=0", lambda k: sg.hsdp(replicate=0, shard=2, device="cpu"), U,
        ("hsdp: 'replicate' must be a positive int", "got 0, an int")),
    Row("hsdp", "shard='2'", lambda k: sg.hsdp(replicate=2, shard="2", device="cpu"), U,
        ("hsdp: 'shard' must be a positive int", "got '2', a str")),
    Row("hsdp", "sizes over the world",
        lambda k: sg.hsdp(replicate=3, shard=2, device="cpu").setup(sg.Env(world_size=4, local_world_size=4)), U,
        ("replicate=3 x shard=2 is 6 ranks", "the world has 4 data-parallel ranks")),
    Row("with_activation_checkpointing", "policy='linear'",
        lambda k: sg.with_activation_checkpointing(k.strategy, "linear"), U,
        ("'policy' must be a function module -> bool", "got 'linear', a str")),
    Row("with_activation_checkpointing", "not a strategy",
        lambda k: sg.with_activation_checkpointing(None, bool), U,
        ("with_activation_checkpointing: 'strategy' must be a Strategy", "got None")),
    Row("tensor_parallel", "on ddp", lambda k: sg.tensor_parallel(sg.ddp(device="cpu"), _plan()), C,
        ("'ddp' does not build a device mesh", "tensor_parallel(sg.fsdp(), plan, size=2)")),
    Row("tensor_parallel", "size=1", lambda k: sg.tensor_parallel(sg.fsdp(device="cpu"), _plan(), size=1), U,
        ("tensor_parallel: 'size' must be an int of at least 2", "got 1, an int")),
    Row("tensor_parallel", "empty plan", lambda k: sg.tensor_parallel(sg.fsdp(device="cpu"), {}), U,
        ("tensor_parallel: 'plan' must be a non-empty mapping", "got {}")),
    Row("tensor_parallel", "not a style",
        lambda k: sg.tensor_parallel(sg.fsdp(device="cpu"), {"0": "colwise"}), U,
        ("plan['0'] must be a ParallelStyle", "ColwiseParallel()", "got 'colwise', a str")),
    Row("tensor_parallel", "twice",
        lambda k: sg.tensor_parallel(sg.tensor_parallel(sg.fsdp(device="cpu"), _plan()), _plan()), C,
        ("'fsdp+tp2' is already tensor parallel", "apply it once")),
    Row("tensor_parallel", "async_tp", lambda k: sg.tensor_parallel(sg.fsdp(device="cpu"), _plan(), async_tp="yes"), U,
        ("tensor_parallel: 'async_tp' must be a bool", "got 'yes', a str")),
    Row("tensor_parallel", "not a strategy", lambda k: sg.tensor_parallel(None, _plan()), U,
        ("tensor_parallel: 'strategy' must be a Strategy", "got None")),
    Row("context_parallel", "on ddp", lambda k: sg.context_parallel(sg.ddp(device="cpu")), C,
        ("'ddp' does not build a device mesh", "context_parallel(sg.fsdp(), size=2)")),
    Row("context_parallel", "size=1", lambda k: sg.context_parallel(sg.fsdp(device="cpu"), size=1), U,
        ("context_parallel: 'size' must be an int of at least 2", "got 1, an int")),
    Row("context_parallel", "seq_dim=-1", lambda k: sg.context_parallel(sg.fsdp(device="cpu"), seq_dim=-1), U,
        ("context_parallel: 'seq_dim' must be a non-negative int", "got -1, an int")),
    Row("context_parallel", "buffers", lambda k: sg.context_parallel(sg.fsdp(device="cpu"), buffers={"rope": "0"}), U,
        ("context_parallel: buffers['rope'] must be a non-negative int", "got '0', a str")),
    Row("context_parallel", "load_balance", lambda k: sg.context_parallel(sg.fsdp(device="cpu"), load_balance=1), U,
        ("context_parallel: 'load_balance' must be a bool", "got 1, an int")),
    Row("context_parallel", "twice",
        lambda k: sg.context_parallel(sg.context_parallel(sg.fsdp(device="cpu"))), C,
        ("'fsdp+cp2' is already context parallel", "apply it once")),
    Row("context_parallel", "not a strategy", lambda k: sg.context_parallel(None), U,
        ("context_parallel: 'strategy' must be a Strategy", "got None")),
    Row("context_parallel", "over the world",
        lambda k: sg.context_parallel(sg.fsdp(device="cpu"), size=3).setup(sg.Env(world_size=4, local_world_size=4)), U,
        ("context_parallel: size=3 does not divide the world of 4 ranks", "use one of [1, 2, 4]")),
    Row("expert_parallel", "on ddp", lambda k: sg.expert_parallel(sg.ddp(device="cpu"), experts=_experts), C,
        ("'ddp' does not build a device mesh", "expert_parallel(sg.fsdp(), experts=")),
    Row("expert_parallel", "on hsdp", lambda k: sg.expert_parallel(sg.hsdp(replicate=2, shard=2, device="cpu"), experts=_experts), C,
        ("experts are not split yet beside hybrid sharding (hsdp)", "use expert_parallel(sg.fsdp(), experts=...)")),
    Row("expert_parallel", "experts", lambda k: sg.expert_parallel(sg.fsdp(device="cpu"), experts="Experts"), U,
        ("expert_parallel: 'experts' must be a function module -> bool", "got 'Experts', a str")),
    Row("expert_parallel", "size=1", lambda k: sg.expert_parallel(sg.fsdp(device="cpu"), experts=_experts, size=1), U,
        ("expert_parallel: 'size' must be an int of at least 2", "got 1, an int")),
    Row("expert_parallel", "twice",
        lambda k: sg.expert_parallel(sg.expert_parallel(sg.fsdp(device="cpu"), experts=_experts), experts=_experts), C,
        ("'fsdp+ep2' is already expert parallel", "apply it once")),
    Row("expert_parallel", "not a strategy", lambda k: sg.expert_parallel(None, experts=_experts), U,
        ("expert_parallel: 'strategy' must be a Strategy", "got None")),
    Row("expert_parallel", "over the shard group",
        lambda k: sg.expert_parallel(sg.fsdp(device="cpu"), experts=_experts, size=3).setup(sg.Env(world_size=4, local_world_size=4)), U,
        ("expert_parallel: size=3 does not divide the shard group of 4 ranks", "use one of [2, 4]")),
    Row("with_float8", "recipe", lambda k: sg.with_float8(k.strategy, recipe="fp4"), U,
        ("with_float8: 'recipe' must be one of 'tensorwise', 'rowwise'", "got 'fp4', a str")),
    Row("with_float8", "modules not callable", lambda k: sg.with_float8(k.strategy, modules=3), U,
        ("with_float8: 'modules' must be a function module -> bool", "sg.float8_linears", "got 3")),
    Row("with_float8", "emulate", lambda k: sg.with_float8(k.strategy, emulate=1), U,
        ("with_float8: 'emulate' must be None (by device), True or False", "got 1, an int")),
    Row("with_float8", "twice", lambda k: sg.with_float8(sg.with_float8(k.strategy)), C,
        ("already trains in float8", "apply it once")),
    Row("with_float8", "not a strategy", lambda k: sg.with_float8(None), U,
        ("with_float8: 'strategy' must be a Strategy", "got None")),
    Row("float8_linears", "not a module", lambda k: sg.float8_linears("0"), U,
        ("float8_linears: 'module' must be a torch.nn.Module", "got '0', a str")),
    Row("with_clipping", "no bound", lambda k: sg.with_clipping(k.strategy), U,
        ("give max_norm", "or max_value",)),
    Row("with_clipping", "max_norm=inf", lambda k: sg.with_clipping(k.strategy, max_norm=math.inf),
        U, ("'max_norm' must be a positive finite number", "got inf, a float")),
    Row("with_clipping", "norm_type=0",
        lambda k: sg.with_clipping(k.strategy, max_norm=1.0, norm_type=0), U,
        ("'norm_type' must be positive", "got 0, an int")),
    Row("with_clipping", "not a strategy", lambda k: sg.with_clipping(None, max_norm=1.0), U,
        ("with_clipping: 'strategy' must be a Strategy", "got None")),
    Row("accumulate", "every=0", lambda k: sg.accumulate(k.strategy, 0), U,
        ("'every' must be a positive int", "got 0, an int")),
    Row("accumulate", "every=a function of no argument", lambda k: sg.accumulate(k.strategy, lambda: 2),
        U, ("'every' must be a positive int or a function of the world size", "every(world_size)",
            "cannot take one argument")),
    Row("accumulate(every=fn).setup", "fn returns 0",
        lambda k: sg.accumulate(k.strategy, lambda world_size: 0).setup(sg.Env()), U,
        ("'every' returned 0 (int) for world size 1", "must return a positive int")),
    Row("accumulate", "normalize='avg'", lambda k: sg.accumulate(k.strategy, 2, normalize="avg"),
        U, ("'normalize' must be 'mean', 'sum' or 'count'", "got 'avg', a str")),
    Row("accumulate", "not a strategy", lambda k: sg.accumulate(3, 2), U,
        ("accumulate: 'strategy' must be a Strategy", "got 3, an int")),
    Row("traced", "sink=3", lambda k: sg.traced(k.strategy, 3), U,
        ("'sink' must be callable as sink(event)", "got 3, an int", "JsonLinesSink(path)")),
    Row("traced", "not a strategy", lambda k: sg.traced({}, sg.ListSink()), U,
        ("traced: 'strategy' must be a Strategy", "got {}, a dict")),
    Row("checked", "compare_sites='no'", lambda k: sg.checked(k.strategy, compare_sites="no"), U,
        ("'compare_sites' must be True or False", "got 'no', a str")),
    Row("checked", "not a strategy", lambda k: sg.checked(k.ctx), U,
        ("checked: 'strategy' must be a Strategy", "a Context")),
    Row("compiled", "unknown option", lambda k: sg.compiled(k.strategy, modes="max"), U,
        ("torch.compile has no option 'modes'", "its options are", "mode")),
    Row("compiled", "not a strategy", lambda k: sg.compiled(sg.Spawn()), U,
        ("compiled: 'strategy' must be a Strategy", "a Spawn")),
    Row("JsonLinesSink", "path=3", lambda k: sg.JsonLinesSink(3), U,
        ("JsonLinesSink: 'path' must be a non-empty str or os.PathLike", "got 3, an int")),
    Row("JsonLinesSink", "path=''", lambda k: sg.JsonLinesSink(""), U,
        ("'path'", "got '', a str")),
    Row("ListSink", "events=3", lambda k: sg.ListSink(3), U,
        ("ListSink: 'events' must be a list", "got 3, an int")),
    # --- records: Strategy, Env, Context, samplers ------------------------------------------
    Row("Strategy", "reduce=3", lambda k: attrs.evolve(k.strategy, reduce=3), S,
        ("'reduce' must be callable as reduce(tensor, op, ctx)", "got 3, an int")),
    Row("Strategy", "step without forward=",
        lambda k: attrs.evolve(k.strategy, step=lambda module, batch, ctx: None), S,
        ("'step' must accept the arguments of step(module, batch, ctx, *, forward=None)",
         "'forward'")),
    Row("Strategy", "name=''", lambda k: attrs.evolve(k.strategy, name=""), S,
        ("'name' must be a non-empty str", "got '', a str")),
    Row("Env", "world_size=0", lambda k: sg.Env(world_size=0), E,
        ("Env.world_size must be a positive int", "got 0, an int")),
    Row("Env", "rank=2 of 2", lambda k: sg.Env(rank=2, world_size=2, local_world_size=2), E,
        ("Env.rank must be below world_size", "rank=2, world_size=2")),
    Row("Env", "source='mpi'", lambda k: sg.Env(source="mpi"), E,
        ("Env.source must be one of 'single', 'torchrun'", "got 'mpi', a str")),
    Row("Env", "master_addr=None", lambda k: sg.Env(master_addr=None), E,
        ("Env.master_addr must be a non-empty host name", "got None")),
    Row("Env", "agent_store='yes'", lambda k: sg.Env(agent_store="yes"), E,
        ("Env.agent_store must be True or False", "got 'yes', a str")),
    Row("MeshNames", "tp=''", lambda k: sg.MeshNames(tp=""), U,
        ("MeshNames.tp must be a non-empty str", "got '', a str")),
    Row("MeshNames", "two roles, one name", lambda k: sg.MeshNames(shard="dp", tp="dp"), U,
        ("MeshNames: each role needs a name of its own", "'shard': 'dp'")),
    Row("fsdp", "mesh_names=3", lambda k: sg.fsdp(device="cpu", mesh_names=3), U,
        ("'mesh_names' must be a MeshNames or a mapping of roles", "got 3, an int")),
    Row("fsdp", "mesh_names={'data': 'dp'}", lambda k: sg.fsdp(device="cpu", mesh_names={"data": "dp"}), U,
        ("'mesh_names' must be a MeshNames or a mapping of roles", "'shard': 'dp'")),
    Row("detect_env", "None", lambda k: sg.detect_env(None), U,
        ("'environ' must be a mapping", "os.environ", "got None")),
    Row("detect_env", "an int value", lambda k: sg.detect_env({"RANK": 0, "WORLD_SIZE": "1"}), E,
        ("environment variable RANK must be a str", "got 0, an int")),
    Row("detect_env", "RANK beyond WORLD_SIZE",
        lambda k: sg.detect_env({"RANK": "2", "WORLD_SIZE": "2"}), E,
        ("contradictory environment", "RANK='2'", "WORLD_SIZE='2'", "below world_size")),
    Row("Context", "env=None", lambda k: sg.Context(env=None, device=torch.device("cpu")), U,
        ("Context.env must be an Env", "got None", "detect_env(os.environ)")),
    Row("Context", "device='nowhere'", lambda k: sg.Context(env=sg.Env(), device="nowhere"), U,
        ("Context.device must be a torch.device", "got 'nowhere', a str", "torch.device('cpu')")),
    Row("Context", "device=0.5", lambda k: sg.Context(env=sg.Env(), device=0.5), U,
        ("Context.device must be a torch.device", "got 0.5, a float", "'cuda:0'")),
    Row("Context", "group=3", lambda k: sg.Context(env=sg.Env(), device=k.ctx.device, group=3),
        U, ("Context.group must be None", "ProcessGroup", "got 3, an int")),
    Row("Context", "extras=[1]",
        lambda k: sg.Context(env=sg.Env(), device=k.ctx.device, extras=[1]), U,
        ("Context.extras must be a mapping with str keys", "got [1], a list", "with_extras")),
    Row("Context.with_extras", "a key twice",
        lambda k: k.ctx.with_extras(a=1).with_extras(a=2), U,
        ("already holds ['a']", "a combinator applied twice")),
    Row("ShardSampler", "world_size=0", lambda k: sg.ShardSampler(size=3, rank=0, world_size=0),
        U, ("ShardSampler.world_size must be a positive int", "got 0, an int")),
    Row("ShardSampler", "rank=2 of 2", lambda k: sg.ShardSampler(size=3, rank=2, world_size=2),
        U, ("ShardSampler.rank must be below world_size", "rank=2, world_size=2")),
    Row("ShardSampler", "size=-1", lambda k: sg.ShardSampler(size=-1, rank=0, world_size=1), U,
        ("ShardSampler.size must be a non-negative int", "got -1, an int")),
    Row("ShardSampler", "shuffle='yes'",
        lambda k: sg.ShardSampler(size=3, rank=0, world_size=1, shuffle="yes"), U,
        ("ShardSampler.shuffle must be True or False", "got 'yes', a str")),
    Row("ShardSampler.set_epoch", "-1",
        lambda k: sg.ShardSampler(size=3, rank=0, world_size=1).set_epoch(-1), U,
        ("ShardSampler.epoch must be a non-negative int", "got -1, an int")),
    Row("seed_everything", "seed=-1", lambda k: sg.seed_everything(-1), U,
        ("seed_everything: 'seed' must be an int", "got -1, an int")),
    Row("spawned", "strategy=None", lambda k: sg.spawned(None), U,
        ("spawned: 'strategy' must be a Strategy", "got None", "sg.ddp()")),
    Row("spawned", "start=10", lambda k: sg.spawned(sg.ddp(device="cpu"), start=10), U,
        ("spawned: 'start' must be None or a Spawn", "got 10, an int", "Spawn(stop_grace=10)")),
    Row("spawned", "twice", lambda k: sg.spawned(sg.ddp_spawn(device="cpu")), C,
        ("spawned: 'ddp_spawn' already starts its own ranks",)),
    Row("StreamStride", "world_size=0", lambda k: sg.StreamStride([], rank=0, world_size=0), U,
        ("StreamStride.world_size must be a positive int", "got 0, an int")),
    Row("StreamStride", "rank=2 of 2", lambda k: sg.StreamStride([], rank=2, world_size=2), U,
        ("StreamStride.rank must be below world_size", "rank=2, world_size=2")),
    Row("StreamStride", "rank=-1", lambda k: sg.StreamStride([], rank=-1, world_size=2), U,
        ("StreamStride.rank must be a non-negative int", "got -1, an int")),
    Row("StreamStride.set_epoch", "'one'",
        lambda k: sg.StreamStride([], rank=0, world_size=1).set_epoch("one"), U,
        ("StreamStride.epoch must be a non-negative int", "got 'one', a str")),
    Row("ShardedLoader", "loader=[]",
        lambda k: sg.ShardedLoader(loader=[], sampler=sharded(k).sampler), U,
        ("ShardedLoader.loader must be a DataLoader", "got [], a list")),
    Row("ShardedLoader", "sampler=None",
        lambda k: sg.ShardedLoader(loader=sharded(k).loader, sampler=None), U,
        ("ShardedLoader.sampler must be a ShardSampler, a StreamStride or a", "got None")),
    Row("ShardedLoader.load_state_dict", "None", lambda k: sharded(k).load_state_dict(None), U,
        ("'state' must be the mapping state_dict returned", "got None")),
    Row("ShardedLoader.load_state_dict", "epoch=-1",
        lambda k: sharded(k).load_state_dict({"epoch": -1, "consumed": 0}), U,
        ("must hold non-negative ints 'epoch' and 'consumed'", "'epoch': -1")),
    # --- the training loop: module, batch, loss, optimizer, loader ------------------------
    Row("wrap", "a module without parameters under ddp",
        lambda k: sg.ddp(device="cpu").wrap(NO_PARAMETERS(), k.ctx), U,
        ("ReLU has no parameters that require grad", "wrap a trainable module")),
    Row("wrap", "a meta module under ddp",
        lambda k: sg.ddp(device="cpu").wrap(torch.nn.Linear(2, 2, device="meta"), k.ctx), U,
        ("Linear has parameters on the meta device", "module.to_empty(device=...)")),
    Row("backward", "a loss from a module without parameters", loss_without_parameters, U,
        ("'loss' does not require grad", "does the module have any?")),
    Row("backward", "a loss of shape (4, 2)",
        lambda k: k.strategy.backward(k.model(k.batch), k.model, k.ctx), U,
        ("'loss' must be a one-element tensor", "shape (4, 2)", "loss.mean()")),
    Row("backward", "a tuple of losses (torch would backpropagate each)",
        lambda k: k.strategy.backward((k.loss(), k.loss()), k.model, k.ctx), U,
        ("'loss' must be a one-element tensor", "a tuple); reduce it first")),
    Row("step", "a batch on the meta device", lambda k: k.strategy.step(k.model, META, k.ctx), U,
        ("a tensor of the batch", "on meta", "cannot be moved to device cpu",
         "a meta tensor holds no data")),
    Row("step", "a meta batch under bf16-true",
        lambda k: sg.with_precision(k.strategy, "bf16-true").step(
            k.model, {"x": [META]}, k.strategy.setup(sg.Env())), U,
        ("on meta", "cannot be moved")),
    Row("step", "forward=3", lambda k: k.strategy.step(k.model, k.batch, k.ctx, forward=3), U,
        ("'forward' must be None or a function forward(module, batch)", "got 3, an int")),
    Row("move_to_device", "a meta tensor", lambda k: sg.move_to_device([META], k.ctx.device), U,
        ("on meta", "cannot be moved")),
    Row("move_to_device", "device=3", lambda k: sg.move_to_device(k.batch, 3), U,
        ("'device' must be a torch.device or a device string", "got 3, an int")),
    Row("move_to_device", "device='gpu'", lambda k: sg.move_to_device(k.batch, "gpu"), U,
        ("'device' must be a torch.device or a device string", "got 'gpu', a str")),
    Row("update", "module and optimizer swapped",
        lambda k: k.strategy.update(k.model, k.optimizer, k.ctx), U,
        ("'optimizer' must be a torch.optim.Optimizer", "a Linear", "(optimizer, module, ctx)")),
    Row("update", "fsdp, optimizer=None",
        lambda k: sg.fsdp(device="cpu").update(None, k.model, k.ctx), U,
        ("'optimizer' must be a torch.optim.Optimizer", "got None")),
    Row("update", "allreduce_grads, optimizer=3",
        lambda k: sg.allreduce_grads(device="cpu").update(3, k.model, k.ctx), U,
        ("'optimizer'", "got 3, an int")),
    Row("update", "accumulate, a bad optimizer on a step that does not update",
        lambda k: sg.accumulate(k.strategy, 4).update(
            k.model, k.model, sg.accumulate(k.strategy, 4).setup(sg.Env())), U,
        ("'optimizer' must be a torch.optim.Optimizer", "a Linear")),
    Row("update", "16-mixed with another strategy's context",
        lambda k: sg.with_precision(k.strategy, "16-mixed").update(k.optimizer, k.model, k.ctx),
        U, ("ctx has no precision state", "the Context that this strategy's setup returned")),
    Row("reduce", "op='avg'", lambda k: k.strategy.reduce(torch.ones(2), "avg", k.ctx), U,
        ("'op' must be one of 'sum', 'mean', 'max', 'min'", "got 'avg', a str")),
    Row("reduce", "op=None, checked and traced",
        lambda k: sg.traced(sg.checked(k.strategy), sg.ListSink()).reduce(
            torch.ones(2), None, k.ctx), U, ("'op' must be one of", "got None")),
    Row("reduce", "mean of ints", lambda k: k.strategy.reduce(torch.ones(2).long(), "mean", k.ctx),
        U, ("'mean' of a torch.int64 tensor", "tensor.float()")),
    Row("reduce", "a float", lambda k: k.strategy.reduce(1.5, "sum", k.ctx), U,
        ("'tensor' must be a torch.Tensor", "got 1.5, a float", "torch.tensor(value)")),
    Row("broadcast", "src=1 on a world of one",
        lambda k: k.strategy.broadcast(1, k.ctx, src=1), U,
        ("'src' must be a rank in [0, 1)", "got 1, an int")),
    Row("shard", "an empty DataLoader under ddp",
        lambda k: sg.ddp(device="cpu").shard(EMPTY, k.ctx), U,
        ("the DataLoader's dataset (TensorDataset) is empty", "check where the data comes from")),
    Row("shard", "an empty DataLoader on one device", lambda k: k.strategy.shard(EMPTY, k.ctx), U,
        ("is empty",)),
    Row("shard", "a list under ddp", lambda k: sg.ddp(device="cpu").shard([1, 2], k.ctx), U,
        ("'loader' must be a torch DataLoader", "got [1, 2], a list",
         "items[ctx.rank::ctx.world_size]")),
    Row("clip_grad_norm", "max_norm=0", lambda k: sg.clip_grad_norm(k.model, 0), U,
        ("'max_norm' must be a positive number", "got 0, an int")),
    Row("clip_grad_norm", "norm_type='fro'",
        lambda k: sg.clip_grad_norm(k.model, 1.0, norm_type="fro"), U,
        ("'norm_type' must be a positive number", "got 'fro', a str")),
    Row("clip_grad_norm", "an optimizer for the module",
        lambda k: sg.clip_grad_norm(k.optimizer, 1.0), U,
        ("'module' must be a torch.nn.Module", "a SGD")),
    Row("broadcast_optimizer_state", "a module",
        lambda k: sg.broadcast_optimizer_state(k.model, k.ctx), U,
        ("'optimizer' must be a torch.optim.Optimizer", "a Linear")),
    Row("broadcast_optimizer_state", "src=-1",
        lambda k: sg.broadcast_optimizer_state(k.optimizer, k.ctx, src=-1), U,
        ("'src' must be a rank in [0, 1)", "got -1, an int")),
    Row("unwrap", "a str", lambda k: sg.unwrap("model"), U,
        ("unwrap: 'module' must be a torch.nn.Module", "got 'model', a str")),
    # --- checkpoints --------------------------------------------------------------------------
    Row("save", "path=None", lambda k: k.strategy.save(None, {}, k.ctx), U,
        ("save: 'path' must be a str or os.PathLike", "got None")),
    Row("save", "state a list", lambda k: k.strategy.save(k.tmp / "c", [k.model], k.ctx), U,
        ("'state' must be a mapping with non-empty str keys", "a list")),
    Row("save", "keep_last=0", lambda k: save(k, keep_last=0), U,
        ("'keep_last' must be None or a positive int", "got 0, an int")),
    Row("save", "rng='no'", lambda k: save(k, rng="no"), U,
        ("save: 'rng' must be True or False", "got 'no', a str")),
    Row("save", "an optimizer without its module",
        lambda k: k.strategy.save(k.tmp / "c", {"optim": k.optimizer}, k.ctx), U,
        ("holds the optimizer 'optim' but not the module", "add that module to state")),
    Row("save", "a value that is not plain",
        lambda k: k.strategy.save(k.tmp / "c", {"fn": fn}, k.ctx), U,
        ("the value 'fn' cannot be stored as a plain value", "state_dict()")),
    Row("save", "a reserved key",
        lambda k: k.strategy.save(k.tmp / "c", {"_stratagem_x": 1}, k.ctx), U,
        ("keys starting with '_stratagem' are reserved", "['_stratagem_x']")),
    Row("save", "over a directory that is not a checkpoint",
        lambda k: (k.tmp.joinpath("c").mkdir(), k.tmp.joinpath("c", "f").write_text("x"),
                   k.strategy.save(k.tmp / "c", {}, k.ctx)), sg.CheckpointError,
        ("exists and is not a stratagem checkpoint", "save elsewhere")),
    Row("save", "verify=1", lambda k: save(k, verify=1), U,
        ("save: 'verify' must be True or False", "got 1, an int")),
    Row("save", "blocking='no'", lambda k: save(k, blocking="no"), U,
        ("save: 'blocking' must be True or False", "got 'no', a str")),
    Row("resume_or_start", "directory=None",
        lambda k: sg.resume_or_start(None, {}, k.strategy, k.ctx), U,
        ("resume_or_start: 'directory' must be a str or os.PathLike", "got None")),
    Row("resume_or_start", "arguments in the wrong order",
        lambda k: sg.resume_or_start(k.tmp, {}, k.ctx, k.strategy), U,
        ("resume_or_start: 'strategy' must be a Strategy", "(directory, state, strategy, ctx)")),
    Row("resume_or_start", "state a list",
        lambda k: sg.resume_or_start(k.tmp, [k.model], k.strategy, k.ctx), U,
        ("resume_or_start: 'state' must be a mapping",)),
    Row("on_preemption", "signals a str", lambda k: sg.on_preemption("SIGTERM").__enter__(), U,
        ("on_preemption: 'signals' must be a non-empty sequence", "('SIGTERM', 'SIGUSR1')")),
    Row("on_preemption", "an unknown signal",
        lambda k: sg.on_preemption(["SIGTREM"]).__enter__(), U,
        ("'SIGTREM' in 'signals' is not a signal of this system",)),
    Row("on_preemption", "SIGKILL", lambda k: sg.on_preemption([9]).__enter__(), U,
        ("SIGKILL cannot be caught",)),
    Row("on_preemption", "requested() without a context",
        lambda k: _requested_without_context(), U,
        ("Preemption.requested: 'ctx' must be the Context",)),
    Row("ray_launcher", "num_workers=0", lambda k: sg.ray_launcher(num_workers=0), U,
        ("num_workers", "got 0, an int")),
    Row("ray_launcher", "timeout=-1", lambda k: sg.ray_launcher(timeout=-1), U,
        ("ray_launcher(timeout=...) must be a positive number of seconds", "got -1, an int")),
    Row("RayLaunch", "devices differ from num_workers",
        lambda k: sg.launch(fn, attrs.evolve(sg.ddp(device="cpu"), launch=sg.RayLaunch(num_workers=2)),
                            devices=3), L,
        ("num_workers",)),
    Row("pipeline", "schedule='zigzag'",
        lambda k: sg.pipeline(stages=[["0"]], schedule="zigzag", microbatches=2, device="cpu"), U,
        ("'zigzag'", "1f1b")),
    Row("pipeline", "microbatches=0", lambda k: sg.pipeline(stages=[["0"]], microbatches=0, device="cpu"), U,
        ("microbatches", "got 0")),
    Row("pipeline", "stages a str", lambda k: sg.pipeline(stages="0123", microbatches=2, device="cpu"), U,
        ("stages",)),
    Row("ChromeTraceSink", "path=None", lambda k: sg.ChromeTraceSink(None), U,
        ("ChromeTraceSink", "got None")),
    Row("chrome_trace", "not events", lambda k: sg.chrome_trace([1]), U, ("TraceEvent",)),
    Row("per_rank", "a per-rank value that is not plain",
        lambda k: k.strategy.save(k.tmp / "c", {"fn": sg.per_rank(fn)}, k.ctx), U,
        ("rank 0's value 'fn' cannot be stored as a plain value",)),
    Row("joined", "not a strategy", lambda k: sg.joined("ddp").__enter__(), U,
        ("joined: 'strategy' must be a Strategy", "got 'ddp', a str")),
    Row("joined", "env a dict", lambda k: sg.joined(k.strategy, env={}).__enter__(), U,
        ("joined: 'env' must be an Env", "detect_env(os.environ)")),
    Row("ddp", "arrival_timeout=0", lambda k: sg.ddp(arrival_timeout=0, device="cpu"), U,
        ("'arrival_timeout' must be a positive number of seconds", "got 0, an int")),
    Row("fsdp", "sync_module_states=1", lambda k: sg.fsdp(sync_module_states=1, device="cpu"), U,
        ("fsdp(sync_module_states=...) must be True or False", "got 1, an int")),
    Row("load", "strict='yes'", lambda k: load(k, strict="yes"), U,
        ("load: 'strict' must be True or False", "got 'yes', a str")),
    Row("load", "no checkpoint there",
        lambda k: k.strategy.load(k.tmp / "none", {}, k.ctx), FileNotFoundError,
        ("load: no checkpoint at", "none'")),
    Row("load", "a file, not a checkpoint",
        lambda k: (k.tmp.joinpath("f").write_text("x"), k.strategy.load(k.tmp / "f", {}, k.ctx)),
        sg.CheckpointError, ("is not a readable checkpoint", "it is a file")),
    Row("load", "another model",
        lambda k: (save(k), k.strategy.load(k.tmp / "ckpt", {"model": torch.nn.Linear(3, 3)},
                                            k.ctx)),
        sg.CheckpointError, ("does not match 'state'", "model/weight", "shape (2, 3)")),
    Row("describe", "path=3", lambda k: describe(3), U,
        ("describe: 'path' must be a str or os.PathLike", "got 3, an int")),
    Row("latest", "directory=None", lambda k: latest(None), U,
        ("latest: 'directory' must be a str or os.PathLike", "got None")),
]  # fmt: skip


# --- every field of every built-in: a wrong first argument, and a wrong ctx ------------------


def _builtins() -> dict[str, sg.Strategy]:
    single = sg.single_device("cpu")
    return {
        "single_device": single,
        "dp": sg.dp(),
        "ddp": sg.ddp(device="cpu"),
        "ddp_spawn": sg.ddp_spawn(device="cpu"),
        "fsdp": sg.fsdp(device="cpu"),
        "fsdp_spawn": sg.fsdp_spawn(device="cpu"),
        "allreduce_grads": sg.allreduce_grads(device="cpu"),
        "allreduce_grads_spawn": sg.allreduce_grads_spawn(device="cpu"),
        "16-mixed+clip+accumulate": sg.accumulate(
            sg.with_clipping(sg.with_precision(single, "16-mixed"), max_norm=1.0), 2
        ),
        "checked+traced": sg.traced(sg.checked(single), sg.ListSink()),
    }


BUILT_INS = _builtins()

# (field, call with a wrong first argument, the argument it names, the value shown)
WRONG_FIRST: dict[str, tuple[Callable[[sg.Strategy, Kit], object], str, str]] = {
    "launch": (lambda s, k: s.launch("train", s, 1, ()), "'fn'", "'train', a str"),
    "setup": (lambda s, k: s.setup(k.ctx), "'env'", "a Context"),
    "wrap": (lambda s, k: s.wrap(k.optimizer, k.ctx), "'module'", "a SGD"),
    "step": (lambda s, k: s.step(k.batch, k.model, k.ctx), "'module'", "a Tensor"),
    "backward": (lambda s, k: s.backward(k.model, k.model, k.ctx), "'loss'", "a Linear"),
    "update": (lambda s, k: s.update(k.model, k.model, k.ctx), "'optimizer'", "a Linear"),
    "no_sync": (lambda s, k: s.no_sync(k.optimizer, k.ctx), "'module'", "SGD"),
    "reduce": (lambda s, k: s.reduce([1.0], "sum", k.ctx), "'tensor'", "[1.0], a list"),
    "gather": (lambda s, k: s.gather(2, k.ctx), "'tensor'", "2, an int"),
    "broadcast": (lambda s, k: s.broadcast(1, k.ctx, src=3), "'src'", "3, an int"),
    "barrier": (lambda s, k: s.barrier(k.env()), "'ctx'", "an Env"),
    "shard": (lambda s, k: s.shard(7, k.ctx), "'loader'", "7, an int"),
    "save": (lambda s, k: s.save(7, {}, k.ctx), "'path'", "7, an int"),
    "load": (lambda s, k: s.load(b"ckpt", {}, k.ctx), "'path'", "b'ckpt', a bytes"),
    "teardown": (lambda s, k: s.teardown(k.env()), "'ctx'", "an Env"),
}

# (field, call with an Env where the Context belongs)
WRONG_CTX: dict[str, Callable[[sg.Strategy, Kit], object]] = {
    "wrap": lambda s, k: s.wrap(k.model, k.env()),
    "step": lambda s, k: s.step(k.model, k.batch, k.env()),
    "backward": lambda s, k: s.backward(k.loss(), k.model, k.env()),
    "update": lambda s, k: s.update(k.optimizer, k.model, k.env()),
    "no_sync": lambda s, k: s.no_sync(k.model, k.env()),
    "reduce": lambda s, k: s.reduce(torch.ones(2), "sum", k.env()),
    "gather": lambda s, k: s.gather(torch.ones(2), k.env()),
    "broadcast": lambda s, k: s.broadcast(torch.ones(2), k.env()),
    "barrier": lambda s, k: s.barrier(k.env()),
    "shard": lambda s, k: s.shard(DataLoader(TensorDataset(torch.ones(4))), k.env()),
    "save": lambda s, k: s.save(k.tmp / "c", {"model": k.model}, k.env()),
    "load": lambda s, k: s.load(k.tmp / "c", {"model": k.model}, k.env()),
    "teardown": lambda s, k: s.teardown(k.env()),
}


def _field_rows() -> Iterator[Row]:
    for name, strategy in BUILT_INS.items():
        for field, (call, argument, shown) in WRONG_FIRST.items():
            yield Row(
                f"{name}().{field}",
                f"wrong {argument}",
                lambda k, call=call, strategy=strategy: call(strategy, k),
                U,
                (f"{argument} must be", shown),
            )
        for field, call in WRONG_CTX.items():
            yield Row(
                f"{name}().{field}",
                "an Env for ctx",
                lambda k, call=call, strategy=strategy: call(strategy, k),
                U,
                (f"{field}: 'ctx' must be the Context that the strategy's setup returned", "Env("),
            )


FIELD_ROWS = list(_field_rows())


@pytest.mark.parametrize("row", ROWS + FIELD_ROWS, ids=lambda row: row.id)
def test_bad_input_gets_a_clear_error_from_stratagem(row: Row, kit: Kit) -> None:
    with pytest.raises(row.error) as caught:
        row.call(kit)
    message = str(caught.value)
    missing = [fragment for fragment in row.fragments if fragment not in message]
    assert not missing, f"{missing} not in: {message}"
    assert isinstance(caught.value, sg.StratagemError) or row.error is FileNotFoundError
    raised_in = Path(caught.traceback[-1].path).resolve()
    assert PACKAGE in raised_in.parents, f"raised in {raised_in}, not by stratagem"


ERRORS_AND_TYPES = {
    "CheckpointError",
    "CollectiveCallError",
    "CollectiveMismatchError",
    "CombinatorError",
    "DeviceFallbackWarning",
    "DeviceSpec",
    "EnvError",
    "LaunchError",
    "Preempted",
    "RankError",
    "ReduceOp",
    "StratagemError",
    "StrategyFieldError",
    "StrategyLike",
    "TraceEvent",  # a record the library fills in, not an input
    "Rates",  # likewise
    "DryRun",  # likewise
    "CollectiveCount",  # likewise
    "DryRunError",
    "UsageError",
}


def test_every_public_function_and_field_has_rows() -> None:
    named = {row.function.split(".")[0].split("(")[0] for row in ROWS}
    assert set(sg.__all__) - ERRORS_AND_TYPES - named == set()
    for name in BUILT_INS:
        swept = {
            row.function.rsplit(".", 1)[1]
            for row in FIELD_ROWS
            if row.function.startswith(f"{name}().")
        }
        assert swept == set(FIELD_SIGNATURES), name


# --- documented behaviour ---------------------------------------------------------------------


def nan_loss(module: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return module(batch).float().sum() * float("nan")


def squares(module: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return module(batch).float().pow(2).mean()


def test_a_nan_loss_under_16_mixed_skips_the_step_and_is_counted() -> None:
    strategy = sg.with_precision(sg.single_device("cpu"), "16-mixed")
    ctx = strategy.setup(sg.Env())
    state = ctx.extras["precision"]
    torch.manual_seed(0)
    model = strategy.wrap(torch.nn.Linear(3, 1), ctx)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    scale = state.scaler.get_scale()
    for _ in range(3):
        loss = strategy.step(model, torch.ones(2, 3), ctx, forward=nan_loss)
        assert loss.isnan()
        strategy.backward(loss, model, ctx)
        strategy.update(optimizer, model, ctx)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert optimizer.state == {}  # Adam never stepped: no NaN reached its moments
    assert all(p.grad is None for p in model.parameters())
    assert state.skipped == 3
    assert state.scaler.get_scale() == scale / 8  # halved at every skipped step
    loss = strategy.step(model, torch.ones(2, 3), ctx, forward=squares)  # a finite loss steps
    strategy.backward(loss, model, ctx)
    strategy.update(optimizer, model, ctx)
    assert state.skipped == 3
    assert not torch.equal(before[0], model.weight)
    assert all(p.isfinite().all() for p in model.parameters())


def test_plain_iterables_pass_through_shard_on_one_device(kit: Kit) -> None:
    batches = [torch.ones(2, 3)]
    assert kit.strategy.shard(batches, kit.ctx) is batches
    assert kit.strategy.shard([], kit.ctx) == []  # only DataLoaders are looked into


def test_a_module_without_parameters_wraps_on_one_device(kit: Kit) -> None:
    module = kit.strategy.wrap(NO_PARAMETERS(), kit.ctx)
    assert torch.equal(kit.strategy.step(module, -kit.batch, kit.ctx), torch.zeros(4, 3))


def test_shard_sampler_seeds_wrap_instead_of_overflowing() -> None:
    big = sg.ShardSampler(size=5, rank=0, world_size=1, shuffle=True, seed=2**64 - 1, epoch=2)
    same = sg.ShardSampler(size=5, rank=0, world_size=1, shuffle=True, seed=0, epoch=1)
    assert list(big) == list(same)
