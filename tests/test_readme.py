"""README's promise: its first code block is the two commands `nox -s readme` runs in a clean clone.

That session installs everything into a fresh venv and takes minutes; this
checks, for free, that the commands are the ones meant and name real sessions.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ["pip install nox && nox -s demo", "pip install nox && nox -s tests"]


def first_code_block(text: str) -> list[str]:
    block = re.search(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M)
    assert block, "README.md has no code block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def nox_sessions(source: str) -> set[str]:
    """Names of the functions in a noxfile decorated with `@nox.session` (called or not)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef):
            for decorator in node.decorator_list:
                target = decorator.func if isinstance(decorator, ast.Call) else decorator
                if ast.unparse(target) == "nox.session":
                    names.add(node.name)
    return names


def test_the_first_code_block_is_the_two_commands_in_order():
    assert first_code_block((ROOT / "README.md").read_text()) == COMMANDS


def test_the_sessions_they_run_exist_in_the_noxfile():
    sessions = nox_sessions((ROOT / "noxfile.py").read_text())
    named = [re.search(r"nox -s (\S+)$", command).group(1) for command in COMMANDS]
    assert set(named) <= sessions, sessions
    assert {"readme", "docs"} <= sessions  # the sessions that check the README and build the docs


def test_the_session_finder_sees_decorated_functions_only():
    source = "import nox\n@nox.session\ndef a(s): ...\n@nox.session(python='3.11')\ndef b(s): ...\ndef c(s): ...\n"
    assert nox_sessions(source) == {"a", "b"}


def test_the_tests_session_prints_the_slowest_tests_and_keeps_posargs_last():
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    [tests] = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "tests"]
    runs = [
        ast.unparse(n)
        for n in ast.walk(tests)
        if isinstance(n, ast.Call) and ast.unparse(n.func) == "session.run"
    ]
    # Last, so that `nox -s tests -- --durations=0` (every test) or `-m "not slow"` applies.
    assert runs == ["session.run('pytest', '--durations=20', *session.posargs)"]
