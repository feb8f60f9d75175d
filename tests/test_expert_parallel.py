"""Expert parallelism (manual_dp/strategies/expert/): the all-to-alls of a group against numpy, the MoE
GPT trained on ep = 2, 4 contexts and dp = 4 x ep = 2 against one context (parameters to 1e-5 of the
largest, the first loss to 1e-4 relative), the same tokens dropped, a checkpoint that moves between it
and sync data parallelism, and the command line's layout line and refusals."""
import numpy as np
import pytest
from mxnet import autograd, nd

from conftest import assert_trained_as, cpus, params_after_steps, run_main
from manual_dp import models
from manual_dp.datasets import Spec
from manual_dp.models.moe import Experts, routing
from manual_dp.strategies.data.data_parallel import DataParallel
from manual_dp.strategies.expert.exchange import ExpertGroup
from manual_dp.strategies.expert.expert_parallel import ExpertParallel

TOL = 1e-5
SPEC = Spec((8,), 11, 11, task="next-token")


def small(E=4, K=2, factor=1.0):
    return models.build("gpt", layers=1, d_model=16, heads=2, spec=SPEC, experts=Experts(E, K, factor, 0.01))


def tokens(n, seed=0):
    ids = np.random.RandomState(seed).randint(0, SPEC.vocab, size=(n, SPEC.shape[0] + 1))
    return ids[:, :-1].astype(np.float32), ids[:, 1:].astype(np.int32)


@pytest.mark.parametrize("N", [2, 4])
def test_send_and_back_are_the_numpy_exchange_and_its_transpose(N):
    E, C, d, rows = 4, 3, 5, [2, 1, 3, 2][:N]
    rng = np.random.RandomState(N)
    slots = [rng.randn(E, b * C, d).astype(np.float32) for b in rows]
    group, per = ExpertGroup(cpus(N), E), E // N
    xs = [nd.array(s, ctx=c) for s, c in zip(slots, cpus(N))]
    for x in xs:
        x.attach_grad()
    with autograd.record():
        got = group.send(xs)
        back = group.back([g * (j + 1) for j, g in enumerate(got)], [b * C for b in rows])
        total = nd.add_n(*[(b * b).sum().as_in_context(cpus(1)[0]) for b in back])
    for j, g in enumerate(got):                    # context j: experts j*per.. of every context, rows in rank order
        assert g.context == cpus(N)[j]
        np.testing.assert_array_equal(g.asnumpy(), np.concatenate([s[j * per:(j + 1) * per] for s in slots], axis=1))
    scale = np.repeat(np.arange(1, N + 1), per)[:, None, None]      # expert e's output: its slots times its rank + 1
    for i, b in enumerate(back):
        np.testing.assert_allclose(b.asnumpy(), slots[i] * scale, rtol=1e-6)
    total.backward()                               # d/dx sum((x * scale)^2) = 2 scale^2 x, through both transposes
    for x, s in zip(xs, slots):
        np.testing.assert_allclose(x.grad.asnumpy(), 2 * scale ** 2 * s, rtol=1e-5)


def after(strategy, steps=3, n=24):
    X, y = tokens(n)
    first = strategy.step(X, y, 0.05)
    return params_after_steps(strategy, X, y, steps - 1), first


@pytest.fixture(scope="module")
def reference():
    net = small()
    P = net.init_params(0)
    return net, P, after(DataParallel(P, cpus(1), "momentum", lesson=True, model=net))


@pytest.mark.parametrize("n, ep", [(2, 2), (4, 4), (4, 2), (2, 1)])
def test_expert_parallel_equals_one_context(reference, n, ep):
    net, P, (want, first) = reference
    model = ExpertParallel(P, cpus(n), "momentum", ep, model=net)
    assert model.params[0][net.expert_params()[0]].shape[0] == 4 // ep       # E/ep experts a context
    got, metrics = after(model)
    assert_trained_as(got, want, P, TOL)
    loss, want_loss = (sum(float(m[0].asscalar()) for m in ms) for ms in (metrics, first))
    assert abs(loss - want_loss) <= 1e-4 * want_loss


def test_expert_parallel_drops_the_tokens_one_context_drops(reference):
    """At capacity factor 1.0 some choices are dropped; each context's windows route as one context's
    rows do (the routing of the same rows, with the whole experts, on one context)."""
    net, P, _ = reference
    X, y = tokens(24)
    model = ExpertParallel(P, cpus(4), "momentum", 2, model=net)
    whole = model.state_dict()["params"]
    assert all(np.array_equal(a, b.asnumpy()) for a, b in zip(whole, P))
    h = net.layers[0].forward(nd.array(X), P[:2])
    expert, slot, kept = routing(h, P[2:2 + len(net.layers[1].params)], 8, net.experts, 8)
    assert not kept.all()                            # some tokens dropped
    pieces = [routing(net.layers[0].forward(nd.array(X[a:b]), P[:2]), P[2:2 + len(net.layers[1].params)], 8,
                      net.experts, 8) for a, b in ((0, 6), (6, 12), (12, 18), (18, 24))]
    for got, want in zip(zip(*pieces), (expert, slot, kept)):
        np.testing.assert_array_equal(np.concatenate(got), want)


def test_a_checkpoint_moves_between_expert_and_data_parallelism(reference):
    net, P, _ = reference
    X, y = tokens(24, seed=1)
    ep = ExpertParallel(P, cpus(2), "momentum", 2, model=net)
    ep.step(X, y, 0.05)
    dp = DataParallel(P, cpus(1), "momentum", lesson=True, model=net)
    dp.load_state_dict(ep.state_dict())
    ep2 = ExpertParallel(P, cpus(4), "momentum", 4, model=net)
    ep2.load_state_dict(ep.state_dict())
    for m in (ep, dp, ep2):
        m.step(X, y, 0.05)
    assert_trained_as(ep2.state_dict()["params"], dp.state_dict()["params"], P, TOL)
    assert_trained_as(ep.state_dict()["params"], dp.state_dict()["params"], P, TOL)
    correct = [float(m.correct(X[:3], y[:3]).asscalar()) for m in (ep2, dp)]   # 3 rows on 4 contexts: padded
    assert abs(correct[0] - correct[1]) <= 1e-5


def test_the_strategy_refuses_what_it_cannot_lay_out():
    P = small().init_params(0)
    for N, E, message in ((3, 4, "does not divide --experts 4"), (4, 4, "does not divide 2 contexts")):
        with pytest.raises(ValueError, match=message):
            ExpertParallel(P, cpus(2 if N == 4 else 3), "momentum", N, model=small(E))
    dense = models.build("gpt", layers=1, d_model=16, heads=2, spec=SPEC)
    with pytest.raises(ValueError, match="has none"):
        ExpertParallel(dense.init_params(0), cpus(2), "momentum", 2, model=dense)


def test_each_context_holds_its_share_of_the_experts(reference):
    net, P, _ = reference
    whole = sum(p.size for p in P)
    experts = sum(P[i].size for i in net.expert_params())
    for n, ep in ((2, 2), (4, 4), (4, 2)):
        model = ExpertParallel(P, cpus(n), "momentum", ep, model=net)
        held = [sum(p.size for p in W) for W in model.params]
        assert held == [whole - experts + experts // ep] * n


# -- the command line ---------------------------------------------------------------------------------
def corpus(tmp_path):
    """A small text file of its own (no download)."""
    words = np.random.RandomState(0).choice(["the ", "moe ", "routes ", "tokens ", "per ", "window. ", "\n"], 1500)
    path = tmp_path / "corpus.txt"
    path.write_text("".join(words))
    return path


def argv_of(tmp_path, *flags):
    return ["--model", "gpt", "--data", f"text:{corpus(tmp_path)}", "--layers", "1", "--d-model", "16", "--heads", "2",
            "--seq-len", "8", "--train-size", "64", "--test-size", "16", "--batch-size", "16", "--epochs", "1",
            "--no-progress", *flags]


def test_the_command_line_trains_with_the_experts_sharded(capsys, tmp_path):
    code, out, err = run_main(capsys, argv_of(tmp_path, "--experts", "4", "--mode", "expert", "--expert-parallel", "2",
                                              "--cpus", "4", "--check-replicas", "1"))
    assert code == 0, err
    assert "mode expert: the 4 experts of every MoE block sharded over 2 context(s) per group (2 experts a context" \
        in out
    assert "memory per context: cpu(0)" in out and "done: test acc" in out
    memory_line = next(line for line in out.splitlines() if line.startswith("memory per context"))
    assert memory_line.count(", experts 2 of 4 (") == 4                   # every context, from the probe


@pytest.mark.parametrize("flags, message", [
    (["--mode", "expert", "--cpus", "2"], "--mode expert shards the experts of an MoE"),
    (["--experts", "4", "--mode", "expert", "--cpus", "3"], "--expert-parallel 3 does not divide --experts 4"),
    (["--experts", "4", "--mode", "expert", "--expert-parallel", "2", "--cpus", "3"], "does not divide the 3 contexts"),
    (["--experts", "4", "--mode", "expert", "--cpus", "2", "--deterministic"], "--deterministic --mode expert: "),
    (["--experts", "4", "--mode", "sync", "--expert-parallel", "2"], "--expert-parallel applies only to --mode expert"),
    (["--experts", "4", "--mode", "expert", "--zero-stage", "1"], "--zero-stage applies only to"),
    (["--experts", "4", "--mode", "expert", "--stages", "2"], "--stages applies only to"),
    (["--experts", "4", "--mode", "expert", "--tensor-parallel", "2"], "--experts with tp > 1"),
    (["--experts", "4", "--mode", "expert", "--context-parallel", "2"], "--experts with cp > 1"),
    (["--experts", "4", "--mode", "expert", "--precision", "bf16"], "--precision applies only to"),
])
def test_what_expert_parallelism_does_not_take_is_refused_in_one_line(capsys, tmp_path, flags, message):
    code, out, err = run_main(capsys, argv_of(tmp_path, *flags))
    assert code == 2 and len(err) == 1 and message in err[0], err
    assert "epoch" not in out


def test_dropout_draws_the_masks_of_one_context():
    """Dropout's masks depend on the batch and the example (models/dropout.py), not on the context
    that computes a row: ep = 2 on 4 contexts trains as one context with dropout on."""
    from manual_dp.models.dropout import Noise, training_batch
    got = []
    for make in (lambda P, m: DataParallel(P, cpus(1), "momentum", lesson=True, model=m),
                 lambda P, m: ExpertParallel(P, cpus(4), "momentum", 2, model=m)):
        net = small().drop(Noise(0.3, seed=5))
        P = net.init_params(0)
        model, (X, y) = make(P, net), tokens(24)
        for i in range(2):
            with training_batch(net.noise, i):
                model.step(X, y, 0.05)
        got.append(model.state_dict()["params"])
    assert_trained_as(got[1], got[0], P, TOL)
    plain = ExpertParallel(P, cpus(2), "momentum", 2, model=small())
    for _ in range(2):
        plain.step(X, y, 0.05)
    assert max(float(np.abs(a - b).max()) for a, b in zip(plain.state_dict()["params"], got[0])) > 1e-3  # it dropped


PROBE = """
import json
import manual_dp
import mxnet as mx
from manual_dp import memory, models
from manual_dp.datasets import Spec
from manual_dp.models.moe import Experts
from manual_dp.strategies.expert.expert_parallel import ExpertParallel
spec = Spec((8,), 11, 11, task="next-token")
net = models.build("gpt", layers=1, d_model=16, heads=2, spec=spec, experts=Experts(4, 2, 1.0, 0.01))
ctx = [mx.cpu(i) for i in range(4)]
report = memory.measure(lambda: ExpertParallel(net.init_params(0), ctx, "momentum", 2, model=net), ctx, 32, spec=spec)
print(json.dumps({c: [r["activation_bytes"], r["method"]] for c, r in report.items()}))
"""


def test_every_context_computes_its_share():
    """As tests/test_placement.py: MXNet's profiler counts what each context allocates in a step;
    every context of dp 2 x ep 2 allocates at least a third of what the busiest one does (work for
    one context run on another would show as an idle context)."""
    import json
    import os
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", PROBE], env=dict(os.environ, MXNET_CPU_TEMP_COPY="1"),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(report) == 4 and {method for _, method in report.values()} == {"profiler"}, report
    busiest = max(b for b, _ in report.values())
    assert busiest > 0 and all(b >= busiest / 3 for b, _ in report.values()), report


def test_clipping_reads_the_whole_gradient(reference):
    """--clip-norm's global norm counts every expert once (reduced_grads joins the shards): clipped
    hard, dp 2 x ep 2 still trains as one context."""
    net, P, _ = reference
    want, _ = after(DataParallel(P, cpus(1), "momentum", lesson=True, model=net).clip(0.05))
    model = ExpertParallel(P, cpus(4), "momentum", 2, model=net).clip(0.05)
    got, _ = after(model)
    assert_trained_as(got, want, P, TOL)
    assert model.grad_norms()["grad_norm_max"] > 0.05                       # the clip did bite


def test_mesh_ep_lays_out_expert_parallelism(capsys, tmp_path):
    code, out, err = run_main(capsys, argv_of(tmp_path, "--experts", "4", "--cpus", "4", "--mesh", "dp=2,ep=2",
                                              "--dry-run"))
    assert code == 0, err
    assert "mode expert: the 4 experts of every MoE block sharded over 2 context(s) per group" in out
    assert "ep groups [cpu(0) cpu(1)] [cpu(2) cpu(3)]: all-to-alls" in out
    for mesh, message in (("ep=2,tp=2", "no mode lays out ep x tp"), ("ep=2,pp=2", "no mode lays out ep x pp"),
                          ("dp=1,ep=4", "--expert-parallel 4 does not divide --experts 6")):
        code, _, err = run_main(capsys, argv_of(tmp_path, "--experts", "6", "--cpus", "4", "--mesh", mesh, "--dry-run"))
        assert code == 2 and len(err) == 1 and message in err[0], err
