"""--ledger around any strategy of an MoE GPT (manual_dp.ledger): before each batch, the routing
its examples get from the parameters before the update; after the update, one line of it."""
from mxnet import nd

from ...ledger import record
from ...models.moe import routing
from ..base import Wrapper


def moe_layers(net):
    """[(index, layer)] of the model's MoE blocks."""
    return [(i, layer) for i, layer in enumerate(net.layers) if "experts" in layer.extra]


def route_batch(net, params, X):
    """[(layer name, expert, slot, kept)] of every MoE block for examples X with host `params`."""
    P, h, out = [nd.array(p) for p in params], nd.array(X), []
    last = moe_layers(net)[-1][0]
    for layer, s in zip(net.layers[:last + 1], net.slices()):
        if "experts" in layer.extra:
            out.append((layer.name,) + routing(h, P[s], layer.extra["head_dim"], layer.extra["experts"], net.tokens))
        h = layer.forward(h, P[s], nd, [p.shape for p in P[s]])
    return out


def header(net):
    cfg = moe_layers(net)[0][1].extra["experts"]
    return {"ledger": {"experts": cfg.experts, "top_k": cfg.top_k, "capacity": cfg.capacity(net.tokens),
                       "tokens": net.tokens, "layers": [layer.name for _, layer in moe_layers(net)]}}


class Ledgered(Wrapper):
    """`model` whose every update writes a line to `out` (a ledger.LedgerFile) with the routing of
    the batches it summed (one, or --grad-accum's several, in order)."""

    def __init__(self, model, out):
        super().__init__(model)
        self.out, self.routes = out, []

    def seen(self, X):
        self.routes.append(route_batch(self.model.net, self.model.state_dict()["params"], X))

    def after(self, t0):
        if self.model.t != t0 and self.routes:
            E = moe_layers(self.model.net)[0][1].extra["experts"].experts
            self.out.write(record(self.model.t, self.routes, E))
            self.routes = []

    def step(self, X, y, lr):
        t0 = self.model.t
        self.seen(X)
        metrics = self.model.step(X, y, lr)
        self.after(t0)
        return metrics

    def backward(self, X, y):
        self.seen(X)
        return self.model.backward(X, y)

    def update(self, lr, n_examples):
        t0 = self.model.t
        self.model.update(lr, n_examples)
        self.after(t0)
