"""The transformer benchmark (python -m manual_dp.bench.transformer): its PyTorch peer is the same
network (the same loss and every parameter's gradient, from a copy of our parameters), a tiny run
writes every row, and bad input fails with one line. (Timing is never asserted: the machine is shared.)"""
import json
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from mxnet import autograd, nd

from manual_dp.bench import transformer as bench
from manual_dp.lesson import cross_entropy
from manual_dp.models import build

PROG = "python -m manual_dp.bench.transformer"
TINY = ["--layers", "1", "--d-model", "16", "--heads", "2", "--batch-size", "32", "--steps", "2", "--pairs", "1"]


def torch_or_skip():
    """The torch module; the test is skipped, saying why, only where it cannot be imported."""
    try:
        import torch
    except ImportError as e:
        pytest.skip(f"PyTorch is not importable ({e}): install it with pip install -e .[bench] to check the peer")
    return torch


def our_loss_and_grads(net, params, X, y):
    """(mean cross-entropy, every parameter's gradient) of our transformer, by MXNet's autograd."""
    for p in params:
        p.attach_grad()
    with autograd.record():
        loss = cross_entropy(net.forward(nd.array(X), params), nd.array(y)).mean()
    loss.backward()
    return float(loss.asscalar()), [p.grad.asnumpy() for p in params]


def assert_the_same_network(net, params, X, y, peer):
    """The PyTorch `peer` holds copies of our `params` and gives our `net`'s loss and gradients on (X, y),
    to 1e-5 relative. The key bias's gradient is zero in exact arithmetic (softmax ignores a constant
    added to all of a query's scores), so both are rounding noise there: held to 1e-5 of the whole
    gradient's norm instead."""
    torch = torch_or_skip()
    from manual_dp.bench.peer_torch import mean_loss, transformer_params
    assert all(np.array_equal(a, p.asnumpy()) for a, p in zip(transformer_params(peer), params))
    assert sum(t.numel() for t in peer.parameters()) == net.n_params()     # nothing of its own besides
    loss, grads = our_loss_and_grads(net, params, X, y)
    peer_loss = mean_loss(peer(torch.from_numpy(X)), torch.from_numpy(y.astype(np.int64)))
    peer_loss.backward()
    assert abs(peer_loss.item() - loss) <= 1e-5 * abs(loss)
    total = np.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in grads))
    for name, g, t in zip(net.names(), grads, peer.ordered()):
        err = float(np.linalg.norm(t.grad.numpy() - g))
        if name.endswith("_bk"):
            assert np.linalg.norm(g) <= 1e-5 * total and err <= 1e-5 * total, name
        else:
            assert err <= 1e-5 * float(np.linalg.norm(g)), (name, err / np.linalg.norm(g))


def assert_one_line_exit_2(main, argv, capsys, prog):
    """main(argv) ends with exit status 2 and one line on stderr, `prog: error: ...`."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and err.startswith(f"{prog}: error:")


def test_the_pytorch_peer_is_the_same_network():
    """Copies of our parameters in, the same loss and gradients out (assert_the_same_network)."""
    torch_or_skip()
    from manual_dp.bench.peer_torch import torch_transformer
    net = build("transformer", layers=1, d_model=16, heads=2, patch=0)
    params = net.init_params(3)
    rng = np.random.RandomState(1)
    X, y = rng.rand(4, 1, 28, 28).astype(np.float32), rng.randint(0, 10, 4).astype(np.int32)
    assert_the_same_network(net, params, X, y, torch_transformer([p.asnumpy() for p in params], 1, 16, 2))


def run_bench(module, argv, out, written, timeout=300):
    """(the JSON file `written` in `out`, stdout) of `python -m MODULE ARGV --out OUT`, which must succeed."""
    done = subprocess.run([sys.executable, "-m", module, *argv, "--out", str(out)],
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads((out / written).read_text()), done.stdout


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    return run_bench("manual_dp.bench.transformer", TINY, tmp_path_factory.mktemp("transformer"), "transformer.json")


def test_a_tiny_run_writes_every_row(tiny_run):
    results, stdout = tiny_run
    impls = bench.impls()
    assert results["config"] == dict(results["config"], layers=1, d_model=16, heads=2, batch=32, steps=2, pairs=1)
    assert results["cpu"] and results["cores"] >= 1 and results["commit"]
    assert results["peak_gflops"] > 0 and results["flops_per_image"][1] > results["flops_per_image"][0] > 0
    rows = results["rows"]
    assert [(r["group"], r["impl"]) for r in rows] == [(0, impl) for impl in impls]
    assert not [r for r in rows if "error" in r]
    for r in rows:
        assert r["images_per_sec"] > 0 and 0 < r["peak_share"] < 1 and np.isfinite(r["final_loss"])
        assert r["devices"] == (1 if r["impl"] == "torch" else 2) and r["batch"] == 32
    # the same start, data and SGD steps: the same model at the end, whoever trained it
    assert max(r["final_loss"] for r in rows) - min(r["final_loss"] for r in rows) < 1e-3
    assert [s["impl"] for s in results["summary"]] == impls
    wanted = ["fast / PyTorch"] * ("torch" in impls) + ["fast / lesson"]
    assert [r["ratio"] for r in results["ratios"]] == wanted
    for r in results["ratios"]:
        assert r["median"] > 0 and len(r["group_ratios"]) == 1
    for s in results["summary"]:
        assert s["label"] in stdout
    assert "fast / lesson" in stdout


@pytest.mark.parametrize("argv", [["--heads", "3"], ["--steps", "0"], ["--pairs", "-1"], ["--layers", "x"],
                                  ["--batch-size", "1"], ["--d-model"], ["--bogus"]])
def test_bad_flags_are_one_line_and_exit_2(argv, capsys):
    assert_one_line_exit_2(bench.main, argv, capsys, PROG)


def test_a_bad_flag_in_a_fresh_process_and_an_out_that_is_a_file(tmp_path):
    (tmp_path / "f").write_text("")
    for argv in (["--d-model", "10", "--heads", "4"], ["--out", str(tmp_path / "f")]):
        done = subprocess.run([sys.executable, "-m", "manual_dp.bench.transformer", *argv],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and not done.stdout
        assert done.stderr.strip().count("\n") == 0 and done.stderr.startswith(f"{PROG}: error:")


def test_ctrl_c_is_one_line_and_exit_130(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "manual_dp.bench.transformer", *TINY, "--out", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.readline()                 # the machine's line: measuring has begun
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert err.strip() == f"{PROG}: error: interrupted"
    assert not (tmp_path / "transformer.json").exists()
