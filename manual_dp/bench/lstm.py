"""`python -m manual_dp.bench.lstm`: seed 000's experiment on Debian's fortunes, side by side.

The same LSTM (models/lstm.py: its forward is Gluon's rnn.LSTM on the same weights), the same
initial parameters, the same batches in the same order, trained four ways with Adam:

    gluon      Gluon's own blocks (Embedding, rnn.LSTM, Dense) and gluon.Trainer on one context: the reference
    sync       `python -m manual_dp.train --mode sync` on --cpus contexts (the fast step)
    lesson     the lesson's step: each tower's gradient, summed on one context and averaged (--no-graph ...)
    async      `--mode async --staleness S`: stale replicas, the master applying each tower's gradient

Prints each one's test accuracy per epoch beside predicting the most common category, and writes
OUT/lstm.json with the machine and commit. The issue's target: sync within 1 point of gluon, and
15 points above the most common category. One run's last epoch moves by several points from epoch
to epoch, so `--seeds K` trains every way from K seeds' initial parameters and batch orders, and
prints the mean last-epoch accuracy of each and the mean gap to gluon with its standard error.
"""
import argparse
import json
import time
from pathlib import Path

import numpy as np

from ..fast.runtime import machine

RUNS = {"sync": [], "lesson": ["--no-fuse-grads", "--no-graph", "--allreduce", "lesson"],
        "async": ["--mode", "async", "--staleness", "1"]}


def gluon_run(data, P, args):
    """Test accuracy per epoch of the LSTM built from Gluon's blocks holding the parameters P,
    trained by gluon.Trainer with Adam on cpu(0), on the trainer's batches."""
    import mxnet as mx
    from mxnet import autograd, gluon, nd
    from ..datasets.contract import batches
    spec, D = data.spec, args.d_model
    embed, lstm, head = gluon.nn.Embedding(spec.vocab, D), gluon.rnn.LSTM(D, layout="NTC", input_size=D), \
        gluon.nn.Dense(spec.classes, in_units=D)
    for block in (embed, lstm, head):
        block.initialize(ctx=mx.cpu(0))
    embed.weight.set_data(P[0])
    table = lstm.collect_params()
    for j, kind in enumerate(("i2h_weight", "h2h_weight", "i2h_bias", "h2h_bias")):
        table[next(k for k in table.keys() if k.endswith(f"l0_{kind}"))].set_data(P[1 + j])
    head.weight.set_data(P[-2])
    head.bias.set_data(P[-1])
    params = gluon.ParameterDict()
    for block in (embed, lstm, head):
        params.update(block.collect_params())
    trainer = gluon.Trainer(params, "adam", {"learning_rate": args.lr})
    loss_fn, rng, accuracies = gluon.loss.SoftmaxCrossEntropyLoss(), np.random.default_rng(args.seed), []
    forward = lambda X: head(lstm(embed(X))[:, -1, :])                                  # noqa: E731
    (X, y), (Xt, yt) = data.train, data.test
    for _ in range(args.epochs):
        for Xb, yb in batches(X, y, args.batch_size, rng):
            with autograd.record():
                loss = loss_fn(forward(nd.array(Xb)), nd.array(yb))
            loss.backward()
            trainer.step(len(Xb))
        correct = sum(float((forward(nd.array(Xb)).argmax(axis=1) == nd.array(yb)).sum().asscalar())
                      for Xb, yb in batches(Xt, yt, 512))
        accuracies.append(correct / len(Xt))
    return accuracies


def trainer_run(name, args, out):
    """Test accuracy per epoch of `python -m manual_dp.train` in layout `name`."""
    from ..train import main
    log = Path(out) / f"lstm_{name}.jsonl"
    log.unlink(missing_ok=True)
    main(["--model", "lstm", "--data", args.data, "--d-model", str(args.d_model), "--cpus", str(args.cpus),
          "--epochs", str(args.epochs), "--batch-size", str(args.batch_size), "--optimizer", "adam",
          "--lr", str(args.lr), "--seed", str(args.seed), "--no-progress", "--log-json", str(log), *RUNS[name]])
    return [json.loads(line)["test_acc"] for line in log.read_text().splitlines()]


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m manual_dp.bench.lstm", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data", default="fortunes", help="--data of the trainer (fortunes or fortunes:DIR)")
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--cpus", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--lr", type=float, default=0.003)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", type=int, default=1, help="train each way from seeds SEED..SEED+K-1")
    p.add_argument("--runs", default="gluon,sync,lesson,async", help="which of gluon, sync, lesson, async")
    p.add_argument("--out", default="runs/bench")
    args = p.parse_args(argv)
    from ..config import RunConfig
    from .. import datasets, models
    data = datasets.load(RunConfig(data=args.data))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    majority = float(np.bincount(data.test[1]).max()) / len(data.test[1])
    started, by_seed = time.time(), []
    for seed in range(args.seed, args.seed + args.seeds):
        one = argparse.Namespace(**{**vars(args), "seed": seed})
        P = models.build("lstm", layers=1, d_model=args.d_model, spec=data.spec).init_params(seed)
        results = {}
        for name in args.runs.split(","):
            results[name] = gluon_run(data, P, one) if name == "gluon" else trainer_run(name, one, args.out)
            print(f"seed {seed} {name:7} test acc per epoch: {' '.join(f'{a:.3f}' for a in results[name])}", flush=True)
        by_seed.append(results)
    print(f"most common category: {majority:.3f}")
    for name in args.runs.split(","):
        last = np.array([r[name][-1] for r in by_seed])
        line = f"{name:7} last epoch, mean of {len(last)} seed(s): {last.mean():.3f}"
        if name != "gluon" and "gluon" in by_seed[0]:
            gaps = last - np.array([r["gluon"][-1] for r in by_seed])
            spread = f" +- {gaps.std(ddof=1) / np.sqrt(len(gaps)):.3f} (standard error)" if len(gaps) > 1 else ""
            line += f"; gap to gluon {gaps.mean():+.3f}{spread}"
        print(line)
    record = dict(bench="lstm", machine=machine(), args=vars(args), majority=majority, test_acc=by_seed[0], by_seed=by_seed,
                  seconds=time.time() - started, time=time.strftime("%Y-%m-%d %H:%M:%S"))
    (Path(args.out) / "lstm.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
