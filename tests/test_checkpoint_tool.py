"""`python -m manual_dp.checkpoint DIR [--export FILE.params]`: a checkpoint read outside the trainer."""
import numpy as np
import pytest

from conftest import run_main
from manual_dp import checkpoint


def tool(capsys, argv):
    """(exit status, stdout, stderr lines) of python -m manual_dp.checkpoint argv."""
    try:
        checkpoint.main(argv)
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err.strip().splitlines()


def trained(capsys, tmp_path, *flags):
    ck = tmp_path / "ck"
    code, _, err = run_main(capsys, ["--cpus", "2", "--epochs", "1", "--train-size", "64", "--test-size", "32",
                                     "--batch-size", "32", "--checkpoint-dir", str(ck), *flags])
    assert code == 0, err
    return ck


def test_it_says_what_a_checkpoint_holds_and_exports_its_parameters(capsys, tmp_path):
    from mxnet import nd
    ck = trained(capsys, tmp_path)
    code, out, err = tool(capsys, [str(ck), "--export", str(tmp_path / "lenet.params")])
    assert code == 0, err
    assert "epoch 1, update 2" in out and "model lenet" in out and "saved by --mode sync on cpu(0), cpu(1)" in out
    state, meta = checkpoint.load(ck)
    saved = nd.load(str(tmp_path / "lenet.params"))
    assert list(saved) == [name for name, _ in checkpoint.described_shapes(meta)]
    assert all(np.array_equal(saved[name].asnumpy(), p) for name, p in zip(saved, state["params"]))
    code, _, err = tool(capsys, [str(ck), "--export", str(tmp_path / "lenet.params")])
    assert code == 1 and len(err) == 1 and "exists" in err[0]


def test_a_users_block_loads_the_exported_file_and_gives_the_same_scores(capsys, tmp_path):
    import mxnet as mx
    from mxnet import nd
    from manual_dp.models.gluon_block import load_block
    from manual_dp.models import build
    (tmp_path / "mine.py").write_text(
        "from mxnet.gluon import nn\n"
        "def net():\n"
        "    block = nn.HybridSequential()\n"
        "    block.add(nn.Conv2D(4, 3, activation='relu'), nn.Flatten(), nn.Dense(16, activation='relu'), nn.Dense(10))\n"
        "    return block\n")
    name = f"{tmp_path / 'mine.py'}:net"
    ck = trained(capsys, tmp_path, "--model", name)
    code, _, err = tool(capsys, [str(ck), "--export", str(tmp_path / "mine.params")])
    assert code == 0, err
    block = load_block(name)
    block.load_parameters(str(tmp_path / "mine.params"), ctx=mx.cpu(0))
    state, _ = checkpoint.load(ck)
    X = nd.array(np.random.RandomState(0).rand(5, 1, 28, 28).astype(np.float32))
    ours = build(name).forward(X, [nd.array(p) for p in state["params"]])
    assert np.abs(block(X).asnumpy() - ours.asnumpy()).max() <= 1e-5


@pytest.mark.parametrize("argv, code, message", [
    (["/nonexistent/dir"], 1, "holds no checkpoint.npz"),
    ([], 2, "the following arguments are required"),
])
def test_bad_input_is_one_line(capsys, argv, code, message):
    got, _, err = tool(capsys, argv)
    assert got == code and len(err) == 1 and message in err[0], err
