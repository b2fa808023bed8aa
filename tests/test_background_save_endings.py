"""A background save commits however the run ends (issue 39, "lost checkpoints").

Reported: a script that ended right after ``save(..., blocking=False)`` returned left
``step_2.lock`` and ``step_2.tmp-*`` and no checkpoint; a spawned world whose commit
outlasted the launcher's exit timeout returned "with the save in flight" and nothing
was committed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import stratagem as sg

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parent / "scripts" / "ends_after_background_save.py"


@pytest.mark.parametrize("mode", ["single", "spawn"])
def test_a_run_that_ends_right_after_a_background_save_commits_it(tmp_path, mode):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path), mode],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    found = sg.checkpoint.latest(tmp_path)
    assert found is not None and found.name == "step_7", sorted(p.name for p in tmp_path.iterdir())
    model = torch.nn.Linear(4, 2)
    ctx = sg.single_device("cpu").setup(sg.Env())
    assert sg.checkpoint.load(found, {"model": model}, ctx, strict=False)["step"] == 7
    torch.manual_seed(0)
    assert torch.equal(model.weight, torch.nn.Linear(4, 2).weight)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_7"]  # no lock, no tmp left
