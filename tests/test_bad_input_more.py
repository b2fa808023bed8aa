"""Inputs that were accepted and then failed later, far away (issues 39 and 40).

Each is now refused where it is given, in one line naming the input, the value
and the fix, and nothing is written.
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest

import stratagem as sg
from helpers import free_port
from stratagem.process_group import JoinProcessGroup

# ------------------------------------------------------------------- trace sinks


@pytest.mark.parametrize("sink", [sg.JsonLinesSink, sg.ChromeTraceSink])
def test_a_trace_sink_in_a_missing_directory_is_refused_at_construction(
    sink: type, tmp_path: Path
) -> None:
    path = tmp_path / "missing" / "trace.json"
    with pytest.raises(sg.UsageError) as caught:
        sink(path)
    message = str(caught.value)
    assert message.startswith(f"{sink.__name__}: 'path' is in a directory that does not exist")
    assert repr(str(tmp_path / "missing")) in message and "create it first" in message
    assert "\n" not in message
    assert not (tmp_path / "missing").exists()


@pytest.mark.parametrize("sink", [sg.JsonLinesSink, sg.ChromeTraceSink])
def test_a_trace_sink_on_a_directory_or_under_a_file_is_refused(sink: type, tmp_path: Path) -> None:
    with pytest.raises(sg.UsageError, match="is a directory"):
        sink(tmp_path)
    (tmp_path / "file").write_text("")
    with pytest.raises(sg.UsageError, match="is not a directory"):
        sink(tmp_path / "file" / "trace.json")


def test_a_trace_sink_in_an_existing_directory_still_writes(tmp_path: Path) -> None:
    sink = sg.JsonLinesSink(tmp_path / "trace.jsonl")
    strategy = sg.traced(sg.single_device("cpu"), sink)
    strategy.setup(sg.Env())
    assert [e.field for e in sink.events()] == ["setup"]


# ------------------------------------------------------------------- numeric options


@pytest.mark.parametrize("value", [1e300, 2.0**43, 10**30])
def test_ddp_refuses_a_bucket_cap_that_the_reducer_cannot_hold(value: object) -> None:
    with pytest.raises(sg.UsageError) as caught:
        sg.ddp(bucket_cap_mb=value, device="cpu")  # type: ignore[arg-type]
    message = str(caught.value)
    assert message.startswith("ddp(bucket_cap_mb=...) must be None or a positive number of MiB")
    assert "at most 1048576" in message and "one bucket" in message


def test_ddp_accepts_a_bucket_cap_up_to_the_bound() -> None:
    sg.ddp(bucket_cap_mb=2**20, device="cpu")
    sg.ddp(bucket_cap_mb=0.5, device="cpu")


@pytest.mark.parametrize("value", [10**30, 2**16 + 1])
def test_pipeline_refuses_more_micro_batches_than_a_schedule_can_hold(value: int) -> None:
    with pytest.raises(sg.UsageError) as caught:
        sg.pipeline(stages=[["0"], ["1"]], microbatches=value, device="cpu")
    message = str(caught.value)
    assert message.startswith("pipeline: 'microbatches' must be at most 65536")
    assert str(value) in message


# ------------------------------------------------------------------- preemption signals


@pytest.mark.parametrize("bad", [True, False, 1.0, None])
def test_on_preemption_refuses_a_signal_that_is_no_name_or_number(bad: object) -> None:
    with pytest.raises(sg.UsageError) as caught, sg.on_preemption(signals=[bad]):  # type: ignore[list-item]
        pass
    message = str(caught.value)
    assert message.startswith("on_preemption: each of 'signals' must be a signal name or number")
    assert repr(bad) in message and "'SIGTERM'" in message


# ------------------------------------------------------------------- SLURM_NODELIST


@pytest.mark.parametrize("nodelist", ["n[1-", "n[]", "n[1-2", "n]", "n[1-2]x[", "n[a-b]", "n[3,]"])
def test_a_malformed_slurm_nodelist_is_refused(nodelist: str) -> None:
    environ = {
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NTASKS": "2",
        "SLURM_NODELIST": nodelist,
        "SLURM_JOB_ID": "5",
    }
    with pytest.raises(sg.EnvError) as caught:
        sg.detect_env(environ)
    message = str(caught.value)
    assert f"SLURM_NODELIST is malformed (got {nodelist!r})" in message
    assert "MASTER_ADDR" in message


@pytest.mark.parametrize(
    ("nodelist", "host"),
    [("gpu[007-009,12],cpu1", "gpu007"), ("node1", "node1"), ("a-b[3]", "a-b3"), ("n[5],m", "n5")],
)
def test_well_formed_nodelists_still_give_their_first_host(nodelist: str, host: str) -> None:
    environ = {
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NTASKS": "1",
        "SLURM_NODELIST": nodelist,
        "SLURM_JOB_ID": "5",
    }
    assert sg.detect_env(environ).master_addr == host


# ------------------------------------------------------------------- join_timeout above timeout


def two_rank_env(rank: int, port: int) -> sg.Env:
    return sg.Env(rank=rank, world_size=2, local_world_size=2, master_port=port, source="slurm")


def test_a_join_bounded_by_the_timeout_names_the_timeout_not_join_timeout() -> None:
    join = JoinProcessGroup(timeout=timedelta(seconds=2), join_timeout=600)
    start = time.monotonic()
    with pytest.raises(sg.LaunchError) as caught:
        join(two_rank_env(0, free_port()))
    message = str(caught.value)
    assert "did not join within 2 s" in message
    assert "raise the setup's join_timeout" not in message
    assert "raise the setup's timeout (2 s), which bounds joining too" in message
    assert "join_timeout=600 s" in message
    assert time.monotonic() - start < 30


def test_a_join_bounded_by_join_timeout_still_advises_raising_it() -> None:
    with pytest.raises(sg.LaunchError, match="raise the setup's join_timeout"):
        JoinProcessGroup(join_timeout=2)(two_rank_env(0, free_port()))
