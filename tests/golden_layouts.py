"""The bits of every layout the trainer builds, as `python -m manual_dp.train` builds it: for each
configuration below, the SHA-256 of the parameters, the optimiser state and the losses after two steps
on one synthetic batch. Printed as one JSON object {name: digest}.

Run as a script (`python tests/golden_layouts.py [NAME...]`) so that the same configurations can be
computed by an older tree of the package (PYTHONPATH=that tree): tests/test_golden_layouts.py compares
this tree's digests with those recorded at the commit before the house plan (issue 36). It reads the
package only through the command line's own parse and build functions, which that commit has too.
One thread per op (set before MXNet loads): the float results of MXNet's kernels depend on it."""
import contextlib
import hashlib
import json
import os
import sys

os.environ.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MANUAL_DP_CONV_PAD="1")

TINY = ["--model", "transformer", "--layers", "2", "--d-model", "16", "--heads", "4"]
MLP = ["--model", "mlp"]

CONFIGS = {     # name: flags of python -m manual_dp.train (each on its --cpus)
    "sync": ["--cpus", "2"],
    "sync lesson": ["--cpus", "2", "--no-fuse-grads", "--no-graph", "--allreduce", "lesson"],
    "sync ring 3": ["--cpus", "3", "--allreduce", "ring"],
    "sync det": ["--cpus", "2", "--deterministic"],
    "sync 2bit": ["--cpus", "2", "--compress", "2bit"],
    "sync bf16": ["--cpus", "2", "--precision", "bf16"],
    "async": ["--cpus", "2", "--mode", "async", "--staleness", "1"],
    "local": ["--cpus", "2", "--mode", "local", "--sync-every", "2"],
    "zero1": ["--cpus", "2", "--mode", "zero", "--zero-stage", "1"],
    "zero3": ["--cpus", "2", "--mode", "zero", "--zero-stage", "3"],
    "zero3 det": ["--cpus", "2", "--mode", "zero", "--zero-stage", "3", "--deterministic"],
    "zero2 bf16": ["--cpus", "2", "--mode", "zero", "--zero-stage", "2", "--precision", "bf16"],
    "model": ["--cpus", "2", "--mode", "model"],
    "pipeline 1f1b": ["--cpus", "2", "--mode", "pipeline", "--micro-batches", "4", "--schedule", "1f1b"],
    "hybrid det": ["--cpus", "4", "--mode", "hybrid", "--micro-batches", "2", "--deterministic"],
    "tensor": ["--cpus", "2", "--mode", "tensor"],
    "tensor det": ["--cpus", "2", "--mode", "tensor", "--deterministic"],
    "mlp tensor x2": MLP + ["--cpus", "4", "--mode", "tensor", "--tensor-parallel", "2"],
    "grad-accum clip adam": ["--cpus", "2", "--grad-accum", "2", "--clip-norm", "1", "--optimizer", "adam"],
    "vit sync": TINY + ["--cpus", "2"],
    "vit sync det": TINY + ["--cpus", "2", "--deterministic"],
    "vit zero3 det": TINY + ["--cpus", "2", "--mode", "zero", "--zero-stage", "3", "--deterministic"],
    "vit tensor sp": TINY + ["--cpus", "2", "--mode", "tensor", "--sequence-parallel"],
    "vit tensor sp det": TINY + ["--cpus", "2", "--mode", "tensor", "--sequence-parallel", "--deterministic"],
    "vit context ring": TINY + ["--cpus", "2", "--mode", "context", "--attention", "ring"],
    "vit context ulysses": TINY + ["--cpus", "2", "--mode", "context", "--attention", "ulysses"],
    "vit context det": TINY + ["--cpus", "2", "--mode", "context", "--deterministic"],
    "vit context x tensor": TINY + ["--cpus", "4", "--mode", "context", "--tensor-parallel", "2"],
    "vit context x tensor det": TINY + ["--cpus", "4", "--mode", "context", "--tensor-parallel", "2", "--deterministic"],
    "vit mesh pp x tp": TINY + ["--cpus", "4", "--mesh", "pp=2,tp=2", "--micro-batches", "2"],
    "vit mesh pp x tp det": TINY + ["--cpus", "4", "--mesh", "pp=2,tp=2", "--micro-batches", "2", "--deterministic"],
    "vit mesh pp x cp det": TINY + ["--cpus", "4", "--mesh", "pp=2,cp=2", "--micro-batches", "2", "--deterministic"],
    "vit mesh dp x pp x tp zero1": TINY + ["--cpus", "8", "--mesh", "dp=2,pp=2,tp=2", "--zero-stage", "1"],
    "vit pipeline zb-h1 det": TINY + ["--cpus", "2", "--mode", "pipeline", "--micro-batches", "2", "--schedule",
                                      "zb-h1", "--deterministic"],
}


def digest(flags, steps=2, rows=200, lr=0.05):
    """The SHA-256 of the parameters, optimiser state and losses of the layout `flags` after `steps`
    steps on `rows` synthetic rows (4 pieces of --deterministic: 64, 64, 64, 8)."""
    import numpy as np
    from manual_dp.cli.build import build_model, contexts, network
    from manual_dp.cli.options import parse
    from manual_dp.multiprocess.world import World
    cfg = parse(flags + ["--seed", "0"])
    world, net = World(), network(cfg)
    model = build_model(cfg, net.init_params(cfg.seed, cfg.init_scale), contexts(cfg, world), world)
    rng = np.random.RandomState(0)
    X = rng.uniform(0, 1, size=(rows, 1, 28, 28)).astype(np.float32)
    y = (X[:, 0, :10, :].sum(axis=(1, 2)) * 7).astype(np.int32) % 10        # a label the pixels decide
    losses = []
    for _ in range(steps):
        metrics = model.step(X, y, lr)
        losses.append(float(metrics[0][0].asscalar()))
    state = model.state_dict()
    arrays = list(state["params"]) + [s for st in state["opt_state"] for s in st]
    return hashlib.sha256(b"".join(np.asarray(a).tobytes() for a in arrays) + repr(losses).encode()).hexdigest()


def main(names):
    with contextlib.redirect_stdout(sys.stderr):         # what the build prints is no part of the answer
        digests = {name: digest(CONFIGS[name]) for name in names or CONFIGS}
    print(json.dumps(digests, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
