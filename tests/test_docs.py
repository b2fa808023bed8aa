"""The Python blocks of README.md and docs/*.md run as written, as one script per page."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import stratagem

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LIB = Path(stratagem.__file__).resolve().parent.parent


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", path.read_text(), flags=re.S | re.M)


# Pages whose examples launch 4-rank or several worlds, or start Ray, belong to the full run only.
SLOW_PAGES = {"parallelism.md", "pipeline.md", "ray-workers.md"}


@pytest.mark.parametrize(
    "path",
    [pytest.param(p, marks=pytest.mark.slow) if p.name in SLOW_PAGES else p for p in DOCS],
    ids=lambda p: p.name,
)
def test_python_blocks_run(path, tmp_path):
    blocks = python_blocks(path)
    assert blocks, f"{path.name} has no python blocks"
    # A real script, so that functions a page sends to spawned processes are importable.
    script = tmp_path / f"{path.stem}.py"
    script.write_text("\n\n".join(blocks))
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
