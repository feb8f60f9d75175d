"""The same LeNet, start and SGD updates in PyTorch (optional: `pip install -e .[bench]`), for the
benchmark's comparison: one process using every core, or DistributedDataParallel over k processes;
and the same small vision transformer (manual_dp.models.transformer) and GPT (manual_dp.models.gpt)
for bench.transformer and bench.gpt_reference."""
import functools
import os
import time

import numpy as np


def torch_lenet(params):
    """nn.Sequential LeNet holding copies of our 8 numpy parameters (dense weights transposed)."""
    import torch
    from torch import nn
    net = nn.Sequential(nn.Conv2d(1, 20, 3), nn.ReLU(), nn.AvgPool2d(2, 2),
                        nn.Conv2d(20, 50, 5), nn.ReLU(), nn.AvgPool2d(2, 2),
                        nn.Flatten(), nn.Linear(800, 128), nn.ReLU(), nn.Linear(128, 10))
    layers = [net[0], net[3], net[7], net[9]]
    with torch.no_grad():
        for i, (layer, W, b) in enumerate(zip(layers, params[0::2], params[1::2])):
            layer.weight.copy_(torch.from_numpy(np.ascontiguousarray(W.T if i >= 2 else W)))
            layer.bias.copy_(torch.from_numpy(b))
    return net, layers


def final_params(layers):
    out = []
    for i, layer in enumerate(layers):
        W = layer.weight.detach().numpy()
        out += [W.T if i >= 2 else W, layer.bias.detach().numpy()]
    return out


def train_passes(net, X, y, batch, lr, passes, rank=0, world=1):
    """(wall, CPU) seconds of each pass of SGD over (X, y); under DDP rank r takes its slice of
    every batch (and the CPU time is rank r's alone)."""
    import torch
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    Xt, yt = torch.from_numpy(X), torch.from_numpy(y.astype(np.int64))
    times = []
    for _ in range(passes):
        start = time.perf_counter(), os.times()
        for s in range(0, len(X), batch):
            n = min(batch, len(X) - s)
            lo, hi = s + rank * n // world, s + (rank + 1) * n // world
            opt.zero_grad(set_to_none=True)
            mean_loss(net(Xt[lo:hi]), yt[lo:hi]).backward()
            opt.step()
        end = os.times()
        times.append((time.perf_counter() - start[0], end.user + end.system - start[1].user - start[1].system))
    return times


def mean_loss(scores, y):
    """The mean cross-entropy of every score vector: of each example's classes (B, classes) against
    labels (B,), or of each position's tokens (B, T, vocab) against tokens (B, T), the mean over
    tokens then (the mean of the examples' means over their T positions, models.contract.example_loss)."""
    from torch.nn import functional as F
    return F.cross_entropy(scores.reshape(-1, scores.shape[-1]), y.reshape(-1))


def single_process(params, X, y, spec):
    """(pass times, final params) of one process with torch.set_num_threads(spec['threads'])."""
    import torch
    torch.set_num_threads(spec["threads"])
    net, layers = torch_lenet(params)
    return train_passes(net, X, y, spec["batch"], spec["lr"], spec["repeats"] + 1), final_params(layers)


def _ddp_worker(rank, world, params, X, y, spec, port, out):
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, spec["threads"] // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    net, layers = torch_lenet(params)
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    # DDP averages gradients over ranks: with equal slices that is the full batch's mean gradient.
    times = train_passes(ddp, X, y, spec["batch"], spec["lr"], spec["repeats"] + 1, rank, world)
    if rank == 0:
        out.put((times, final_params(layers)))
    dist.destroy_process_group()


def ddp(params, X, y, spec):
    """(pass times of rank 0, final params) of DistributedDataParallel over spec['devices'] processes."""
    import socket
    import torch.multiprocessing as tmp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = tmp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_ddp_worker, args=(r, spec["devices"], params, X, y, spec, port, out))
             for r in range(spec["devices"])]
    for p in procs:
        p.start()
    result = out.get(timeout=spec.get("timeout", 300))
    for p in procs:
        p.join(timeout=30)
    return result


# --- the transformers: the vision transformer (models/transformer.py) and the GPT (models/gpt.py) ---
@functools.lru_cache(maxsize=1)
def block_class():
    """nn.Module class of our pre-norm block: Block(d_model, heads, hidden, causal)."""
    from torch import nn
    from torch.nn import functional as F

    class Block(nn.Module):
        """x + Wo attn(LN(x)), then x + W2 relu(W1 LN(x)); q, k, v, o separate Linear(d, d);
        causal: token t attends to tokens 0..t."""

        def __init__(self, d_model, heads, hidden, causal=False):
            super().__init__()
            self.heads, self.causal = heads, causal
            self.ln1, self.ln2 = nn.LayerNorm(d_model, eps=1e-5), nn.LayerNorm(d_model, eps=1e-5)
            self.q, self.k, self.v, self.o = (nn.Linear(d_model, d_model) for _ in range(4))
            self.fc1, self.fc2 = nn.Linear(d_model, hidden), nn.Linear(hidden, d_model)

        def ordered(self):
            return [t for m in (self.ln1, self.q, self.k, self.v, self.o, self.ln2, self.fc1, self.fc2)
                    for t in (m.weight, m.bias)]

        def forward(self, x):
            B, T, d = x.shape
            a = self.ln1(x)
            q, k, v = (f(a).view(B, T, self.heads, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
            h = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)       # (B, heads, T, dh)
            x = x + self.o(h.transpose(1, 2).reshape(B, T, d))
            return x + self.fc2(F.relu(self.fc1(self.ln2(x))))
    return Block


def holding(net, params):
    """`net` with copies of our numpy `params` in its tensors (net.ordered(): our flat order; weights
    (out, in) as nn.Linear's, so copied as they are); ValueError if they do not fit."""
    import torch
    tensors = net.ordered()
    if len(tensors) != len(params) or any(tuple(t.shape) != tuple(p.shape) for t, p in zip(tensors, params)):
        raise ValueError(f"the parameters do not fit this {type(net).__name__}'s sizes")
    with torch.no_grad():
        for t, p in zip(tensors, params):
            t.copy_(torch.from_numpy(np.ascontiguousarray(p, dtype=np.float32)))
    return net


def torch_transformer(params, layers, d_model, heads, mlp_ratio=2, patch=0):
    """nn.Module of the same pre-norm vision transformer, holding copies of our numpy `params`
    (flat order of models.build("transformer", ...)); its ordered() lists its tensors in that order."""
    import torch
    from torch import nn
    Block = block_class()

    class VisionTransformer(nn.Module):
        """Tokens (rows, or patch x patch patches) -> Linear + positions -> blocks -> LN, mean, Linear."""

        def __init__(self):
            super().__init__()
            side = 28 // patch if patch else 28
            T, size = (side * side, patch * patch) if patch else (28, 28)
            self.embed = nn.Linear(size, d_model)
            self.pos = nn.Parameter(torch.zeros(T, d_model))
            self.blocks = nn.ModuleList(Block(d_model, heads, mlp_ratio * d_model) for _ in range(layers))
            self.lnf, self.head = nn.LayerNorm(d_model, eps=1e-5), nn.Linear(d_model, 10)

        def ordered(self):
            return ([self.embed.weight, self.embed.bias, self.pos] + [t for b in self.blocks for t in b.ordered()]
                    + [self.lnf.weight, self.lnf.bias, self.head.weight, self.head.bias])

        def tokens(self, X):
            if not patch:
                return X.reshape(-1, 28, 28)
            n = 28 // patch
            h = X.reshape(-1, n, patch, n, patch).permute(0, 1, 3, 2, 4)
            return h.reshape(-1, n * n, patch * patch)

        def forward(self, X):
            h = self.embed(self.tokens(X)) + self.pos
            for block in self.blocks:
                h = block(h)
            return self.head(self.lnf(h).mean(dim=1))
    return holding(VisionTransformer(), params)


def torch_gpt(params, layers, d_model, heads, seq_len, vocab, mlp_ratio=4):
    """nn.Module of the same GPT (nanoGPT's shape, a head of its own), holding copies of our numpy
    `params` (flat order of models.build("gpt", ...)): token ids (B, T), as floats or ints, to
    scores (B, T, vocab)."""
    import torch
    from torch import nn
    Block = block_class()

    class GPT(nn.Module):
        """wte[token] + wpe[position] -> causal blocks -> LN -> Linear(d, vocab)."""

        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, d_model), nn.Parameter(torch.zeros(seq_len, d_model))
            self.blocks = nn.ModuleList(Block(d_model, heads, mlp_ratio * d_model, causal=True) for _ in range(layers))
            self.lnf, self.head = nn.LayerNorm(d_model, eps=1e-5), nn.Linear(d_model, vocab)

        def ordered(self):
            return ([self.wte.weight, self.wpe] + [t for b in self.blocks for t in b.ordered()]
                    + [self.lnf.weight, self.lnf.bias, self.head.weight, self.head.bias])

        def forward(self, X):
            h = self.wte(X.long()) + self.wpe[:X.shape[1]]                              # (B, T, d)
            for block in self.blocks:
                h = block(h)
            return self.head(self.lnf(h))                                               # (B, T, vocab)
    return holding(GPT(), params)


def transformer_params(net):
    """numpy copies of a torch_transformer's or torch_gpt's tensors, in our flat order."""
    return [t.detach().numpy().copy() for t in net.ordered()]


def transformer_single_process(params, X, y, spec, make):
    """(pass times, final params in our order) of SGD on make(params) (a torch_transformer or
    torch_gpt) in one process with torch.set_num_threads(spec['threads']): spec['repeats'] + 1
    passes over (X, y)."""
    import torch
    torch.set_num_threads(spec["threads"])
    net = make(params)
    return train_passes(net, X, y, spec["batch"], spec["lr"], spec["repeats"] + 1), transformer_params(net)
