"""Multi-node on one host: two torchrun agents, a c10d rendezvous on 127.0.0.1, ``ddp()`` in place."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from helpers import agent_env, free_port

SCRIPT = Path(__file__).parent / "scripts" / "multinode_train.py"
NODES = 2
TIMEOUT_S = 180.0
SAMPLES, EPOCHS, BATCH_SIZE = 48, 2, 4  # as in the script


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """Stop an agent and every worker in its session: SIGTERM, then SIGKILL."""
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            proc.poll()  # reap the agent, so that a zombie does not count as alive
            time.sleep(0.1)


def logs(paths: list[Path]) -> str:
    return "\n".join(
        f"----- agent {i} -----\n{path.read_text(errors='replace')[-6000:]}"
        for i, path in enumerate(paths)
    )


@pytest.mark.slow
def test_two_torchrun_agents_train_with_ddp_in_place(tmp_path):
    out_dir = tmp_path / "results"
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={NODES}",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id=stratagem-test-{uuid.uuid4().hex[:12]}",
        "--local-addr=127.0.0.1",
        "--max-restarts=0",
    ]
    env = agent_env(tmp_path)
    log_paths = [tmp_path / f"agent{i}.log" for i in range(NODES)]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for i, log_path in enumerate(log_paths):
            with log_path.open("wb") as log:
                procs.append(
                    subprocess.Popen(
                        [
                            *command,
                            f"--log-dir={tmp_path / f'elastic{i}'}",
                            str(SCRIPT),
                            str(out_dir),
                        ],
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=env,
                        cwd=tmp_path,
                        start_new_session=True,
                    )
                )
        deadline = time.monotonic() + TIMEOUT_S
        for proc in procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                for other in procs:
                    kill_group(other)
                pytest.fail(
                    f"torchrun agents did not finish within {TIMEOUT_S:.0f} s\n{logs(log_paths)}"
                )
    finally:
        # Also reaps any worker left in an agent's session after the agent itself exited.
        for proc in procs:
            kill_group(proc)
            proc.wait()

    codes = [proc.returncode for proc in procs]
    assert codes == [0] * NODES, f"agents exited with {codes}\n{logs(log_paths)}"
    files = sorted(out_dir.glob("rank*.json"))
    assert [f.name for f in files] == [f"rank{r}.json" for r in range(NODES)], logs(log_paths)
    received = [json.loads(f.read_text()) for f in files]

    # Every process received the same full list, in rank order.
    assert received[0] == received[1]
    results = received[0]
    assert [r["rank"] for r in results] == list(range(NODES))
    assert {r["world_size"] for r in results} == {NODES}
    assert {r["source"] for r in results} == {"torchrun"}
    assert [r["local_rank"] for r in results] == [0] * NODES
    assert sorted(r["node_rank"] for r in results) == list(range(NODES))

    # DDP kept the replicas in sync: identical parameters, the same reduced loss.
    assert len({r["checksum"] for r in results}) == 1
    assert len({r["loss"] for r in results}) == 1

    # Each epoch the ranks trained on disjoint halves of the samples.
    share = SAMPLES // NODES
    assert {r["steps"] for r in results} == {EPOCHS * share // BATCH_SIZE}
    for epoch in range(EPOCHS):
        shares = [set(r["seen"][epoch * share : (epoch + 1) * share]) for r in results]
        assert shares[0].isdisjoint(shares[1])
        assert shares[0] | shares[1] == set(range(SAMPLES))
