"""The Python blocks of README.md run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", path.read_text(), flags=re.S | re.M)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_python_blocks_run(path, tmp_path, monkeypatch, capsys):
    blocks = python_blocks(path)
    assert blocks, f"{path.name} has no python blocks"
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "__docs__"}
    for block in blocks:  # blocks of one page share a namespace, as a reader's session would
        exec(compile(block, str(path), "exec"), namespace)
