"""Tasks: tests, lint, typecheck, demo, bench. Every session pins torch to the CPU wheel."""

from __future__ import annotations

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["tests", "lint", "typecheck"]

CONSTRAINTS = ("-c", "constraints.txt")
PYTHON = "3.11"


def install(session: nox.Session, *extra: str) -> None:
    # torch first and alone, pinned, so that nothing resolves it to a CUDA build.
    session.install("torch==2.13.0", "numpy", *CONSTRAINTS)
    session.install("-e", f".[{','.join(extra)}]" if extra else ".", *CONSTRAINTS)


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    install(session, "testing", "demo")  # demo: the CLI tests train on scikit-learn's digits
    session.run("pytest", *session.posargs)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    install(session, "testing")
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
    install(session)
    session.run("python", "-m", "benchmarks", *session.posargs)
