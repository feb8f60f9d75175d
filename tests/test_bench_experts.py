"""`python -m manual_dp.bench.experts`: EP against replicated experts, tokens/s side by side, and the
all-to-all's share of the EP step."""
import json
import subprocess
import sys

import mxnet as mx
import numpy as np

from manual_dp.bench.experts import TimedGroup
from manual_dp.strategies.expert.exchange import ExpertGroup

TINY = ["--batch", "8", "--steps", "1", "--rounds", "1", "--d-model", "16", "--heads", "2", "--layers", "1"]


def test_ep_is_timed_beside_replicated_experts_with_its_all_to_all(tmp_path):
    done = subprocess.run([sys.executable, "-m", "manual_dp.bench.experts", "--out", str(tmp_path)] + TINY,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "cores, commit" in done.stdout.splitlines()[0] and "1.00x replicated" in done.stdout
    runs = json.loads((tmp_path / "experts.json").read_text())["runs"]
    assert set(runs) == {"2", "4"} and "k=4 MoE, expert ep=2 x dp=2" in runs["4"] and len(runs["4"]) == 5
    assert all(r["tokens_per_s"] > 0 for rows in runs.values() for r in rows.values())
    ep = runs["2"]["k=2 MoE, expert ep=2"]
    assert 0 < ep["share"] <= 1 and 0 < ep["forward_all_to_all_s"] < ep["step_s"]
    # 1 block, 2 contexts of 4 windows: slots (4 experts, 4 x 16, 16) a context, half of them leave;
    # send and back, forward and backward: 4 x 2 x 4096 / 2 floats
    assert ep["bytes_per_step"] == 4 * 2 * 4096 // 2 * 4


def test_the_timed_group_exchanges_as_the_plain_one_and_counts_what_crosses():
    ctx = [mx.cpu(0), mx.cpu(1)]
    rng = np.random.default_rng(0)
    slots = [mx.nd.array(rng.random((4, 3 + i, 2)), ctx=c) for i, c in enumerate(ctx)]
    timed, plain = TimedGroup(ctx, 4), ExpertGroup(ctx, 4)
    for a, b in zip(timed.send(slots), plain.send(slots)):
        assert np.array_equal(a.asnumpy(), b.asnumpy())
    assert timed.sent == (4 * 3 * 2 + 4 * 4 * 2) // 2 * 4 and timed.took > 0
    back = timed.back(plain.send(slots), [3, 4])
    assert [b.shape for b in back] == [(4, 3, 2), (4, 4, 2)]
    assert timed.sent == (4 * 3 * 2 + 4 * 4 * 2) // 2 * 4 + (2 * 4 * 2 + 2 * 3 * 2) * 4   # rows of the other


def test_counts_that_do_not_divide_the_experts_are_one_line_and_exit_2():
    done = subprocess.run([sys.executable, "-m", "manual_dp.bench.experts", "--experts", "4", "--cpus", "3"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and "--cpus 3" in done.stderr
