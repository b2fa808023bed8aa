"""``stratagem env``: the world this process would join, its devices and versions; run it first."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import sys

import torch
import torch.distributed as dist

from stratagem.env import detect_env

__all__ = ["configure", "report", "run"]

# The variables detect_env reads, shown as set, so a wrong one is visible next to its effect.
_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "SLURM_JOB_ID",
    "SLURM_JOB_NAME",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "SLURM_NTASKS",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_TASKS_PER_NODE",
    "SLURM_NODELIST",
    "CUDA_VISIBLE_DEVICES",
    "GLOO_SOCKET_IFNAME",
    "NCCL_SOCKET_IFNAME",
    "OMP_NUM_THREADS",
)


def configure(parser: argparse.ArgumentParser) -> None:
    """``stratagem env`` takes no options."""


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _backends() -> str:
    if not dist.is_available():
        return "torch.distributed not available"
    checks = {
        "gloo": dist.is_gloo_available,
        "nccl": dist.is_nccl_available,
        "mpi": dist.is_mpi_available,
        "ucc": getattr(dist, "is_ucc_available", lambda: False),
    }
    return ", ".join(f"{name} {'yes' if check() else 'no'}" for name, check in checks.items())


def _cuda() -> str:
    if not torch.cuda.is_available():
        built = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU build"
        return f"not available (torch is {built})"
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return f"{len(names)} device(s): {', '.join(names)} (CUDA {torch.version.cuda})"


def report(environ: dict[str, str]) -> list[str]:
    """Return the lines ``stratagem env`` prints for the environment ``environ``.

    Raises:
        EnvError: the launcher variables are malformed or contradict each other.

    Example:
        >>> report({})[1]
        '  source single (a plain process: a world of one)'
    """
    env = detect_env(environ)
    how = {
        "single": "a plain process: a world of one",
        "torchrun": "started by torchrun / TorchElastic",
        "slurm": "a SLURM task",
        "spawn": "spawned by stratagem",
    }[env.source]
    mps = getattr(torch.backends, "mps", None)
    lines = [
        "environment (detect_env)",
        f"  source {env.source} ({how})",
        f"  rank {env.rank} of {env.world_size}; local rank {env.local_rank} of "
        f"{env.local_world_size}; node {env.node_rank}",
        f"  store {env.master_addr}:{env.master_port}"
        + (" (hosted by the launcher agent)" if env.agent_store else "")
        if env.is_distributed
        else "  store: none (a world of one joins no process group)",
    ]
    shown = [f"    {name}={environ[name]}" for name in _VARIABLES if name in environ]
    lines += ["  variables", *shown] if shown else ["  variables: none of the launchers' are set"]
    lines += [
        "devices",
        f"  cpu: {os.cpu_count()} core(s), torch uses {torch.get_num_threads()} thread(s)",
        f"  cuda: {_cuda()}",
        f"  mps: {'available' if mps is not None and mps.is_available() else 'not available'}",
        f"  distributed backends: {_backends()}",
        "versions",
        f"  python {platform.python_version()} ({sys.executable})",
        f"  torch {torch.__version__}",
        f"  stratagem {_version('stratagem')}",
        f"  attrs {_version('attrs')}, numpy {_version('numpy')}",
        f"  demo extras: scikit-learn {_version('scikit-learn')}, tqdm {_version('tqdm')}",
    ]
    return lines


def run(options: argparse.Namespace) -> int:
    """Print the report for this process's environment."""
    print("\n".join(report(dict(os.environ))))
    return 0
