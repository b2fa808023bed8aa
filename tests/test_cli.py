"""The `stratagem` command, run as a user runs it: `python -m stratagem ...` in a subprocess."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import stratagem
from stratagem.cli.main import main

LIB = Path(stratagem.__file__).resolve().parent.parent
# Launcher variables of an enclosing job would change what the command sees.
LAUNCHER = re.compile(
    r"^(RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_RANK|MASTER_.*|TORCHELASTIC_.*|SLURM_.*)$"
)


def command_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not LAUNCHER.match(k)}
    env["PYTHONPATH"] = os.pathsep.join([str(LIB), os.environ.get("PYTHONPATH", "")])
    env["CUDA_VISIBLE_DEVICES"] = ""  # the demo's runs here mean the CPU, on any host
    return {**env, **extra}


def stratagem_cli(*args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-W", "error", "-m", "stratagem", *args],
        env=command_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def table_row(stdout: str, strategy: str) -> dict[str, str]:
    lines = stdout.splitlines()
    [header] = [line for line in lines if line.startswith("strategy ")]
    [row] = [line for line in lines if line.split("  ")[0] == strategy]
    return dict(zip(re.split(r"\s{2,}", header), re.split(r"\s{2,}", row), strict=True))


def assert_one_line_error(done: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    for needle in needles:
        assert needle in done.stderr


@pytest.fixture(scope="module")
def fresh_run() -> subprocess.CompletedProcess[str]:
    """Three epochs of single_device() on generated data, from scratch."""
    return stratagem_cli("demo", "--strategy", "single", "--data", "synthetic", "--epochs", "3")


def test_demo_trains_and_prints_the_table(fresh_run):
    assert fresh_run.returncode == 0, fresh_run.stderr
    assert [line for line in fresh_run.stdout.splitlines() if line.startswith("epoch")] == [
        line for line in fresh_run.stdout.splitlines() if re.match(r"epoch [123]/3  loss ", line)
    ]
    row = table_row(fresh_run.stdout, "single_device")
    assert row["world size"] == "1"
    assert row["precision"] == "32-true"
    assert float(row["test accuracy"].rstrip("%")) >= 85
    assert float(row["samples/s"].replace(",", "")) > 0


def test_checkpoint_resume_continues_where_the_run_stopped(fresh_run, tmp_path, capsys):
    directory = str(tmp_path / "ckpt")
    common = ("demo", "--strategy", "single", "--data", "synthetic", "--checkpoint", directory)
    first = stratagem_cli(*common, "--epochs", "2")
    assert first.returncode == 0, first.stderr

    assert main(["checkpoint", directory]) == 0  # in this process: it needs no model and no ranks
    shown = capsys.readouterr().out
    assert "model (module)" in shown and "0.weight: float32[128, 64]" in shown
    assert "epoch (value)\n    = 2" in shown

    resumed = stratagem_cli(*common, "--epochs", "3", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "at epoch 2" in resumed.stdout
    epochs = [
        line.split("  ")[0] for line in resumed.stdout.splitlines() if line.startswith("epoch")
    ]
    assert epochs == ["epoch 3/3"]
    # The data order depends on the epoch alone, so resuming changes nothing.
    final = table_row(resumed.stdout, "single_device")["final loss"]
    assert final == table_row(fresh_run.stdout, "single_device")["final loss"]


@pytest.mark.slow
def test_ddp_on_digits_matches_one_process():
    done = stratagem_cli(
        "demo", "--strategy", "ddp", "--devices", "2", "--compare", "--epochs", "3", timeout=240
    )
    assert done.returncode == 0, done.stderr
    ddp = table_row(done.stdout, "ddp_spawn")
    alone = table_row(done.stdout, "single_device")
    assert ddp["world size"] == "2"
    assert float(ddp["test accuracy"].rstrip("%")) >= 85
    assert ddp["test accuracy"] == alone["test accuracy"]
    [difference] = re.findall(
        r"largest parameter difference vs single_device\(\): (\S+)", done.stdout
    )
    assert float(difference) < 1e-4


def test_env_shows_what_detect_env_sees():
    done = stratagem_cli(
        "env", RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="10.0.0.1", MASTER_PORT="29400"
    )
    assert done.returncode == 0, done.stderr
    assert "source torchrun" in done.stdout
    assert "rank 1 of 2" in done.stdout
    assert "store 10.0.0.1:29400" in done.stdout
    assert "gloo yes" in done.stdout
    assert f"torch {torch.__version__}" in done.stdout
    assert f"stratagem {stratagem.__version__}" in done.stdout


def test_a_command_line_error_is_one_line_and_exit_2():
    assert_one_line_error(stratagem_cli("demo", "--devices", "4096"), "--devices 4096")


# The same rule in this process, where each case costs milliseconds.
@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["demo", "--strategy", "horovod"], "invalid choice: 'horovod'"),
        (["demo", "--epochs", "0"], "argument --epochs: must be a positive integer (got '0')"),
        (["demo", "--accumulate", "two"], "argument --accumulate"),
        (["demo", "--strategy", "single", "--devices", "2"], "--devices 2"),
        (["demo", "--strategy", "dp", "--devices", "64"], "--devices 64"),
        (["demo", "--precision", "8-true"], "invalid choice: '8-true'"),
        (["demo", "--resume"], "--resume needs --checkpoint DIR"),
        (["demo", "--plot", "loss.pdf"], "--plot loss.pdf: the plot is a PNG"),
        (["demo", "--plot", "no-such-dir/loss.png"], "there is no directory 'no-such-dir'"),
        (["demo", "--unknown"], "unrecognized arguments: --unknown"),
        (["checkpoint"], "required: PATH"),
        ([], "required: COMMAND"),
    ],
)
def test_usage_errors_exit_2_with_one_line(args, needle, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert needle in err


def test_missing_or_foreign_checkpoints_are_usage_errors(tmp_path, capsys):
    missing = str(tmp_path / "none")
    assert main(["demo", "--checkpoint", missing, "--resume"]) == 2
    assert "no checkpoint in" in capsys.readouterr().err
    assert main(["checkpoint", missing]) == 2
    assert "no checkpoint at" in capsys.readouterr().err
    (tmp_path / "notes.txt").write_text("mine")
    assert main(["demo", "--strategy", "single", "--checkpoint", str(tmp_path)]) == 2
    assert "not a readable checkpoint" in capsys.readouterr().err


def test_a_precision_the_device_cannot_run_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(torch.amp.autocast_mode, "is_autocast_available", lambda device_type: False)
    assert main(["demo", "--strategy", "single", "--precision", "bf16-mixed"]) == 2
    err = capsys.readouterr().err
    assert "precision 'bf16-mixed' needs autocast" in err and len(err.splitlines()) == 1


def test_digits_without_scikit_learn_names_the_fix(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)  # an import of it now fails
    assert main(["demo", "--strategy", "single", "--data", "digits"]) == 2
    assert "pip install 'stratagem[demo]'" in capsys.readouterr().err


WITHOUT_MATPLOTLIB = (
    "import runpy, sys; sys.modules['matplotlib'] = None; "  # an import of it now fails
    "runpy.run_module('stratagem', run_name='__main__', alter_sys=True)"
)


def test_plot_without_matplotlib_names_the_fix_before_training(tmp_path):
    path = tmp_path / "loss.png"
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", WITHOUT_MATPLOTLIB, "demo", "--plot", str(path)],
        env=command_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert_one_line_error(done, "--plot needs matplotlib", "pip install 'stratagem[plot]'")
    assert done.stdout == ""  # no rank started
    assert not path.exists()


@pytest.mark.slow
def test_the_loss_curve_reaches_the_launcher_averaged_over_ranks():
    from stratagem.cli.classifier import Config, train
    from stratagem.cli.data import load

    data, threads = load("synthetic"), torch.get_num_threads()
    try:
        ranks = stratagem.launch(
            train,
            stratagem.ddp_spawn(device="cpu"),
            devices=2,
            args=(data, Config(2, 128, shown=False)),
        )
        # train() sets one thread for the ranks it runs on; here that is this process.
        [alone] = stratagem.launch(
            train, stratagem.single_device(device="cpu"), args=(data, Config(2, 256, shown=False))
        )
    finally:
        torch.set_num_threads(threads)
    steps = 1639 // 256
    epochs, losses = zip(*ranks[0].curve, strict=True)
    assert epochs == pytest.approx([(i + 1) / steps for i in range(2 * steps)])
    assert sum(losses[steps:]) / steps == pytest.approx(ranks[0].loss, rel=1e-6)
    assert ranks[1].curve == ranks[0].curve  # every rank holds the reduced values
    # The mean over two half batches is the loss of the whole batch in one process.
    assert losses == pytest.approx([loss for _, loss in alone.curve], rel=1e-4)


def _has_colour(image, rgb: str) -> bool:
    wanted = torch.tensor([int(rgb[i : i + 2], 16) / 255 for i in (1, 3, 5)])
    pixels = torch.as_tensor(image[..., :3].copy()).reshape(-1, 3)
    return bool(((pixels - wanted).abs().max(dim=1).values < 0.05).any())


@pytest.mark.slow
def test_plot_draws_the_loss_curves_of_both_runs_into_a_png(tmp_path):
    from matplotlib.image import imread

    path = tmp_path / "loss.png"
    done = stratagem_cli(
        "demo", "--devices", "2", "--data", "synthetic", "--epochs", "2", "--compare",
        "--plot", str(path), timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.rstrip().endswith(f"loss curves: {path}")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = imread(path)
    assert image.shape == (400, 700, 4)  # figsize 7 x 4 inches at 100 dpi, RGBA
    # The first two colours of matplotlib's cycle: the ddp_spawn curve and the single_device one.
    assert _has_colour(image, "#1f77b4") and _has_colour(image, "#ff7f0e")


def test_compare_inside_torchrun_is_refused(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["demo", "--compare"]) == 2
    assert "--compare" in capsys.readouterr().err


def _live_members(group: int) -> list[int]:
    """Processes of a process group that still run (zombies wait for a reaper, and hold nothing)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == group and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


DDP_FOREVER = ("--strategy", "ddp", "--devices", "2", "--data", "synthetic", "--epochs", "1000")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads process groups from /proc")
def test_ctrl_c_stops_every_rank():
    process = subprocess.Popen(
        [sys.executable, "-m", "stratagem", "demo", *DDP_FOREVER],
        env=command_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    try:
        assert process.stdout is not None
        lines = [process.stdout.readline() for _ in range(2)]
        assert lines[1].startswith("epoch "), lines  # the ranks are training
        os.killpg(process.pid, signal.SIGINT)  # what Ctrl-C sends: every process of the job
        started = time.monotonic()
        _, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert time.monotonic() - started < 15
    assert process.returncode == 130
    assert err.strip() == "stratagem: interrupted; every rank was stopped."
    deadline = time.monotonic() + 5  # multiprocessing's resource tracker exits on its own
    while _live_members(process.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _live_members(process.pid) == []


@pytest.mark.slow
@pytest.mark.parametrize(
    ("strategy", "name", "extra"),
    [
        ("fsdp", "fsdp_spawn", ("--devices", "2")),
        ("allreduce", "allreduce_grads_spawn+accumulate2", ("--devices", "2", "--accumulate", "2")),
        ("dp", "dp", ()),
    ],
)
def test_every_built_in_reaches_the_accuracy_and_matches_one_process(strategy, name, extra):
    done = stratagem_cli(
        "demo", "--strategy", strategy, *extra, "--compare", "--epochs", "4", timeout=300
    )
    assert done.returncode == 0, done.stderr
    row = table_row(done.stdout, name)
    assert float(row["test accuracy"].rstrip("%")) >= 85
    [difference] = re.findall(
        r"largest parameter difference vs single_device\(\): (\S+)", done.stdout
    )
    assert float(difference) < 1e-4
