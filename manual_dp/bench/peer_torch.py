"""The same LeNet, start and SGD updates in PyTorch (optional: `pip install -e .[bench]`), for the
benchmark's comparison: one process using every core, or DistributedDataParallel over k processes."""
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
    loss_fn = torch.nn.CrossEntropyLoss()
    Xt, yt = torch.from_numpy(X), torch.from_numpy(y.astype(np.int64))
    times = []
    for _ in range(passes):
        start = time.perf_counter(), os.times()
        for s in range(0, len(X), batch):
            n = min(batch, len(X) - s)
            lo, hi = s + rank * n // world, s + (rank + 1) * n // world
            opt.zero_grad(set_to_none=True)
            loss_fn(net(Xt[lo:hi]), yt[lo:hi]).backward()
            opt.step()
        end = os.times()
        times.append((time.perf_counter() - start[0], end.user + end.system - start[1].user - start[1].system))
    return times


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
