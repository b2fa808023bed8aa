import multiprocessing

import pytest

pytest_plugins = ["stratagem.testing.pytest_plugin"]

# The scripts are programs that tests start (some with top-level code that trains, or a
# sitecustomize that would clash with the interpreter's own): never imported by pytest.
collect_ignore_glob = ["scripts/*"]


@pytest.fixture(scope="module")
def processes():
    """Children forked from one server that imported torch and DCP once: a child costs no imports."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "stratagem", "stratagem.checkpoint.dcp_files"])
    return context


@pytest.fixture(scope="session")
def nccl_like():
    """A strategy whose world's default group has no CPU backend, as under NCCL.

    On a CPU-only torch, ``backend="cuda:gloo"`` maps only CUDA tensors to gloo: every CPU
    tensor or object that crosses the world must take the CPU group setup adds beside it.
    Modules cannot train in it (DDP's CPU tensors are refused), but every CPU-side path runs.
    """
    import stratagem as sg

    return sg.ddp(device="cpu", backend="cuda:gloo")
