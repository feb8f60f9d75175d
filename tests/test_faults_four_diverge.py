"""Issue 41, item 3: `python -m manual_dp.diverge` on hand-made digest files ends in one line and
exit 2, never a traceback; --replay refuses a file without an update; two --deterministic runs that
differ in their sequence pieces are said to, before the tensor where they part."""
import json

import pytest

from conftest import run_main
from manual_dp import diverge

GOOD = {"update": 1, "tensors": [["grad", "w", "0123456789abcdef", 1.0, 2.0]]}
TINY = ["--model", "transformer", "--layers", "1", "--d-model", "16", "--heads", "2", "--train-size", "64",
        "--test-size", "32", "--batch-size", "32", "--epochs", "1", "--no-progress", "--deterministic"]


def run(capsys, argv):
    """(exit status, stdout, stderr lines) of diverge.main(argv), in this process."""
    with pytest.raises(SystemExit) as done:
        diverge.main([str(a) for a in argv])
    out = capsys.readouterr()
    return done.value.code, out.out, out.err.strip().splitlines()


def written(path, *lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


@pytest.fixture
def good(tmp_path):
    return written(tmp_path / "good.jsonl", json.dumps(GOOD))


@pytest.mark.parametrize("value", ["1" + "0" * 400, "[1]", '{"a": 1}', '"x"', "true"],
                         ids=["huge-int", "list", "dict", "string", "bool"])
@pytest.mark.parametrize("where", [3, 4], ids=["sum", "norm"])
def test_a_sum_or_norm_that_is_no_number_is_one_line(capsys, tmp_path, good, value, where):
    fields = ['"grad"', '"w"', '"0123456789abcdef"', "1.0", "2.0"]
    fields[where] = value
    bad = written(tmp_path / "bad.jsonl", '{"update": 1, "tensors": [[%s]]}' % ", ".join(fields))
    code, out, err = run(capsys, [good, bad])
    assert code == 2 and len(err) == 1 and "line 1 is not a digest record" in err[0] and not out, err


@pytest.mark.parametrize("line,replay", [("[" * 100000 + "]" * 100000, []),
                                         ('{"run": ' + "[" * 100000 + "]" * 100000 + "}", ["--replay"])],
                         ids=["record", "header-replayed"])
def test_deeply_nested_json_is_one_line(capsys, tmp_path, good, line, replay):
    bad = written(tmp_path / "deep.jsonl", line, json.dumps(dict(GOOD, update=2)))
    code, _, err = run(capsys, [bad, good, *replay])
    assert code == 2 and len(err) == 1 and err[0].startswith("manual_dp.diverge: error: "), err


def test_a_device_is_refused_in_one_line_not_read_forever(capsys, good):
    code, _, err = run(capsys, [good, "/dev/zero"])
    assert code == 2 and len(err) == 1 and "/dev/zero: not a file" in err[0], err


@pytest.mark.parametrize("argv", [["one.jsonl"], []], ids=["one", "none"])
def test_a_missing_argument_is_one_line_with_the_usage_in_it(capsys, argv):
    code, out, err = run(capsys, argv)
    assert code == 2 and len(err) == 1 and "required" in err[0] and "python -m manual_dp.diverge A B" in err[0], err


def test_replay_of_a_file_with_a_header_and_no_update_is_refused(capsys, tmp_path, good):
    run_line = json.dumps({"run": {"model": "lenet", "mode": "sync", "cpus": 1}})
    head, full = written(tmp_path / "head.jsonl", run_line), written(tmp_path / "full.jsonl", run_line, json.dumps(GOOD))
    code, _, err = run(capsys, [head, full, "--replay"])
    assert code == 2 and len(err) == 1 and "holds a header and no update" in err[0], err


def test_deterministic_runs_of_other_sequence_pieces_are_named_before_the_tensor(capsys, data_dir, tmp_path):
    """--deterministic sync (the sequence whole) against --deterministic context (4 pieces by
    default): the setting named first; sync given --sequence-pieces 4 is the context run's bits."""
    paths = {}
    for name, extra in (("sync", ["--cpus", "1"]), ("context", ["--mode", "context", "--cpus", "2"]),
                        ("sync4", ["--cpus", "1", "--sequence-pieces", "4"])):
        paths[name] = tmp_path / f"{name}.jsonl"
        code, _, err = run_main(capsys, ["--data-dir", str(data_dir), *TINY, *extra, "--digests", str(paths[name])])
        assert code == 0, err
    assert json.loads(paths["sync"].read_text().splitlines()[0])["run"]["pieces"] == {"sequence": 1, "tensor": 1}
    code, out, _ = run(capsys, [paths["sync"], paths["context"]])
    assert code == 1 and out.startswith("the runs differ in --sequence-pieces: 1 against 4; the runs part at update 1")
    code, out, _ = run(capsys, [paths["sync4"], paths["context"]])
    assert code == 0 and out.startswith("identical"), out
