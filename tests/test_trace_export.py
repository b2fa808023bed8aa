"""traced() to a Chrome/Perfetto trace: ChromeTraceSink, chrome_trace, chrome_trace_events.

Every file is checked as a viewer reads it: it loads with ``json.load``, every
event has the Trace Event Format's keys with their types, spans on a track
nest or follow each other, and each rank is its own process (``pid``).
"""

from __future__ import annotations

import json
import pickle

import attrs
import pytest
import torch

import stratagem as sg
from helpers import make_batches, make_model
from stratagem.combinators.tracing import (
    LAUNCH_PID,
    ChromeTraceSink,
    chrome_trace,
    chrome_trace_events,
)

SLACK_US = 1.0  # start (time.time) and duration (perf_counter) come from two clocks
SPAN_KEYS = {
    "name": str,
    "cat": str,
    "ph": str,
    "ts": float,
    "dur": float,
    "pid": int,
    "tid": int,
    "args": dict,
}
META_KEYS = {"name": str, "ph": str, "pid": int, "tid": int, "args": dict}
META_NAMES = {"process_name", "process_sort_index", "thread_name"}


def mse(model, batch):
    inputs, targets = batch
    return torch.nn.functional.mse_loss(model(inputs), targets)


def train(strategy, ctx, steps=3):
    model = strategy.wrap(make_model(), ctx)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for inputs, targets in make_batches(steps=steps, size=8)[:steps]:
        mine = (inputs.chunk(ctx.world_size)[ctx.rank], targets.chunk(ctx.world_size)[ctx.rank])
        loss = strategy.step(model, mine, ctx, forward=mse)
        strategy.backward(loss, model, ctx)
        strategy.update(optimizer, model, ctx)
        strategy.reduce(loss.detach(), "mean", ctx)
    strategy.barrier(ctx)
    return [p.detach().clone() for p in sg.unwrap(model).parameters()]


def assert_valid_trace(trace):
    """The Trace Event Format, as chrome://tracing and Perfetto read it; returns the spans."""
    assert isinstance(trace, dict) and isinstance(trace["traceEvents"], list)
    assert trace["displayTimeUnit"] in ("ms", "ns")
    spans = []
    for event in trace["traceEvents"]:
        assert event["ph"] in ("X", "M"), event
        wanted = SPAN_KEYS if event["ph"] == "X" else META_KEYS
        for key, kind in wanted.items():
            assert isinstance(event[key], kind), (key, event)
            assert not isinstance(event[key], bool), (key, event)
        if event["ph"] == "X":
            assert event["dur"] >= 0 and event["ts"] > 1e15  # microseconds since the epoch
            assert event["cat"] in ("collective", "step", "lifecycle")
            assert set(event["args"]) == {"shapes", "dtypes", "error"}
            spans.append(event)
        else:
            assert event["name"] in META_NAMES
    return spans


def assert_spans_nest(spans):
    """On each track, a span either lies inside the open one or starts after it ends."""
    tracks = {}
    for span in spans:
        tracks.setdefault((span["pid"], span["tid"]), []).append(span)
    for track in tracks.values():
        track.sort(key=lambda s: (s["ts"], -s["dur"]))
        open_ends: list[float] = []
        for span in track:
            end = span["ts"] + span["dur"]
            while open_ends and span["ts"] >= open_ends[-1] - SLACK_US:
                open_ends.pop()
            if open_ends:
                assert end <= open_ends[-1] + SLACK_US, f"{span['name']} overlaps its parent"
            open_ends.append(end)


def track_names(trace):
    return {
        e["pid"]: e["args"]["name"]
        for e in trace["traceEvents"]
        if e["ph"] == "M" and e["name"] == "process_name"
    }


def test_trace_file_loads_as_trace_event_json_with_one_track(tmp_path):
    path = tmp_path / "trace.json"
    strategy = sg.traced(sg.single_device("cpu"), ChromeTraceSink(path))
    [params] = sg.launch(train, strategy)
    with open(path, encoding="utf-8") as file:
        trace = json.load(file)
    assert trace == ChromeTraceSink(path).load()
    spans = assert_valid_trace(trace)
    assert_spans_nest(spans)
    assert {s["pid"] for s in spans} == {0, LAUNCH_PID}
    assert track_names(trace) == {0: "rank 0", LAUNCH_PID: "launch"}
    names = [s["name"] for s in spans if s["pid"] == 0]
    assert names[:2] == ["setup", "wrap"] and names[-1] == "teardown"
    assert names.count("step") == names.count("update") == 3
    categories = {s["name"]: s["cat"] for s in spans}
    assert categories["reduce"] == categories["barrier"] == "collective"
    assert categories["step"] == categories["backward"] == categories["update"] == "step"
    assert categories["setup"] == categories["launch"] == "lifecycle"
    step = next(s for s in spans if s["name"] == "step")
    assert step["args"] == {
        "shapes": [[8, 6], [8, 2]],
        "dtypes": ["torch.float32"] * 2,
        "error": None,
    }
    untraced = sg.launch(train, sg.single_device("cpu"))[0]
    assert all(torch.equal(a, b) for a, b in zip(params, untraced, strict=True))


def test_a_call_inside_a_step_is_a_span_inside_the_steps_span(tmp_path):
    sink = ChromeTraceSink(tmp_path / "trace.json")
    strategy = sg.traced(sg.single_device("cpu"), sink)
    ctx = strategy.setup(sg.Env())

    def forward(model, batch):
        loss = mse(model, batch)
        strategy.reduce(loss.detach(), "sum", ctx)  # a collective inside the step
        return loss

    model = strategy.wrap(make_model(), ctx)
    strategy.step(model, make_batches(steps=1, size=4)[0], ctx, forward=forward)
    spans = assert_valid_trace(sink.load())
    assert_spans_nest(spans)
    step, reduce = (next(s for s in spans if s["name"] == name) for name in ("step", "reduce"))
    assert step["ts"] <= reduce["ts"] + SLACK_US
    assert reduce["ts"] + reduce["dur"] <= step["ts"] + step["dur"] + SLACK_US


def test_file_is_valid_after_every_event_and_keeps_errors(tmp_path):
    sink = ChromeTraceSink(tmp_path / "trace.json")
    event = sg.TraceEvent("reduce", 1, ((2, 3),), ("torch.float32",), 1.7e9, 0.25)
    for count in range(1, 4):
        sink(attrs.evolve(event, started=event.started + count))
        assert len(assert_valid_trace(sink.load())) == count
    sink(attrs.evolve(event, field="setup", error="RuntimeError"))
    trace = sink.load()
    [failed] = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["args"]["error"]]
    assert (failed["name"], failed["pid"], failed["args"]["error"]) == ("setup", 1, "RuntimeError")
    assert track_names(trace) == {1: "rank 1"}


def test_chrome_trace_of_json_lines_events_equals_the_sinks_file(tmp_path):
    lines, chrome = sg.JsonLinesSink(tmp_path / "t.jsonl"), ChromeTraceSink(tmp_path / "t.json")
    strategy = sg.traced(sg.single_device("cpu"), lambda event: (lines(event), chrome(event)))
    sg.launch(train, strategy, args=(2,))
    converted = chrome_trace(lines.events())
    assert converted == chrome.load()
    assert json.loads(json.dumps(converted)) == converted  # plain JSON values only
    first = lines.events()[0]
    assert [e["ph"] for e in chrome_trace_events(first)] == ["M", "M", "M", "X"]  # launch


def test_sink_is_a_picklable_value_and_checks_its_path(tmp_path):
    sink = ChromeTraceSink(tmp_path / "trace.json")
    assert pickle.loads(pickle.dumps(sink)) == sink
    assert sink.path == str(tmp_path / "trace.json")
    with pytest.raises(sg.UsageError, match=r"ChromeTraceSink: 'path' must be a non-empty str"):
        ChromeTraceSink("")
    with pytest.raises(sg.UsageError, match=r"ChromeTraceSink: 'path' must be"):
        ChromeTraceSink(3)  # type: ignore[arg-type]
    foreign = tmp_path / "notes.json"
    foreign.write_text('{"something": "else"}\n')
    event = sg.TraceEvent("step", 0, (), (), 1.7e9, 0.1)
    with pytest.raises(sg.UsageError, match=r"is not a trace this sink wrote .* new path"):
        ChromeTraceSink(foreign)(event)
    assert foreign.read_text() == '{"something": "else"}\n'  # left as it was


def two_ranks(strategy, ctx):
    return train(strategy, ctx)


@pytest.mark.slow
def test_two_spawned_ranks_share_one_file_each_its_own_track(tmp_path):
    path = tmp_path / "trace.json"
    ranks = sg.launch(
        two_ranks, sg.traced(sg.ddp_spawn(device="cpu"), ChromeTraceSink(path)), devices=2
    )
    assert all(torch.equal(a, b) for a, b in zip(*ranks, strict=True))
    with open(path, encoding="utf-8") as file:
        trace = json.load(file)
    spans = assert_valid_trace(trace)
    assert_spans_nest(spans)
    assert {s["pid"] for s in spans} == {0, 1, LAUNCH_PID}
    assert track_names(trace) == {0: "rank 0", 1: "rank 1", LAUNCH_PID: "launch"}
    for rank in (0, 1):
        mine = [s for s in spans if s["pid"] == rank]
        assert [s["name"] for s in mine].count("update") == 3
        assert sum(s["cat"] == "collective" for s in mine) == 4  # 3 reduces, 1 barrier
    [launch] = [s for s in spans if s["pid"] == LAUNCH_PID]
    for span in spans:  # the launch, in the parent, spans every rank's calls
        assert launch["ts"] - SLACK_US <= span["ts"]
        assert span["ts"] + span["dur"] <= launch["ts"] + launch["dur"] + SLACK_US
