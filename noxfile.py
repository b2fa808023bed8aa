"""Tasks: tests, lint, typecheck, demo, bench, bench_peers, readme, docs, gpu.

Every session that installs torch pins it to 2.13.0 (see `install`); which build that is (CPU,
or CUDA with its NVIDIA libraries) is the package index's choice, see README.md.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["tests", "lint", "typecheck"]

# A session that cannot find its interpreter fails instead of "skipped" with exit code 0.
nox.options.error_on_missing_interpreters = True

CONSTRAINTS = ("-c", "constraints.txt")
# None: the Python that runs nox, whichever supported version it is (3.11 and later). A
# pinned version skipped every session on a machine without it, and exited 0.
PYTHON = None


def install(session: nox.Session, *extra: str) -> None:
    # torch first and alone, pinned, so that nothing else moves its version. The build is the
    # index's: PyPI serves CUDA builds on Linux x86-64; PIP_EXTRA_INDEX_URL pointing at
    # https://download.pytorch.org/whl/cpu makes it 2.13.0+cpu (a local version sorts higher).
    session.install("torch==2.13.0", "numpy", *CONSTRAINTS)
    session.install("-e", f".[{','.join(extra)}]" if extra else ".", *CONSTRAINTS)


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    # demo: the CLI tests train on scikit-learn's digits; ray: the Ray launch field's tests;
    # float8: with_float8's (torchao, emulated on the CPU)
    install(session, "testing", "demo", "ray", "float8")
    # The reference safetensors reader and writer, which stratagem's own are tested against.
    session.install("safetensors", *CONSTRAINTS)
    # The 20 slowest tests close every run; a later --durations=N among the posargs wins.
    session.run("pytest", "--durations=20", *session.posargs)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    install(session, "testing", "plot")  # plot: matplotlib's own types check stratagem.cli.plot
    session.install("mypy")
    session.run("mypy")


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    install(session, "demo")
    # The library's promise in one command: two ranks, checked against one process.
    args = session.posargs or ["--strategy", "ddp", "--devices", "2", "--compare"]
    session.run("stratagem", "demo", *args)


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    install(session, "testing")  # testing: world_examples runs a hypothesis property
    session.run("python", "-m", "benchmarks", *session.posargs)


def readme_commands(readme: Path) -> dict[str, str]:
    """Return the first two commands of README's first code block, by the nox session they run."""
    block = re.search(r"^```[^\n]*\n(.*?)^```", readme.read_text(), flags=re.S | re.M)
    lines = [line.strip() for line in block.group(1).splitlines() if line.strip()] if block else []
    commands = {}
    for line in lines[:2]:
        named = re.search(r"\bnox -s (\S+)", line)
        commands[named.group(1) if named else line] = line
    return commands


@nox.session(venv_backend="none")  # the session makes its own venv: that is what it checks
def readme(session: nox.Session) -> None:
    """Run README's first two commands in a clone of HEAD, in a fresh venv (`-- demo`: one)."""
    here = Path(__file__).resolve().parent
    head = subprocess.run(
        ["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    if subprocess.run(
        ["git", "-C", str(here), "status", "--porcelain"], capture_output=True
    ).stdout:
        session.warn("the working tree has uncommitted changes; the clone holds HEAD only")
    with tempfile.TemporaryDirectory(prefix="stratagem-readme-") as scratch:
        clone, venv = Path(scratch) / "stratagem", Path(scratch) / "venv"
        session.run(
            "git", "clone", "--quiet", "--no-checkout", str(here), str(clone), external=True
        )
        session.run("git", "-C", str(clone), "checkout", "--quiet", "--detach", head, external=True)
        # The clone's README, exactly as a reader of this commit sees it.
        commands = readme_commands(clone / "README.md")
        if len(commands) != 2:
            session.error(f"README.md's first code block should hold two commands: {commands}")
        unknown = set(session.posargs) - set(commands)
        if unknown:
            session.error(f"no README command runs nox -s {', '.join(sorted(unknown))}")
        session.run(sys.executable, "-m", "venv", str(venv), external=True)
        # The fresh venv alone: nothing from this shell's venv or PYTHONPATH leaks in.
        env = {
            "PATH": os.pathsep.join([str(venv / "bin"), os.environ.get("PATH", "")]),
            "VIRTUAL_ENV": str(venv),
            "PYTHONPATH": None,
            "NOX_CURRENT_SESSION": None,
        }
        with session.chdir(clone):
            for name, command in commands.items():
                if not session.posargs or name in session.posargs:
                    session.run("sh", "-c", command, env=env, external=True)


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """Build the site (README + docs/) into site/; --strict turns a broken link into a failure."""
    session.install("mkdocs>=1.6,<2")  # 1.6: File.generated, used by mkdocs_hooks.py
    session.run("mkdocs", "build", "--strict", *session.posargs)


@nox.session(python=PYTHON)
def bench_peers(session: nox.Session) -> None:
    """The single-device and 2-rank DDP steps through Lightning Fabric and Accelerate too.

    The peers are installed here only: never a dependency of stratagem or its tests.
    """
    install(session)
    session.install("lightning-fabric", "accelerate", *CONSTRAINTS)
    session.run("python", "-m", "benchmarks.peers", *session.posargs)
    session.run(
        "torchrun",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "benchmarks.peers",
        *session.posargs,
    )


@nox.session(python=PYTHON, venv_params=["--system-site-packages"])
def gpu(session: nox.Session) -> None:
    """The prepared GPU run (`benchmarks.gpu_check`): its cases, the suite, the GPT step.

    Lightning Fabric and Accelerate join the GPT step when the system site-packages
    have them; nothing here installs them. pytest-xdist runs the suite on every core.
    """
    # The one session that must not pin the CPU wheel: it uses the machine's CUDA build of
    # torch (visible through the system site-packages), or the registry's default one.
    session.install("-e", ".[testing]", "pytest-xdist")
    session.run("python", "-m", "benchmarks.gpu_check", *session.posargs)
