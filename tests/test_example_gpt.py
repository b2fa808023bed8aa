"""examples/gpt: the character-level GPT trainer, run as a researcher runs it.

The training function is imported from the example and run on the shared 2-rank
`World`; the script itself runs end to end as ``python`` (2 spawned ranks) and under
``torchrun``, and must print what the imported function computes.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import stratagem as sg
from helpers import agent_env, matches_shown_output

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "gpt"
SCRIPT = EXAMPLE / "train.py"
# At import, so before the session's World starts: its ranks inherit sys.path and import
# `train` to unpickle the functions sent to them.
sys.path.insert(0, str(EXAMPLE))

import train as gpt  # noqa: E402

pytestmark = pytest.mark.slow

TIMEOUT_S = 180.0
VOCABULARY = len(gpt.encode_text(gpt.load_text())[1])  # 103 characters on CPython 3.11


def config(**changes) -> gpt.Config:
    return dataclasses.replace(gpt.Config(), verbose=False, device="cpu", **changes)


def run(world, cfg: gpt.Config) -> list[dict]:
    """Run the example's `train` on the World's two ranks, under in-place ddp() or fsdp()."""
    return world.run(gpt.train, gpt.build_strategy(cfg, in_place=True), cfg)


# --- (a) ddp() and fsdp() train the same model --------------------------------------------


def test_ddp_and_fsdp_give_bit_identical_losses_from_per_rank_seeds(stratagem_world):
    # Clipping off: under fsdp() the total gradient norm is summed shard by shard, in
    # another order than over whole gradients, so a clip that engages differs in the last
    # bits (checked with a tolerance below). Dropout, accumulation and AdamW stay on.
    cfg = config(max_iters=8, eval_interval=4, grad_clip=0.0)
    ddp_runs = run(stratagem_world, cfg)
    fsdp_runs = run(stratagem_world, dataclasses.replace(cfg, strategy="fsdp"))
    for rank, (ddp_run, fsdp_run) in enumerate(zip(ddp_runs, fsdp_runs, strict=True)):
        assert len(ddp_run["losses"]) == 8
        assert ddp_run["losses"] == fsdp_run["losses"], f"rank {rank}"
        assert ddp_run["evals"] == fsdp_run["evals"], f"rank {rank}"
        assert ddp_run["digest"] == fsdp_run["digest"], f"rank {rank}"
    # The ranks drew different batches (per-rank streams) into one model.
    assert ddp_runs[0]["losses"] != ddp_runs[1]["losses"]
    assert ddp_runs[0]["digest"] == ddp_runs[1]["digest"]
    # It learns: from about ln(vocabulary) down.
    first, last = ddp_runs[0]["evals"][0], ddp_runs[0]["evals"][-1]
    assert abs(first["val"] - math.log(VOCABULARY)) < 0.1
    assert last["val"] < first["val"] - 0.5


def test_ddp_and_fsdp_agree_closely_with_clipping(stratagem_world):
    cfg = config(max_iters=8, eval_interval=8)  # grad_clip=1.0: the clip engages
    ddp_runs = run(stratagem_world, cfg)
    fsdp_runs = run(stratagem_world, dataclasses.replace(cfg, strategy="fsdp"))
    for ddp_run, fsdp_run in zip(ddp_runs, fsdp_runs, strict=True):
        assert ddp_run["losses"][0] == fsdp_run["losses"][0]  # before any update
        torch.testing.assert_close(
            torch.tensor(fsdp_run["losses"]), torch.tensor(ddp_run["losses"]), rtol=0, atol=1e-4
        )


# --- (b) a resumed run is the uninterrupted run --------------------------------------------


@pytest.mark.parametrize(
    ("strategy", "precision"), [("ddp", "32-true"), ("fsdp", "32-true"), ("ddp", "bf16-mixed")]
)
def test_resuming_mid_run_equals_the_uninterrupted_run_bit_for_bit(
    stratagem_world, tmp_path, strategy, precision
):
    # Dropout (per-rank RNG), accumulation, clipping and the LR schedule all on.
    cfg = config(
        strategy=strategy, precision=precision, max_iters=20, lr_decay_iters=20, eval_interval=10
    )
    whole = run(stratagem_world, cfg)
    saved = dataclasses.replace(cfg, max_iters=10, checkpoint_dir=str(tmp_path))
    first = run(stratagem_world, saved)
    info = sg.checkpoint.describe(tmp_path / "ckpt")
    assert info.values["iter_num"] == 10
    assert info.entries["batches"] == "per_rank_object"
    resumed = run(stratagem_world, dataclasses.replace(saved, max_iters=20, resume=True))
    assert sg.checkpoint.describe(tmp_path / "ckpt").values["iter_num"] == 20

    for rank in range(2):
        assert first[rank]["losses"] == whole[rank]["losses"][:10]
        assert len(resumed[rank]["losses"]) == 10
        assert resumed[rank]["losses"] == whole[rank]["losses"][10:], f"rank {rank}"
        assert resumed[rank]["digest"] == whole[rank]["digest"]
        assert resumed[rank]["evals"] == whole[rank]["evals"][1:]  # iterations 10 and 20
        # Each rank's data position came back to that rank and went on from there.
        position, expected = resumed[rank]["data"], whole[rank]["data"]
        assert position["drawn"] == expected["drawn"] == 20 * cfg.gradient_accumulation_steps
        assert torch.equal(position["generator"], expected["generator"])
    assert not torch.equal(resumed[0]["data"]["generator"], resumed[1]["data"]["generator"])


# --- (c) a checkpoint right after an evaluation ---------------------------------------------


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_saving_right_after_an_evaluation_works(stratagem_world, tmp_path, strategy):
    cfg = config(strategy=strategy, max_iters=2, eval_interval=1, checkpoint_dir=str(tmp_path))
    results = run(stratagem_world, cfg)  # evaluates at 0, 1, 2; saves after those at 1 and 2
    evals = [result["evals"] for result in results]
    assert [e["iter"] for e in evals[0]] == [0, 1, 2]
    for mine, theirs in zip(evals[0], evals[1], strict=True):
        for split in ("train", "val"):
            assert mine[split] == theirs[split], "reduce gives every rank the same mean"
            assert mine[f"local_{split}"] != theirs[f"local_{split}"]
            pair = torch.tensor([mine[f"local_{split}"], theirs[f"local_{split}"]])
            assert mine[split] == pair.mean().item()
    assert all(len(result["losses"]) == 2 for result in results)

    info = sg.checkpoint.describe(tmp_path / "ckpt")
    assert info.entries["model"] == "module"
    assert info.entries["optimizer"] == "optimizer"
    assert info.values["iter_num"] == 2
    assert info.values["best_val_loss"] == min(e["val"] for e in evals[0])
    assert info.values["model_args"]["vocab_size"] == VOCABULARY
    assert str(info.tensors["model/lm_head.weight"]) == f"float32[{VOCABULARY}, 32]"
    assert (
        str(info.tensors["optimizer/state/lm_head.weight/exp_avg"]) == f"float32[{VOCABULARY}, 32]"
    )


# --- (d) the script, as python and under torchrun -------------------------------------------


def script_env(tmp_path: Path) -> dict[str, str]:
    env = agent_env(tmp_path)
    env["PYTHONWARNINGS"] = "error"  # as the suite: a warning on the script's path fails it
    return env


def run_script(command: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    proc = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=script_env(tmp_path),
        cwd=tmp_path,
        start_new_session=True,  # so that a hung run's ranks can be stopped together
    )
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        stop_group(proc)
        out, err = proc.communicate()
        pytest.fail(f"{command} did not finish in {TIMEOUT_S:.0f} s\n{out}\n{err}")
    finally:
        stop_group(proc)
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def stop_group(proc: subprocess.Popen[str]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            proc.poll()
            time.sleep(0.1)


def check_output(done: subprocess.CompletedProcess[str], reference: list[dict], name: str):
    """The script exited 0 and printed the losses, evaluations and digest of `reference`."""
    report = f"exit {done.returncode}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    assert done.returncode == 0, report
    assert done.stdout.startswith(f"{name}: Config("), report
    printed = [float(x) for x in re.findall(r"^iter \d+: loss (\d+\.\d+),", done.stdout, re.M)]
    assert printed == [round(x, 4) for x in reference[0]["losses"]], report
    evals = re.findall(
        r"^step (\d+): train loss (\d+\.\d+), val loss (\d+\.\d+)$", done.stdout, re.M
    )
    assert evals == [
        (str(e["iter"]), f"{e['train']:.4f}", f"{e['val']:.4f}") for e in reference[0]["evals"]
    ], report
    last = ", ".join(f"rank {r} {result['losses'][-1]:.4f}" for r, result in enumerate(reference))
    assert f"\nlast loss: {last}\n" in done.stdout, report
    assert done.stdout.endswith(f"final parameters digest: {reference[0]['digest']}\n"), report
    assert "Warning" not in done.stderr, report


def test_the_script_runs_on_two_spawned_ranks(stratagem_world, tmp_path):
    args = ["--iters", "4", "--device", "cpu"]
    done = run_script([sys.executable, str(SCRIPT), *args], tmp_path)
    reference = run(stratagem_world, dataclasses.replace(gpt.parse_args(args), verbose=False))
    check_output(done, reference, "ddp_spawn+clip+accumulate2")
    assert [len(result["losses"]) for result in reference] == [4, 4]


def test_the_script_runs_under_torchrun(stratagem_world, tmp_path):
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=0",
        f"--log-dir={tmp_path / 'elastic'}",
        str(SCRIPT),
        "--iters",
        "4",
        "--strategy",
        "fsdp",
        "--device",
        "cpu",
    ]
    done = run_script(command, tmp_path)
    args = ["--iters", "4", "--strategy", "fsdp", "--device", "cpu"]
    reference = run(stratagem_world, dataclasses.replace(gpt.parse_args(args), verbose=False))
    check_output(done, reference, "fsdp+clip+accumulate2")


@pytest.mark.slow
def test_the_readme_shows_what_the_default_run_prints(tmp_path):
    # Reported: the digest in examples/gpt/README.md was not what the example printed.
    readme = (SCRIPT.parent / "README.md").read_text()
    shown = re.search(r"## What to expect.*?^```\n(.*?)^```", readme, flags=re.S | re.M)
    assert shown is not None, "README.md lost its 'What to expect' block"
    done = run_script([sys.executable, str(SCRIPT), "--device", "cpu"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert matches_shown_output(shown.group(1), done.stdout), done.stdout
