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
