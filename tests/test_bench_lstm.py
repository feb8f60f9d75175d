"""`python -m manual_dp.bench.lstm` runs seed 000's comparison end to end on a small fortunes folder."""
import json

from manual_dp.bench.lstm import main
from test_lstm import fortunes_dir


def test_bench_lstm_writes_every_runs_accuracy(tmp_path, capsys):
    data = fortunes_dir(tmp_path / "f", sizes=(30, 20, 10))
    main(["--data", f"fortunes:{data}", "--epochs", "2", "--batch-size", "16", "--d-model", "8",
          "--out", str(tmp_path / "out"), "--seeds", "2"])
    record = json.loads((tmp_path / "out" / "lstm.json").read_text())
    assert set(record["test_acc"]) == {"gluon", "sync", "lesson", "async"}
    assert all(len(accs) == 2 and all(0 <= a <= 1 for a in accs) for accs in record["test_acc"].values())
    out = capsys.readouterr().out
    assert record["majority"] == 3 / 6 and "most common category: 0.500" in out
    assert len(record["by_seed"]) == 2 and "sync    last epoch, mean of 2 seed(s)" in out and "(standard error)" in out
