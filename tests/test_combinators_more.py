"""compiled, traced, checked, precision under FSDP, and every combinator stacked.

Two-rank checks run on the session's `stratagem_world` where they fit in its
60 s timeout; the compiled DDP stack compiles on both ranks at once, which can
take longer on a loaded machine, so it runs in its own spawned launch.
"""

from __future__ import annotations

import collections
import functools
import pickle
import re

import attrs
import pytest
import torch
import torch.distributed as dist

import stratagem as sg
from helpers import make_inputs, make_model
from stratagem.combinators.checked import CheckedReduce, _mismatch

STEPS = 3
FEATURES = 4


model_factory = functools.partial(make_model, seed=3, features=FEATURES)
batches = functools.partial(make_inputs, steps=STEPS, features=FEATURES, seed=9)


def squares(model, batch):
    return model(batch).float().pow(2).mean()


def plain_training(size: int = 8, lr: float = 0.1) -> list[torch.Tensor]:
    model = model_factory()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for batch in batches(size=size):
        squares(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().float() for p in model.parameters()]


def full(parameter: torch.Tensor) -> torch.Tensor:
    gather = getattr(parameter, "full_tensor", None)  # FSDP's DTensor: every rank gathers it
    return (gather() if callable(gather) else parameter).detach().float().clone()


def train(strategy, ctx, micro: int = 1, size: int = 8, lr: float = 0.1):
    """Each rank takes its share of each batch in ``micro`` pieces; field calls are counted."""
    calls: collections.Counter[str] = collections.Counter({"wrap": 1})
    model = strategy.wrap(model_factory(), ctx)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    first_grad = None
    for index, batch in enumerate(batches(size=size)):
        mine = batch.chunk(ctx.world_size)[ctx.rank]
        for part, piece in enumerate(mine.chunk(micro)):
            loss = strategy.step(model, piece, ctx, forward=squares)
            strategy.backward(loss, model, ctx)
            if index == part == 0:  # a window's first backward: local (or held back) under no_sync
                grad = next(sg.unwrap(model).parameters()).grad
                first_grad = None if grad is None else full(grad)
            strategy.update(optimizer, model, ctx)
            calls.update(("step", "backward", "update"))
    loss = strategy.reduce(loss.detach(), "mean", ctx)
    calls["reduce"] += 1
    params = [full(p) for p in sg.unwrap(model).parameters()]
    return {
        "params": params,
        "calls": calls,
        "first_grad": first_grad,
        "model": type(model).__name__,
    }


def max_gap(ours, theirs) -> float:
    return max(float((a - b).abs().max()) for a, b in zip(ours, theirs, strict=True))


def error_of(fn):
    try:
        fn()
    except Exception as error:
        return type(error).__name__, str(error)
    return None


def discard(event):
    """A sink for runs whose trace nobody reads."""


def counts(events, rank=None):
    return collections.Counter(e.field for e in events if rank is None or e.rank == rank)


# --- compiled ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"modee": "default"}, r"torch.compile has no option 'modee'; its options are"),
        ({"model": None}, r"no option 'model'.*the module itself comes from wrap"),
        ({"mode": "fastest"}, r"rejects mode='fastest' \(RuntimeError: Unrecognized mode"),
        ({"backend": "nope"}, r"rejects backend='nope' \(InvalidBackend"),
        ({"mode": "default", "options": {"trace.enabled": True}}, r"give 'mode' or 'options'"),
    ],
)
def test_compiled_options_are_checked_when_applied(options, message):
    with pytest.raises(sg.UsageError, match=message):
        sg.compiled(sg.single_device("cpu"), **options)


@pytest.mark.slow
def test_compiled_equals_eager_on_a_single_device():
    [eager] = sg.launch(train, sg.single_device("cpu"), args=(2,))
    [result] = sg.launch(train, sg.compiled(sg.single_device("cpu"), dynamic=False), args=(2,))
    assert result["model"] == "OptimizedModule"
    assert max_gap(result["params"], eager["params"]) <= 1e-5
    assert max_gap(result["params"], [full(p) for p in model_factory().parameters()]) > 1e-3


# --- traced ------------------------------------------------------------------------------


def traced_loop(strategy, ctx, directory, untraced=None):
    """Train, then call every other field once; with ``untraced``, train that too for comparison."""
    result = train(strategy, ctx, micro=2)
    calls = result["calls"]
    tensor = torch.arange(6.0).reshape(2, 3)
    strategy.gather(tensor, ctx)
    strategy.broadcast(tensor, ctx, src=0)
    strategy.barrier(ctx)
    model = strategy.wrap(model_factory(), ctx)
    with strategy.no_sync(model, ctx):
        pass
    list(strategy.shard(torch.utils.data.DataLoader(tensor, batch_size=1), ctx))
    strategy.save(f"{directory}/checkpoint", {"model": model, "step": 3}, ctx)
    assert strategy.load(f"{directory}/checkpoint", {"model": model, "step": 0}, ctx)["step"] == 3
    calls.update(("gather", "broadcast", "barrier", "no_sync", "wrap", "shard", "save", "load"))
    plain = None if untraced is None else train(untraced, ctx, micro=2)["params"]
    return {"params": result["params"], "calls": calls, "untraced": plain}


def test_traced_equals_untraced_exactly_and_records_every_call(tmp_path):
    sink = sg.ListSink()
    strategy = sg.traced(sg.single_device("cpu"), sink)
    [result] = sg.launch(traced_loop, strategy, args=(str(tmp_path), sg.single_device("cpu")))
    assert all(torch.equal(a, b) for a, b in zip(result["params"], result["untraced"], strict=True))
    expected = result["calls"] + collections.Counter(["launch", "setup", "teardown"])
    assert counts(sink.events) == expected
    assert set(expected) == {f.name for f in attrs.fields(sg.Strategy)} - {"name"}  # all fields
    assert {e.rank for e in sink.events} == {None, 0}  # launch runs before there are ranks
    steps = [e for e in sink.events if e.field == "step"]
    assert steps[0].shapes == ((4, FEATURES),) and steps[0].dtypes == ("torch.float32",)
    assert all(e.duration_s >= 0 and e.error is None for e in sink.events)


def test_traced_records_a_call_that_raises_and_lets_the_error_through():
    sink = sg.ListSink()
    strategy = sg.traced(sg.single_device("cpu"), sink)
    ctx = strategy.setup(sg.Env())
    with pytest.raises(sg.UsageError, match="'op' must be one of"):
        strategy.reduce(torch.ones(2), "median", ctx)  # type: ignore[arg-type]
    assert sink.events[-1].field == "reduce"
    assert sink.events[-1].error == "stratagem.errors.UsageError"


def test_sinks(tmp_path):
    path = tmp_path / "trace.jsonl"
    sink = sg.JsonLinesSink(path)
    assert pickle.loads(pickle.dumps(sink)) == sink
    event = sg.TraceEvent("step", 1, ((2, 4), ()), ("torch.float32", "torch.int64"), 1.5, 0.25)
    sink(event)
    sink(attrs.evolve(event, rank=None, error="RuntimeError"))
    assert sink.events() == [event, attrs.evolve(event, rank=None, error="RuntimeError")]
    assert len(path.read_text().splitlines()) == 2
    listed = sg.ListSink()
    with pytest.raises(TypeError, match=r"spawned ranks need .* JsonLinesSink"):
        pickle.dumps(listed)
    with pytest.raises(sg.LaunchError, match="JsonLinesSink"):
        sg.launch(
            traced_loop, sg.traced(sg.ddp_spawn(device="cpu"), listed), devices=2, args=(tmp_path,)
        )
    [failed] = listed.events  # the launch itself was traced, with its error
    assert (failed.field, failed.rank, failed.error) == (
        "launch",
        None,
        "stratagem.errors.LaunchError",
    )
    assert repr(listed) == "ListSink(<1 events>)"


def traced_two_ranks(strategy, ctx, untraced, path, directory):
    result = traced_loop(strategy, ctx, directory, untraced)
    ok = all(torch.equal(a, b) for a, b in zip(result["params"], result["untraced"], strict=True))
    strategy.barrier(ctx)
    result["calls"]["barrier"] += 1
    return ok, result["calls"], sg.JsonLinesSink(path).events()


@pytest.mark.slow
def test_traced_ddp_equals_untraced_and_records_every_call_of_every_rank(stratagem_world, tmp_path):
    path = str(tmp_path / "trace.jsonl")
    strategy = sg.traced(sg.ddp(device="cpu"), sg.JsonLinesSink(path))
    ranks = stratagem_world.run(
        traced_two_ranks, strategy, sg.ddp(device="cpu"), path, str(tmp_path)
    )
    for rank, (bitwise, calls, events) in enumerate(ranks):
        assert bitwise, f"rank {rank}: traced training differs from untraced"
        assert counts(events, rank) == calls + collections.Counter(["setup"])  # joined once
        reduce = next(e for e in events if e.rank == rank and e.field == "reduce")
        assert reduce.shapes == ((),)


# --- checked -----------------------------------------------------------------------------


def reduce_here(strategy, ctx):
    return strategy.reduce(torch.ones(2), "sum", ctx)


def reduce_there(strategy, ctx):  # the same call from another line: another call site
    return strategy.reduce(torch.ones(2), "sum", ctx)


def disagree(strategy, ctx, relaxed):
    """Each case has the ranks call something different; every rank reports what it raised."""
    rank = ctx.rank
    x = torch.ones(3 + rank)
    cases = {
        "shapes": lambda: strategy.reduce(x, "sum", ctx),
        "ops": lambda: strategy.reduce(torch.ones(2), ("sum", "max")[rank], ctx),
        "barrier-vs-reduce": lambda: (
            strategy.barrier(ctx) if rank == 0 else strategy.reduce(torch.ones(2), "sum", ctx)
        ),
        "gather-dtypes": lambda: strategy.gather(
            torch.ones(2, dtype=(torch.float32, torch.int64)[rank]), ctx
        ),
        "broadcast-src": lambda: strategy.broadcast("hello", ctx, src=rank),
        "sites": lambda: (reduce_here, reduce_there)[rank](strategy, ctx),
    }
    out = {name: error_of(case) for name, case in cases.items()}
    # Different lines on purpose, allowed without sites; then symmetric code on a healthy group.
    out["relaxed"] = error_of(lambda: (reduce_here, reduce_there)[rank](relaxed, ctx))
    total = strategy.reduce(torch.tensor([1.0 + rank]), "sum", ctx)
    gathered = strategy.gather(torch.tensor([rank]), ctx)
    sent = strategy.broadcast({"from": rank}, ctx, src=1)
    strategy.barrier(ctx)
    out["symmetric"] = (total.tolist(), gathered.flatten().tolist(), sent)
    return out


@pytest.mark.slow
def test_checked_raises_on_every_rank_instead_of_hanging(stratagem_world):
    ranks = stratagem_world.run(
        disagree,
        sg.checked(sg.ddp(device="cpu")),
        sg.checked(sg.ddp(device="cpu"), compare_sites=False),
    )
    expected = {
        "shapes": ["reduce(op='sum', shape=(3,)", "reduce(op='sum', shape=(4,)"],
        "ops": ["reduce(op='sum', shape=(2,)", "reduce(op='max', shape=(2,)"],
        "barrier-vs-reduce": ["rank 0: barrier() at", "rank 1: reduce(op='sum'"],
        "gather-dtypes": ["dtype=torch.float32", "dtype=torch.int64"],
        "broadcast-src": ["broadcast(op='src=0')", "broadcast(op='src=1')"],
        "sites": ["rank 0: reduce(op='sum', shape=(2,)", "rank 1: reduce(op='sum', shape=(2,)"],
    }
    for rank, out in enumerate(ranks):
        for case, fragments in expected.items():
            kind, message = out[case]
            assert kind == "CollectiveMismatchError", (rank, case, out[case])
            assert "rank(s) [1] disagree with rank 0" in message, (rank, case, message)
            for fragment in fragments:
                assert fragment in message, (rank, case, message)
        assert out["relaxed"] is None
        assert out["symmetric"] == ([3.0], [0, 1], {"from": 1})
    assert re.search(
        r"rank 0: .* at test_combinators_more\.py:\d+ \(reduce_here\); "
        r"rank 1: .* at test_combinators_more\.py:\d+ \(reduce_there\)",
        ranks[0]["sites"][1],
    )


def test_checked_is_free_on_a_world_of_one(monkeypatch):
    strategy = sg.checked(sg.single_device("cpu"))
    ctx = strategy.setup(sg.Env())

    def no_collective(*args, **kwargs):
        raise AssertionError("a world of one exchanged a fingerprint")

    for name in ("all_reduce", "all_gather", "all_gather_object"):
        monkeypatch.setattr(dist, name, no_collective)
    assert strategy.reduce(torch.ones(2), "sum", ctx).tolist() == [1.0, 1.0]
    assert strategy.gather(torch.ones(2), ctx).shape == (1, 2)
    assert strategy.broadcast("x", ctx) == "x"
    strategy.barrier(ctx)


def test_fingerprint_digests_are_stable_and_sites_optional():
    a = sg.combinators.Fingerprint("reduce", "sum", (3,), "torch.float32", "a.py:1 (f)")
    b = attrs.evolve(a, site="a.py:2 (f)")
    assert a.digest(sites=True) == 3716517779267839467  # blake2b: the same in every process
    assert a.digest(sites=True) != b.digest(sites=True)
    assert a.digest(sites=False) == b.digest(sites=False)
    assert str(a) == "reduce(op='sum', shape=(3,), dtype=torch.float32) at a.py:1 (f)"
    error = _mismatch([a, b, a])
    assert isinstance(error, sg.StratagemError) and isinstance(error, RuntimeError)
    assert "rank(s) [1] disagree with rank 0" in str(error)
    assert "ranks 0, 2: reduce(" in str(error) and "rank 1: reduce(" in str(error)
    assert pickle.loads(pickle.dumps(error)).fingerprints == (a, b, a)


# --- precision under FSDP ----------------------------------------------------------------


def test_mixed_precision_leaves_fsdps_wrap_as_it_was_and_meets_it_in_the_context():
    # The policy is applied at wrap, from precision_of(ctx) (tests/test_precision_contract.py):
    # the record is not rewritten, so a layer between them, or a wrap of the user's, changes nothing.
    for stack in (sg.fsdp(device="cpu"), sg.traced(sg.fsdp(device="cpu"), sg.ListSink())):
        for precision in ("bf16-mixed", "16-mixed", "bf16-true"):
            assert sg.with_precision(stack, precision).wrap.inner == stack.wrap


def precision_run(strategy, ctx):
    seen = {}

    def forward(model, batch):
        loss = squares(model, batch)
        seen["param"] = str(model[0].weight.dtype)  # the root keeps them unsharded after forward
        seen["autocast"] = torch.is_autocast_enabled("cpu")
        return loss

    model = strategy.wrap(model_factory(), ctx)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for batch in batches():
        loss = strategy.step(model, batch.chunk(2)[ctx.rank], ctx, forward=forward)
        strategy.backward(loss, model, ctx)
        grad = next(model.parameters()).grad
        strategy.update(optimizer, model, ctx)
    return [full(p) for p in model.parameters()], seen, str(grad.dtype)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("precision", "dtype", "atol"),
    [("bf16-mixed", "torch.bfloat16", 2e-2), ("16-mixed", "torch.float16", 5e-3)],
)
def test_mixed_precision_under_fsdp_trains_close_to_32_true(
    stratagem_world, precision, dtype, atol
):
    strategy = sg.with_precision(sg.fsdp(device="cpu"), precision)
    reference = plain_training()
    for params, seen, grad_dtype in stratagem_world.run(precision_run, strategy):
        assert seen == {"param": dtype, "autocast": True}
        assert grad_dtype == "torch.float32"  # reduced and kept in float32
        assert max_gap(params, reference) <= atol


# --- refusals and fields -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("apply", "error", "message"),
    [
        (lambda s: sg.compiled(sg.compiled(s)), sg.CombinatorError, "already compiled"),
        (lambda s: sg.traced(sg.traced(s, print), print), sg.CombinatorError, "already traced"),
        (
            lambda s: sg.checked(sg.traced(sg.checked(s), print)),
            sg.CombinatorError,
            "already checked",
        ),
        (lambda s: sg.traced(s, "trace.jsonl"), sg.UsageError, r"'sink' must be callable"),
        (lambda s: sg.checked(s, compare_sites=1), sg.UsageError, "'compare_sites' must be"),
    ],
)
def test_orders_that_cannot_work_are_refused(apply, error, message):
    with pytest.raises(error, match=message):
        apply(sg.single_device("cpu"))


def test_combinators_touch_only_their_fields():
    base = sg.single_device("cpu")
    every = {f.name for f in attrs.fields(sg.Strategy)}
    touched = {
        "compiled": (sg.compiled(base), {"name", "wrap"}),
        "traced": (sg.traced(base, print), every),
        "checked": (sg.checked(base), {"name", "reduce", "gather", "broadcast", "barrier"}),
        "precision on fsdp": (
            sg.with_precision(sg.fsdp(device="cpu"), "bf16-mixed"),
            {"name", "setup", "wrap", "step"},
        ),
    }
    for what, (derived, fields) in touched.items():
        original = sg.fsdp(device="cpu") if what == "precision on fsdp" else base
        changed = {
            f.name
            for f in attrs.fields(sg.Strategy)
            if getattr(derived, f.name) != getattr(original, f.name)
        }
        assert changed == fields, what
    assert sg.checked(base).reduce == CheckedReduce(base.reduce)


# --- every combinator stacked ------------------------------------------------------------


def stack(base, sink, *, precision="32-true", compile_it=True):
    """All six in an order that works: compiled before accumulate (which holds no_sync), traced
    last so that it records the loop's calls rather than those accumulation passes on."""
    strategy = sg.checked(base)
    if compile_it:
        strategy = sg.compiled(strategy, dynamic=False)
    strategy = sg.with_precision(strategy, precision)
    strategy = sg.with_clipping(strategy, max_norm=1e6)
    return sg.traced(sg.accumulate(strategy, 2), sink)


def stacked_run(strategy, ctx, size):
    result = train(strategy, ctx, micro=2, size=size)
    strategy.barrier(ctx)
    result["calls"]["barrier"] += 1
    return result


@pytest.mark.slow
def test_every_combinator_stacked_on_single_device_equals_the_plain_loop():
    sink = sg.ListSink()
    [result] = sg.launch(stacked_run, stack(sg.single_device("cpu"), sink), args=(8,))
    assert max_gap(result["params"], plain_training()) <= 1e-5
    assert result["model"] == "OptimizedModule"
    recorded = counts(sink.events)
    for field, count in result["calls"].items():
        assert recorded[field] == count, field


@pytest.mark.slow
def test_every_combinator_stacked_on_ddp_equals_the_plain_loop(tmp_path):
    # 16 rows a step: each rank's micro-batches have the 4 rows of the single-device stack.
    sink = sg.JsonLinesSink(tmp_path / "trace.jsonl")
    ranks = sg.launch(stacked_run, stack(sg.ddp_spawn(device="cpu"), sink), devices=2, args=(16,))
    reference = plain_training(size=16)
    for result in ranks:
        assert max_gap(result["params"], reference) <= 1e-5
        assert result["model"] == "OptimizedModule"
    # The first micro-batch of a window ran under no_sync: gradients stayed local.
    assert not torch.allclose(ranks[0]["first_grad"], ranks[1]["first_grad"])
    events = sink.events()
    for rank, result in enumerate(ranks):
        recorded = counts(events, rank)
        for field, count in result["calls"].items():
            assert recorded[field] == count, (rank, field)


@pytest.mark.slow
def test_every_combinator_but_compile_stacked_on_fsdp_equals_the_plain_loop(
    stratagem_world, tmp_path
):
    sink = sg.JsonLinesSink(tmp_path / "trace.jsonl")
    exact = stack(
        sg.fsdp(shard_when=sg.every_module_of(torch.nn.Linear), device="cpu"),
        sink,
        compile_it=False,
    )
    ranks = stratagem_world.run(stacked_run, exact, 8)
    reference = plain_training()
    for result in ranks:
        assert max_gap(result["params"], reference) <= 1e-6
    assert [r["first_grad"] for r in ranks] == [None, None]  # held back until the window ends
    events = sink.events()
    for rank, result in enumerate(ranks):
        recorded = counts(events, rank)
        for field, count in result["calls"].items():
            assert recorded[field] == count, (rank, field)
    mixed = stack(sg.fsdp(device="cpu"), discard, precision="bf16-mixed", compile_it=False)
    for result in stratagem_world.run(stacked_run, mixed, 8):
        assert max_gap(result["params"], reference) <= 2e-2
