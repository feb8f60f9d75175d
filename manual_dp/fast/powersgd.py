"""PowerSGD (Vogels et al., 2019): each weight gradient sent as two thin matrices, summed by any
all-reduce, with error feedback.

Each weight's gradient plus its replica's residual is a matrix M (rows: outputs; columns: the
rest), m x n. With Q (n x R) shared by every replica and kept from the last step (warm start):

    P_i = M_i Q             summed over every replica:   P = sum_i P_i        (m x R)
    P^  = P orthonormalised (Gram-Schmidt, the same on every replica)
    Q_i = M_i^T P^          summed over every replica:   Q = sum_i Q_i        (n x R)
    gradient = P^ Q^T;      residual_i = M_i - P^ Q_i^T;  Q kept for the next step

P and Q are linear in M, so unlike the quantisers (manual_dp.fast.compress) they are all-reduced,
with the run's own all-reduce, across processes too. A weight for which R(m + n) >= mn, and every
bias, is sent whole in the second all-reduce (its residual stays 0).
"""
import numpy as np
from mxnet import nd

from .flat import offsets, views


def matrix(shape):
    """(m, n): a parameter of `shape` as a matrix, outputs by everything else."""
    return shape[0], int(np.prod(shape[1:]))


def orthonormal(P, eps=1e-8):
    """The columns of P (m x R) made orthonormal by Gram-Schmidt, a new array."""
    cols = []
    for r in range(P.shape[1]):
        v = P[:, r]
        for u in cols:
            v = v - nd.broadcast_mul(u, nd.sum(u * v).reshape((1,)))
        cols.append(nd.broadcast_div(v, (nd.norm(v) + eps).reshape((1,))))
    return nd.stack(*cols, axis=1)


class PowerSGDAllreduce:
    """An all-reduce with the lesson's contract for flat gradients laid out as `shapes`
    (manual_dp.fast.flat): rank-`rank` PowerSGD with error feedback, its two sums done by
    `allreduce_fn` (across processes too if it does). `seed` draws the first Q."""
    name = "powersgd"

    def __init__(self, rank, shapes, allreduce_fn, seed=0):
        self.rank, self.shapes, self.allreduce_fn = rank, [tuple(s) for s in shapes], allreduce_fn
        self.low = [i for i, s in enumerate(self.shapes) if len(s) >= 2 and
                    rank * sum(matrix(s)) < np.prod(matrix(s))]          # compressed weights
        self.whole = [i for i in range(len(self.shapes)) if i not in self.low]
        rng = np.random.default_rng(seed)
        self.q0 = [rng.standard_normal((matrix(self.shapes[i])[1], rank)).astype(np.float32)
                   for i in self.low]
        self.residuals, self.Q = [], []

    def prepare(self, arrays):
        """A zero residual and the first Q for every replica, on the replica's context."""
        self.n = offsets(self.shapes)[-1]
        if arrays[0].size != self.n:
            raise ValueError(f"powersgd is laid out for {self.n} gradients, got {arrays[0].size}")
        self.residuals = [nd.zeros((self.n,), ctx=a.context) for a in arrays]
        self.Q = [[nd.array(q, ctx=a.context) for q in self.q0] for a in arrays]

    def bytes_per_replica(self):
        """Bytes one replica sends per all-reduce: its P, its Q, its whole parameters (float32)."""
        low = sum(self.rank * sum(matrix(self.shapes[i])) for i in self.low)
        return 4 * (low + sum(int(np.prod(self.shapes[i])) for i in self.whole))

    def __call__(self, arrays):
        """Afterwards every arrays[i] holds sum_j P^ Q^T per compressed weight, the exact sum elsewhere."""
        if not self.residuals:
            self.prepare(arrays)
        M = []
        for g, r in zip(arrays, self.residuals):
            r += g.reshape((-1,))
            M.append([v.reshape(matrix(s)) if j in self.low else v
                      for j, (v, s) in enumerate(zip(views(r, self.shapes), self.shapes))])
        P_hat = self.sum_p(M)
        Q_local = [[nd.dot(m[i], p, transpose_a=True) for i, p in zip(self.low, ph)]
                   for m, ph in zip(M, P_hat)]
        send = [nd.concat(*[q.reshape((-1,)) for q in ql], *[m[i].reshape((-1,)) for i in self.whole],
                          dim=0) for m, ql in zip(M, Q_local)]
        for m, ph, ql in zip(M, P_hat, Q_local):                 # error feedback
            for i, p, q in zip(self.low, ph, ql):
                m[i][:] = m[i] - nd.dot(p, q, transpose_b=True)
            for i in self.whole:
                m[i][:] = 0
        self.allreduce_fn(send)
        for a, s, ph, Q in zip(arrays, send, P_hat, self.Q):
            self.unpack(a, s, ph, Q)

    def sum_p(self, M):
        """Per replica, the orthonormalised sum of every replica's P = M Q, per compressed weight."""
        if not self.low:                                          # R too large: nothing compressed
            return [[] for _ in M]
        P = [nd.concat(*[nd.dot(m[i], q).reshape((-1,)) for i, q in zip(self.low, Q)], dim=0)
             for m, Q in zip(M, self.Q)]
        self.allreduce_fn(P)
        return [self.split_p(p) for p in P]

    def split_p(self, p):
        """The summed P of each compressed weight, orthonormalised."""
        o = offsets([(matrix(self.shapes[i])[0], self.rank) for i in self.low])
        return [orthonormal(p[o[j]:o[j + 1]].reshape((-1, self.rank))) for j in range(len(self.low))]

    def unpack(self, grad, summed, p_hat, Q):
        """`grad` (flat) := P^ Q^T per compressed weight and the summed whole ones; Q := the summed Q."""
        sizes = [(matrix(self.shapes[i])[1], self.rank) for i in self.low] + \
                [self.shapes[i] for i in self.whole]
        parts = views(summed, sizes)
        g = views(grad.reshape((-1,)), self.shapes)
        for j, i in enumerate(self.low):
            g[i][:] = nd.dot(p_hat[j], parts[j], transpose_b=True).reshape(self.shapes[i])
            Q[j][:] = parts[j]
        for j, i in enumerate(self.whole):
            g[i][:] = parts[len(self.low) + j]

    def state(self):
        """{"residual": [host copy per replica], "powersgd_q": [Q of every compressed weight]}."""
        return {"residual": [r.asnumpy() for r in self.residuals],
                "powersgd_q": [q.asnumpy() for q in self.Q[0]]}

    def load(self, state):
        """Residuals (this process's replicas) and Q from `state` (Q kept if it holds none)."""
        for r, value in zip(self.residuals, state["residual"]):
            r[:] = nd.array(value, ctx=r.context)
        for Q in self.Q:
            for q, value in zip(Q, state.get("powersgd_q") or []):
                q[:] = nd.array(value, ctx=q.context)
