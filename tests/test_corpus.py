"""Text as a language-model corpus (manual_dp/datasets/corpus.py) and what a GPT run does with it:
windows and their next tokens, both vocabularies, the refusals, the command line, sampling."""
import os

import numpy as np
import pytest

from conftest import run_main
from manual_dp import datasets, sample
from manual_dp.config import RunConfig
from manual_dp.datasets import corpus
from test_lstm import fortunes_dir

GPT = ["--model", "gpt", "--layers", "1", "--d-model", "8", "--heads", "2", "--seq-len", "8", "--batch-size", "8",
       "--epochs", "1", "--cpus", "2"]


def test_windows_hold_the_next_token_at_every_position():
    X, y = corpus.windows(np.arange(20), 6)
    assert X.tolist() == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17]]
    assert (y == X + 1).all() and X.dtype == np.float32 and y.dtype == np.int32


def test_text_file_in_bytes_and_in_characters(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("héllo wörld, " * 30, encoding="utf-8")
    raw = path.read_bytes()
    as_bytes = datasets.read(f"text:{path}", None, 8, "next-token", "bytes")
    assert as_bytes.spec.vocab == 256 and as_bytes.spec.targets == (8,) and as_bytes.spec.text == "bytes"
    assert as_bytes.train[0][0].tolist() == list(raw[:8])
    chars = datasets.read(f"text:{path}", None, 8, "next-token", "chars")
    assert "".join(chars.spec.names) == " ,dhlorwéö" and chars.spec.vocab == 10
    (X, _), (Xt, _) = chars.train, chars.test
    assert sample.decode([int(i) for i in X[0]], chars.spec) == "héllo wö"
    assert len(X) * 8 <= 0.9 * len("héllo wörld, " * 30) < (len(X) + 1) * 8 + 1 and len(Xt) >= 1


def test_fortunes_as_a_corpus_hold_out_every_tenth_fortune(tmp_path):
    data = fortunes_dir(tmp_path / "f", sizes=(23, 15))
    got = corpus.load_fortunes(str(data), 16, "bytes")
    text = bytes(int(i) for i in got.test[0][0])
    assert text.startswith(b"fortune 9 of a") and got.spec.task == "next-token"
    train = b"".join(bytes(int(i) for i in x) for x in got.train[0])
    assert b"fortune 9 of a" not in train and b"fortune 8 of a" in train


@pytest.mark.parametrize("write, argv, message", [
    (lambda p: p.write_bytes(b"caf\xe9 " * 40), ["--vocab", "chars"], "is not UTF-8, which --vocab chars reads"),
    (lambda p: p.write_text("short"), [], "shorter than one example of --seq-len 8 + 1"),
    (lambda p: None, [], "no such file"),
])
def test_bad_text_is_refused_in_one_line(capsys, tmp_path, write, argv, message):
    path = tmp_path / "t.txt"
    write(path)
    code, _, err = run_main(capsys, GPT + ["--data", f"text:{path}"] + argv)
    assert code == 1 and len(err) == 1 and message in err[0], err


@pytest.mark.parametrize("argv, message", [
    (["--model", "lenet", "--data", "text:x.txt"], "--data text is a corpus for a language model"),
    (["--model", "gpt", "--layers", "1"], "predicts the next token of a text"),
    (["--model", "lstm", "--data", "fortunes", "--vocab", "chars"], "--vocab applies only to a text corpus"),
    (["--model", "gpt", "--data", "fortunes", "--seq-len", "6", "--mode", "context", "--cpus", "4"],
     "4 contexts cannot each take two chunks of the GPT's 6 tokens"),
])
def test_flags_that_do_not_fit_the_model_are_refused(capsys, argv, message):
    code, _, err = run_main(capsys, argv + (["--cpus", "2"] if "--cpus" not in argv else []) + ["--dry-run"])
    assert code == 2 and len(err) == 1 and message in err[0], err


def test_npz_of_tokens_and_next_tokens(capsys, tmp_path):
    rng = np.random.RandomState(0)
    ids = rng.randint(0, 13, size=(40, 9))
    np.savez(tmp_path / "a.npz", X=ids[:, :-1], y=ids[:, 1:])
    got = datasets.read(f"npz:{tmp_path / 'a.npz'}", None, 8, "next-token")
    assert got.spec.vocab == 13 and got.spec.targets == (8,) and len(got.train[0]) == 36
    np.savez(tmp_path / "b.npz", X=ids[:, :-1], y=ids[:, 0])
    argv = ["--model", "gpt", "--layers", "1", "--d-model", "8", "--heads", "2", "--cpus", "2"]
    code, _, err = run_main(capsys, argv + ["--data", f"npz:{tmp_path / 'b.npz'}"])
    assert code == 1 and len(err) == 1 and "y of X's shape" in err[0], err


def test_a_gpt_run_reports_validation_bits_and_samples_the_same_text_from_its_seed(capsys, tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("the cat sat on the mat. " * 60)
    ck = tmp_path / "ck"
    code, out, err = run_main(capsys, GPT + ["--data", f"text:{path}", "--vocab", "chars", "--checkpoint-dir", str(ck)])
    assert code == 0, err
    line = next(l for l in out.splitlines() if l.startswith("epoch 1/1"))
    assert "val loss" in line and "bits/token" in line and "tokens/s" in line and "MFU" in line
    assert "sample (200 tokens" in out
    argv = [str(ck), "--prompt", "the ", "--tokens", "30", "--top-k", "3", "--seed", "7"]
    texts = []
    for _ in range(2):
        sample.main(argv)
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0].startswith("the ") and len(texts[0]) == len("the ") + 30 + 1
    assert set(texts[0][:-1]) <= set("the cat sat on the mat.")
    with pytest.raises(SystemExit) as e:
        sample.main(argv[:1] + ["--prompt", "xyz!"])
    assert e.value.code == 2 and "are not among the model's" in capsys.readouterr().err


def test_sample_refuses_a_checkpoint_of_another_model(capsys, tmp_path):
    code, _, err = run_main(capsys, ["--cpus", "1", "--epochs", "1", "--train-size", "64", "--test-size", "16",
                                     "--checkpoint-dir", str(tmp_path / "ck")])
    assert code == 0, err
    with pytest.raises(SystemExit) as e:
        sample.main([str(tmp_path / "ck")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and len(err) == 1 and "not a GPT" in err[0]


def test_debian_fortunes_are_a_corpus_for_the_gpt():
    if not os.path.isdir(corpus.FORTUNES["directory"]):
        pytest.skip("Debian's fortunes package is not installed (setup.sh installs it)")
    got = datasets.load(RunConfig(data="fortunes", model="gpt", seq_len=64))
    assert got.spec.task == "next-token" and got.spec.vocab == 256 and len(got.train[0]) > 30000


def test_a_users_gluon_block_reads_token_ids(capsys, tmp_path):
    rng = np.random.RandomState(0)
    X = rng.randint(0, 20, size=(96, 6))
    np.savez(tmp_path / "t.npz", X=X, y=X[:, 0] % 3)
    (tmp_path / "mine.py").write_text(
        "from mxnet.gluon import nn\n"
        "def net():\n"
        "    block = nn.HybridSequential()\n"
        "    block.add(nn.Embedding(20, 8), nn.Flatten(), nn.Dense(16, activation='relu'), nn.Dense(3))\n"
        "    return block\n")
    losses = []
    for n in (1, 2):
        code, out, err = run_main(capsys, ["--model", f"{tmp_path / 'mine.py'}:net", "--data", f"npz:{tmp_path / 't.npz'}",
                                           "--cpus", str(n), "--epochs", "2", "--batch-size", "16", "--optimizer", "adam",
                                           "--lr", "0.01", "--mode", "zero", "--zero-stage", "3"])
        assert code == 0, err
        losses.append([float(l.split("loss ")[1].split()[0]) for l in out.splitlines() if l.startswith("epoch")])
    assert losses[0] == losses[1] and losses[0][1] < losses[0][0]
