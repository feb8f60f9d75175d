"""Issue 41, item 2: a model file Gluon cannot hybridise, one that exits, and a model too large for
the machine each end in one line and a non-zero exit, before any work.

The memory there is comes from models.room.available_bytes, set here to a fixed amount (4 GiB) so
that the refusals do not depend on the machine the tests run on; every refused model needs far more
(the smallest, ResNet of --width 64, about 23 GiB), and an MLP that needs a few MiB still trains."""
import pytest

from conftest import run_main
from manual_dp.cli import build
from manual_dp.models import room

TINY = ["--train-size", "64", "--test-size", "32", "--batch-size", "32", "--epochs", "1", "--no-progress", "--cpus", "2"]
BLOCKS = """
import sys
from mxnet.gluon import nn

class Shape(nn.HybridBlock):
    def __init__(self):
        super().__init__()
        self.d = nn.Dense(10)
    def hybrid_forward(self, F, x):
        return self.d(x.reshape((x.shape[0], -1)))

class Numpy(nn.HybridBlock):
    def __init__(self):
        super().__init__()
        self.d = nn.Dense(10)
    def hybrid_forward(self, F, x):
        x.asnumpy()
        return self.d(x)

def shape():
    b = nn.HybridSequential(); b.add(nn.Dense(16), Shape()); return b
def numpy():
    b = nn.HybridSequential(); b.add(nn.Dense(16), Numpy()); return b
def whole():
    return Shape()
def drop_all():
    b = nn.HybridSequential(); b.add(nn.Dense(16), nn.Dropout(1.0), nn.Dense(10)); return b
def huge():
    b = nn.HybridSequential(); b.add(nn.Dense(2_000_000), nn.Dense(10)); return b
def exits():
    sys.exit(3)
"""


@pytest.fixture
def files(tmp_path):
    (tmp_path / "blocks.py").write_text(BLOCKS)
    (tmp_path / "exit0.py").write_text("import sys\nsys.exit(0)\n")
    (tmp_path / "exit3.py").write_text("import sys\nsys.exit(3)\n")
    return tmp_path


@pytest.fixture
def four_gib(monkeypatch):
    """The machine said to have 4 GiB available (the built networks and rooms cached afresh)."""
    monkeypatch.setattr(room, "available_bytes", lambda: 4 * 2 ** 30)
    build.room_of.cache_clear()
    build.network_of.cache_clear()
    yield
    build.room_of.cache_clear()
    build.network_of.cache_clear()


def refused(capsys, data_dir, argv):
    code, out, err = run_main(capsys, ["--data-dir", str(data_dir), *TINY, *argv])
    assert code == 2 and len(err) == 1 and err[0].startswith("manual_dp.train: error: "), (code, err)
    assert "epoch" not in out
    return err[0]


@pytest.mark.parametrize("fn,child", [("shape", "layer 1 (shape"), ("numpy", "layer 1 (numpy"), ("whole", "layer 0 (shape")])
def test_a_block_gluon_cannot_hybridise_is_named_in_one_line(capsys, data_dir, files, fn, child):
    line = refused(capsys, data_dir, ["--model", f"{files}/blocks.py:{fn}"])
    assert child in line and "cannot be hybridised" in line and ("shape" in line or "asnumpy" in line), line


def test_a_dropout_of_rate_one_is_refused_in_one_line(capsys, data_dir, files):
    line = refused(capsys, data_dir, ["--model", f"{files}/blocks.py:drop_all"])
    assert "Dropout(1.0)" in line and "[0, 1)" in line, line


@pytest.mark.parametrize("source,message", [("exit0.py:net", "exit0.py called sys.exit(0) as it loaded"),
                                            ("exit3.py:net", "exit3.py called sys.exit(3) as it loaded"),
                                            ("blocks.py:exits", "exits() called sys.exit(3)")])
def test_a_model_file_that_exits_is_refused_in_one_line(capsys, data_dir, files, source, message):
    assert message in refused(capsys, data_dir, ["--model", f"{files}/{source}"])


@pytest.mark.parametrize("argv", [["--model", "transformer", "--layers", "256", "--d-model", "2048", "--heads", "1"],
                                  ["--model", "transformer", "--d-model", "200000", "--heads", "1"],
                                  ["--model", "mlp", "--width", "100000"],
                                  ["--model", "resnet", "--width", "64", "--batch-size", "256"],
                                  ["--model", "{files}/blocks.py:huge"]], ids=["layers", "d-model", "mlp", "resnet", "dense"])
def test_a_model_too_large_for_the_machine_is_refused_before_it_is_made(capsys, data_dir, files, four_gib, argv):
    line = refused(capsys, data_dir, [a.format(files=files) for a in argv])
    assert "too large for this machine" in line and "more than the 4.0 GiB of memory available" in line, line


def test_a_model_that_fits_still_trains(capsys, data_dir, four_gib):
    code, out, err = run_main(capsys, ["--data-dir", str(data_dir), *TINY, "--model", "mlp"])
    assert code == 0 and "epoch 1/1" in out, err


def test_available_memory_is_read_from_the_system():
    assert room.available_bytes() > 0
