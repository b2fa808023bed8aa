"""What several test modules share: free ports, and the environment of a launcher started here."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import stratagem

LIB = Path(stratagem.__file__).resolve().parent.parent
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
