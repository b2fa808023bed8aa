"""detect_env on generated environments: valid ones give the right ranks, invalid ones a named error."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import stratagem as sg
from stratagem.testing import strategies as kit


@st.composite
def worlds(draw: st.DrawFn) -> tuple[int, int, int, int, int]:
    """(nodes, per_node, node, local_rank, rank) of a consistent world."""
    nodes = draw(st.integers(1, 8))
    per_node = draw(st.integers(1, 8))
    node = draw(st.integers(0, nodes - 1))
    local_rank = draw(st.integers(0, per_node - 1))
    return nodes, per_node, node, local_rank, node * per_node + local_rank


@given(worlds(), st.integers(1, 65535), st.booleans())
def test_torchrun_environment_round_trips(world, port, agent):
    nodes, per_node, node, local_rank, rank = world
    environ = {
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(nodes * per_node),
        "LOCAL_WORLD_SIZE": str(per_node),
        "GROUP_RANK": str(node),
        "MASTER_ADDR": "10.1.2.3",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RUN_ID": "job",
    }
    if agent:
        environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    env = sg.detect_env(environ)
    assert env == sg.Env(
        rank=rank,
        local_rank=local_rank,
        world_size=nodes * per_node,
        local_world_size=per_node,
        node_rank=node,
        master_addr="10.1.2.3",
        master_port=port,
        source="torchrun",
        agent_store=agent,
    )
    assert env.is_distributed


@given(worlds(), st.integers(0, 10**9), st.sampled_from(["train", "job.sh"]))
def test_slurm_environment_round_trips(world, job_id, job_name):
    nodes, per_node, node, local_rank, rank = world
    environ = {
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(local_rank),
        "SLURM_NTASKS": str(nodes * per_node),
        "SLURM_NODEID": str(node),
        "SLURM_NTASKS_PER_NODE": f"{per_node}(x{nodes})",
        "SLURM_NODELIST": "gpu[007-009,12],cpu1",
        "SLURM_JOB_ID": str(job_id),
        "SLURM_JOB_NAME": job_name,
    }
    env = sg.detect_env(environ)
    assert (env.rank, env.local_rank, env.world_size) == (rank, local_rank, nodes * per_node)
    assert (env.local_world_size, env.node_rank) == (per_node, node)
    assert env.master_addr == "gpu007"
    assert 15000 <= env.master_port < 35000
    assert env.source == "slurm"
    # The port is a function of the job id alone: every rank of the job agrees on it.
    assert (
        sg.detect_env(
            {**environ, "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}
        ).master_port
        == env.master_port
    )


def test_slurm_master_port_variable_wins():
    environ = {
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NTASKS": "2",
        "SLURM_NODELIST": "node1",
        "SLURM_JOB_ID": "77",
        "MASTER_PORT": "4242",
    }
    assert sg.detect_env(environ).master_port == 4242


@pytest.mark.parametrize("name", ["bash", "interactive"])
def test_slurm_interactive_shell_is_a_single_process(name):
    environ = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_NAME": name}
    assert sg.detect_env(environ) == sg.Env()


def test_torchrun_wins_over_slurm():
    environ = {"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    assert sg.detect_env(environ).source == "torchrun"


@given(
    st.dictionaries(st.sampled_from(["PATH", "HOME", "USER", "CUDA_VISIBLE_DEVICES"]), st.text())
)
def test_no_launcher_means_a_world_of_one(environ):
    env = sg.detect_env(environ)
    assert env == sg.Env()
    assert not env.is_distributed


@given(
    st.sampled_from(["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"]),
    st.one_of(
        st.text(alphabet="abcxyz.-", min_size=1),
        st.integers(max_value=-1).map(str),
        st.just(""),
    ),
)
def test_malformed_torchrun_values_name_the_variable(name, value):
    environ = {
        "RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "2",
        name: value,
    }
    with pytest.raises(sg.EnvError, match=name) as info:
        sg.detect_env(environ)
    assert repr(value) in str(info.value)
    assert isinstance(info.value, ValueError)


@given(st.integers(1, 64), st.integers(0, 64))
def test_rank_at_or_above_world_size_is_contradictory(world_size, excess):
    rank = world_size + excess
    with pytest.raises(sg.EnvError, match=f"RANK='{rank}'.*WORLD_SIZE='{world_size}'"):
        sg.detect_env({"RANK": str(rank), "WORLD_SIZE": str(world_size)})


def test_half_a_torchrun_environment_names_what_is_missing():
    with pytest.raises(sg.EnvError, match="WORLD_SIZE not set"):
        sg.detect_env({"RANK": "0"})


@pytest.mark.parametrize(
    ("name", "value"),
    [("SLURM_NTASKS_PER_NODE", "four"), ("SLURM_NODELIST", "[bad"), ("SLURM_PROCID", "x")],
)
def test_malformed_slurm_values_name_the_variable(name, value):
    environ = {
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NTASKS": "2",
        "SLURM_NODELIST": "node1",
        "SLURM_JOB_ID": "5",
        name: value,
    }
    with pytest.raises(sg.EnvError, match=name):
        sg.detect_env(environ)


def test_env_record_rejects_bad_values_by_field():
    with pytest.raises(sg.EnvError, match="world_size"):
        sg.Env(world_size=0)
    with pytest.raises(sg.EnvError, match="local_rank"):
        sg.Env(local_rank=2, local_world_size=2, world_size=4)


@given(kit.envs())
def test_the_kits_valid_environments_are_detected(environ):
    env = sg.detect_env(environ)
    assert env.is_distributed
    assert 0 <= env.rank < env.world_size
    assert 0 <= env.local_rank < env.local_world_size


@given(kit.envs(valid=False))
def test_the_kits_broken_environments_raise_naming_a_variable(environ):
    with pytest.raises(sg.EnvError) as info:
        sg.detect_env(environ)
    assert any(name in str(info.value) for name in environ)


def test_a_context_takes_a_device_string():
    assert sg.Context(env=sg.Env(), device="cpu").device == torch.device("cpu")
