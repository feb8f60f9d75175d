"""The memory line knows experts: how many of each MoE block's a context holds, and their bytes
against all of them (what a replica holds)."""
from types import SimpleNamespace

import mxnet as mx
import pytest

from manual_dp import memory
from manual_dp.bench.experts import gpt
from manual_dp.strategies.data.data_parallel import DataParallel
from manual_dp.strategies.expert.expert_parallel import ExpertParallel
from manual_dp.strategies.zero.zero import ZeroRedundancy

SIZES = SimpleNamespace(layers=2, d_model=16, heads=2)
CTX = [mx.cpu(i) for i in range(4)]


def expert_bytes(net):
    """Bytes of every expert parameter of `net`, counted from numpy."""
    return sum(p.size * 4 for i, p in enumerate(net.init_params(0)) if i in set(net.expert_params()))


@pytest.mark.parametrize("N", [1, 2, 4])
def test_under_expert_parallelism_a_context_holds_e_over_n_experts(N):
    net = gpt(SIZES, 4)
    report = memory.held_bytes(ExpertParallel(net.init_params(0), CTX, "momentum", N, model=net))
    whole = expert_bytes(net)
    for r in report.values():
        assert r["experts"] == {"held": 4 // N, "of": 4, "bytes": whole // N, "whole_bytes": whole}
    assert "experts %d of 4 (" % (4 // N) in memory.format_report(memory.per_context(
        ExpertParallel(net.init_params(0), CTX, "momentum", N, model=net), 8))


def test_sync_replicates_every_expert_and_the_expert_bytes_add_up_to_the_difference():
    net = gpt(SIZES, 4)
    sync = memory.held_bytes(DataParallel(net.init_params(0), CTX, "momentum", model=net))
    ep = memory.held_bytes(ExpertParallel(net.init_params(0), CTX, "momentum", 4, model=net))
    for s, e in zip(sync.values(), ep.values()):
        assert s["experts"]["held"] == 4 and s["experts"]["bytes"] == s["experts"]["whole_bytes"]
        assert s["param_bytes"] - e["param_bytes"] == s["experts"]["bytes"] - e["experts"]["bytes"]


def test_a_dense_model_or_flattened_shards_say_nothing_of_experts():
    dense, net = gpt(SIZES, 0), gpt(SIZES, 4)
    assert memory.expert_layout(DataParallel(dense.init_params(0), CTX, "momentum", model=dense)) == {}
    zero = ZeroRedundancy(net.init_params(0), CTX, "momentum", stage=3, model=net)
    assert memory.expert_layout(zero) == {} and "experts" not in memory.format_report(memory.per_context(zero, 8))
