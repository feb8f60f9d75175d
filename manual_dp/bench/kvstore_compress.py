"""The reference for --compress 2bit's accuracy: the same training run through MXNet's own
gradient compression, gluon.Trainer over kvstore('device') with
set_gradient_compression({'type': '2bit', 'threshold': T}).

The same LeNet (gluon layers holding init_lenet_params(seed)), the same batches in the same order
(manual_dp.datasets.contract.batches with numpy's generator seeded by --seed, as `python -m manual_dp.train`),
SGD with momentum 0.9 (MXNet's form, mom = 0.9 mom - lr g; w += mom, is the project's v = 0.9 v + g;
w -= lr v), one JSON line per epoch. If manual_dp's 2bit and this run end at the same accuracy, a
gap to the uncompressed run belongs to the 2bit scheme, not to this project's code of it.

    python -m manual_dp.bench.kvstore_compress --cpus 2 --epochs 10 --threshold 0.5
"""
import json
import time

from ..cli.options import OneLineParser, positive
from ..cli.output import ends_on_signals, parsed_or_exit
from ..config import RunConfig


def train(ctx, epochs, threshold, lr, batch_size, seed, data):
    """Yields {"epoch", "test_acc", "train_loss", "images_per_sec"} per epoch of gluon.Trainer with
    2bit compression (threshold None: none)."""
    import numpy as np
    from mxnet import autograd, gluon, nd
    from ..datasets.contract import batches
    from ..lesson import init_lenet_params, n_correct
    from .train import gluon_lenet_holding

    (X, y), (Xt, yt) = data
    net, _ = gluon_lenet_holding(init_lenet_params(seed), ctx)
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": lr, "momentum": 0.9},
                            kvstore="device", update_on_kvstore=False,
                            compression_params=None if threshold is None else
                            {"type": "2bit", "threshold": threshold})
    loss = gluon.loss.SoftmaxCrossEntropyLoss()
    rng = np.random.default_rng(seed)
    for epoch in range(1, epochs + 1):
        total, seen, start = 0.0, 0, time.perf_counter()
        for Xb, yb in batches(X, y, batch_size, rng):
            Xs = gluon.utils.split_and_load(nd.array(Xb), ctx)
            ys = gluon.utils.split_and_load(nd.array(yb), ctx)
            with autograd.record():
                ls = [loss(net(a), b) for a, b in zip(Xs, ys)]
            autograd.backward(ls)
            trainer.step(len(Xb))
            total = total + nd.add_n(*[l.sum().as_in_context(ctx[0]) for l in ls])  # read once an epoch
            seen += len(Xb)
        total = float(total.asscalar())
        seconds = time.perf_counter() - start
        correct = sum(float(n_correct(net(nd.array(Xb, ctx=ctx[0])), nd.array(yb, ctx=ctx[0])).asscalar())
                      for Xb, yb in batches(Xt, yt, batch_size))
        yield {"epoch": epoch, "test_acc": correct / len(Xt), "train_loss": total / seen,
               "images_per_sec": seen / seconds}


@ends_on_signals("python -m manual_dp.bench.kvstore_compress")   # Ctrl-C, SIGTERM, SIGHUP: one line
def main(argv=None):
    d = RunConfig()
    prog = "python -m manual_dp.bench.kvstore_compress"
    p = OneLineParser(prog=prog, description=__doc__.split("\n")[0])
    p.add_argument("--cpus", type=positive, default=2)
    p.add_argument("--epochs", type=positive, default=d.epochs)
    p.add_argument("--threshold", type=float, default=0.5, help="2bit's T (MXNet's default 0.5)")
    p.add_argument("--uncompressed", action="store_true", help="the same run without compression")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--batch-size", type=positive, default=d.batch_size)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--train-size", type=positive)
    p.add_argument("--test-size", type=positive)
    p.add_argument("--data-dir")
    p.add_argument("--log-json", help="also write the records here, one JSON object per line")
    args = parsed_or_exit(p.parse_args, argv, prog)
    import mxnet as mx
    from ..datasets.fashion_mnist import load_fashion_mnist
    data = load_fashion_mnist(args.data_dir, args.train_size, args.test_size)
    ctx = [mx.cpu(i) for i in range(args.cpus)]
    out = open(args.log_json, "w") if args.log_json else None
    for record in train(ctx, args.epochs, None if args.uncompressed else args.threshold, args.lr, args.batch_size, args.seed, data):
        print(json.dumps(record), flush=True)
        if out:
            out.write(json.dumps(record) + "\n")
            out.flush()


if __name__ == "__main__":
    main()
