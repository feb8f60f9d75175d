"""The pipeline schedules from the command line: --schedule interleaved | zb-h1, --virtual-stages,
--dry-run; each schedule's first epoch equal to one context's (loss to 1e-4 relative: float32 sums
of micro-batches in another order), bad choices refused in one line with exit 2."""
import json

import pytest

from conftest import run_main

SMALL = ["--train-size", "96", "--test-size", "40", "--batch-size", "32", "--epochs", "1", "--no-progress",
         "--optimizer", "sgd", "--model", "transformer", "--layers", "2", "--d-model", "16", "--heads", "4"]


def test_dry_run_prints_the_schedule_and_trains_nothing(capsys, tmp_path):
    log = tmp_path / "log.jsonl"
    code, out, err = run_main(capsys, [*SMALL, "--cpus", "4", "--mode", "pipeline", "--stages", "4",
                                       "--schedule", "zb-h1", "--micro-batches", "8", "--dry-run",
                                       "--log-json", str(log), "--data-dir", str(tmp_path / "no-data-here")])
    assert code == 0, err
    lines = out.splitlines()
    assert "mesh pp=4 (pipeline): [cpu(0) cpu(1) cpu(2) cpu(3)]" in out
    assert sum(l.startswith("device ") for l in lines) == 4
    assert "bubble (idle share of the step): 0.111 simulated, formula 0.111" in out
    assert "the papers' ratio, idle over compute: 0.125 simulated, formula 0.125" in out
    assert "peak held (micro-batches): [4, 4, 4, 4] until W, [4, 3, 2, 1] until B" in out
    priced = next(l for l in lines if l.startswith("priced with the model's FLOPs"))
    assert "; B 0.00 " in priced and "; W " in priced          # stage 0's input is the images: no B
    timed = next(l for l in lines if l.startswith("priced with its actions timed here, one micro-batch of 4 alone"))
    assert "; W " in timed and lines[lines.index(timed) + 1].startswith("bubble (idle share of the step): ")
    assert lines[-1] == "dry run: nothing trained" and not log.exists()


@pytest.mark.parametrize("schedule,extra", [("interleaved", ["--virtual-stages", "2"]), ("zb-h1", []),
                                            ("1f1b", []), ("gpipe", [])])
def test_dry_run_bubbles_at_p4_m8(capsys, schedule, extra):
    """The issue's target: interleaved (V=2) and ZB-H1 below 1F1B at p=4, m=8."""
    code, out, err = run_main(capsys, [*SMALL, "--layers", "6", "--cpus", "4", "--mode", "pipeline", "--stages", "4",
                                       "--schedule", schedule, *extra, "--micro-batches", "8", "--dry-run"])
    assert code == 0, err
    bubble = float(out.split("bubble (idle share of the step): ")[1].split()[0])
    ratio = {"gpipe": 0.375, "1f1b": 0.375, "interleaved": 0.1875, "zb-h1": 0.125}[schedule]    # idle over compute
    assert bubble == pytest.approx(ratio / (1 + ratio), abs=1e-3)


@pytest.mark.parametrize("argv", [["--mode", "pipeline", "--schedule", "interleaved", "--micro-batches", "4"],
                                  ["--mode", "pipeline", "--schedule", "zb-h1", "--micro-batches", "4"],
                                  ["--mode", "hybrid", "--cpus", "4", "--schedule", "zb-h1", "--micro-batches", "2"]])
def test_each_schedule_trains_like_one_context(capsys, data_dir, tmp_path, argv):
    def first_loss(name, *more):
        log = tmp_path / f"{name}.jsonl"
        code, _, err = run_main(capsys, [*SMALL, "--data-dir", str(data_dir), "--log-json", str(log), *more])
        assert code == 0, err
        return json.loads(log.read_text().splitlines()[0])["train_loss"]
    one = first_loss("one", "--cpus", "1")
    got = first_loss("schedule", *(["--cpus", "2"] if "--cpus" not in argv else []), *argv)
    assert abs(got - one) <= 1e-4 * abs(one)


@pytest.mark.parametrize("argv,message", [
    (["--mode", "pipeline", "--schedule", "1f1b", "--virtual-stages", "2"], "--virtual-stages 2 needs --schedule interleaved"),
    (["--mode", "pipeline", "--schedule", "interleaved", "--virtual-stages", "3"],
     "--stages 2 x --virtual-stages 3: --model transformer has 4 layers"),
    (["--mode", "pipeline", "--schedule", "interleaved", "--micro-batches", "3"], "--schedule interleaved:"),
    (["--mode", "sync", "--virtual-stages", "2"], "--virtual-stages applies only to --mode pipeline or hybrid"),
    (["--mode", "pipeline", "--schedule", "zb-h2"], "invalid choice"),
    (["--mode", "pipeline", "--virtual-stages", "0"], "--virtual-stages must be >= 1"),
])
def test_bad_schedules_end_in_one_line_and_exit_2(capsys, data_dir, argv, message):
    code, _, err = run_main(capsys, [*SMALL, "--data-dir", str(data_dir), "--cpus", "2", *argv])
    assert code == 2 and len(err) == 1 and message in err[0], err
