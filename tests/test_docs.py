"""The Python blocks of README.md and docs/*.md run as written, as one script per page.

A python block that prints is followed on its page by an ```` ```output ```` block that
shows what it prints; the run compares the two (``helpers.matches_shown_output``: ``...``
stands for anything, timings are ignored). Running the pages spawns worlds, so it belongs
to the full run; the fast run checks that every block compiles and that what it imports
and names exists.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

import stratagem
from helpers import matches_shown_output

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LIB = Path(stratagem.__file__).resolve().parent.parent
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", flags=re.S | re.M)
# Printed by the page's script between its blocks, so that each block's output is known.
MARK = "--- stratagem docs test: block {} ---"


def fenced_blocks(path: Path) -> list[tuple[str, str]]:
    """Every fenced block of a page, in order, as (info string's first word, text)."""
    return FENCE.findall(path.read_text())


def python_blocks(path: Path) -> list[str]:
    return [text for kind, text in fenced_blocks(path) if kind == "python"]


def shown_outputs(path: Path) -> list[str | None]:
    """For each python block, the ```output block that comes next on the page, or None."""
    shown: list[str | None] = []
    for kind, text in fenced_blocks(path):
        if kind == "python":
            shown.append(None)
        elif kind == "output":
            assert shown, f"{path.name}: an ```output block before any python block"
            assert shown[-1] is None, f"{path.name}: two ```output blocks after one python block"
            shown[-1] = text
    return shown


# A spawned rank imports the script (as __mp_main__) to find its function, and so runs every
# block's module-level code again: a block's own output would then include what other blocks
# print at module level. No reader runs a page as one script, so the ranks' import is silent;
# what the ranks print afterwards, in the function they run, is kept.
QUIET_IMPORT = """\
import os as _docs_os
import sys as _docs_sys

if __name__ != "__main__":
    _docs_stdout, _docs_sys.stdout = _docs_sys.stdout, open(_docs_os.devnull, "w")
"""
LOUD_AGAIN = """\
if __name__ != "__main__":
    _docs_sys.stdout.close()
    _docs_sys.stdout = _docs_stdout
"""


def page_script(blocks: list[str]) -> str:
    """The page's blocks as one script that marks, in the launching process, where each starts."""
    parts = [QUIET_IMPORT]
    for index, block in enumerate(blocks):
        # Guarded: spawned ranks import the script (as __mp_main__) and must not print marks.
        parts.append(f'if __name__ == "__main__":\n    print({MARK.format(index)!r}, flush=True)\n')
        parts.append(block)
    parts.append(LOUD_AGAIN)
    return "\n\n".join(parts)


def outputs_by_block(stdout: str, count: int) -> list[str]:
    """Split a page script's stdout into what each block printed."""
    pieces = re.split("^" + re.escape(MARK).replace(r"\{\}", r"(\d+)") + "$", stdout, flags=re.M)
    assert pieces[0].strip() == "", f"printed before the first block: {pieces[0]!r}"
    printed = {int(index): text for index, text in zip(pieces[1::2], pieces[2::2], strict=True)}
    assert sorted(printed) == list(range(count)), f"block marks missing: {sorted(printed)}"
    return [printed[index] for index in range(count)]


# --- fast: every block parses, and what it imports and names exists ---------------------


def missing_names(source: str) -> list[str]:
    """What a script imports or names through an imported module that does not exist.

    Dotted names rooted at an imported module (``sg.ddp``, ``sg.checkpoint.latest``,
    ``torch.nn.Linear``) are followed as far as they go through modules; nothing runs.
    """
    tree = ast.parse(source)
    missing = []
    modules: dict[str, types.ModuleType] = {}  # what a name bound by an import refers to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                module = importlib.import_module(alias.name)
                top = alias.name.partition(".")[0]
                modules[alias.asname or top] = module if alias.asname else sys.modules[top]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            module = importlib.import_module(node.module)
            for alias in node.names:
                if not hasattr(module, alias.name) and not importlib.util.find_spec(
                    f"{node.module}.{alias.name}"
                ):
                    missing.append(f"line {node.lineno}: {node.module} has no {alias.name}")
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        chain = []
        target: ast.expr = node
        while isinstance(target, ast.Attribute):
            chain.append(target.attr)
            target = target.value
        if not isinstance(target, ast.Name) or target.id not in modules:
            continue
        value: object = modules[target.id]
        for name in reversed(chain):
            if not isinstance(value, types.ModuleType):
                break
            if not hasattr(value, name):
                missing.append(f"line {node.lineno}: {value.__name__} has no {name}")
                break
            value = getattr(value, name)
    return sorted(set(missing))


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_python_blocks_compile_and_name_what_exists(path):
    blocks = python_blocks(path)
    assert blocks, f"{path.name} has no python blocks"
    source = "\n\n".join(blocks)
    compile(source, path.name, "exec")
    assert missing_names(source) == [], path.name


def test_missing_names_are_found_without_running_anything():
    source = (
        "import stratagem as sg\nimport torch.nn\nfrom stratagem import ddp, nothing_here\n"
        "sg.single_device().name\nsg.checkpoint.latest\nsg.chekpoint.latest\n"
        "torch.nn.Linear\ntorch.nn.Linnear(2, 2)\nsg.launch(print, sg.single_device())\n"
    )
    assert missing_names(source) == [
        "line 3: stratagem has no nothing_here",
        "line 6: stratagem has no chekpoint",
        "line 8: torch.nn has no Linnear",
    ]


def test_shown_outputs_are_read_per_python_block(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nprint(1)\n```\n\ntext\n\n```output\n1\n```\n\n"
        "```text\nnot output\n```\n```python\nx = 2\n```\n"
    )
    assert shown_outputs(page) == ["1\n", None]
    stdout = MARK.format(0) + "\n1\n" + MARK.format(1) + "\n"
    assert outputs_by_block(stdout, 2) == ["\n1\n", "\n"]


def test_the_readme_training_loop_shows_what_it_prints():
    # Reported: "Your own training loop" printed nothing, so a reader could not tell it worked.
    readme = (ROOT / "README.md").read_text()
    section = re.search(r"^## Your own training loop\n(.*?)^## ", readme, flags=re.S | re.M)
    assert section is not None
    kinds = [kind for kind, _ in FENCE.findall(section.group(1))]
    assert kinds[:2] == ["python", "output"], kinds
    block = FENCE.findall(section.group(1))[0][1]
    assert "print(" in block


# --- slow: the pages run, and print what they show ----------------------------------------


@pytest.mark.slow  # most pages spawn worlds of 2 or 4 ranks; ray-workers.md starts Ray
@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_python_blocks_run_and_print_what_the_page_shows(path, tmp_path):
    blocks = python_blocks(path)
    # A real script, so that functions a page sends to spawned processes are importable.
    script = tmp_path / f"{path.stem}.py"
    script.write_text(page_script(blocks))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(LIB), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        # The pages' examples run unchanged on any host; on one with fewer GPUs than ranks they
        # run on the CPU and say so (DeviceFallbackWarning), which is what they should do there.
        [sys.executable, "-W", "error", "-W", "ignore:device='auto'", str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"{path.name} failed:\n{done.stderr[-4000:]}"
    printed = outputs_by_block(done.stdout, len(blocks))
    for index, (shown, output) in enumerate(zip(shown_outputs(path), printed, strict=True)):
        where = f"{path.name}, python block {index + 1}"
        if shown is not None:
            assert matches_shown_output(shown, output), (
                f"{where} prints what its ```output block does not show:\n{output}"
            )
        else:
            assert not output.strip(), (
                f"{where} prints, but no ```output block after it shows what:\n{output}"
            )
