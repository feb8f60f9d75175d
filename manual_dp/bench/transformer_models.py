"""The models `python -m manual_dp.bench.transformer --model NAME` measures, one entry each of
MODELS (what the command reads: sizes, data, PyTorch peer, unit), and one measurement of either in
the child process the command starts (`measure`).

    transformer   the small vision transformer (models/transformer.py) on random images, 10
                  classes; throughput in images/s
    gpt           the GPT (models/gpt.py) on random windows of VOCAB byte tokens, the next token
                  at each position; throughput in tokens/s (windows/s x the window's tokens)
"""
import os
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..config import CORPUS_SEQ_LEN, GPT, MODEL_RUN_DEFAULTS, TRANSFORMER
from . import peer_torch

VOCAB = 256                   # the GPT's tokens: bytes, as --data fortunes's
CAUSAL_GROUPS = (2, 4)        # context-parallel group sizes whose causal attention work is reported


@dataclass(frozen=True)
class Subject:
    """One --model of the bench: `title` in the header, default `sizes` (layers, d_model, heads) and
    `batch`; `config` its constant keys of the JSON's config, `settings(args)` its own keys of the
    spec and the config; `net(spec)` the models.Model, `data(spec)` spec['images'] examples (X, y),
    `peer(params, spec)` the PyTorch module holding copies of the numpy `params`; `rate` the record's
    throughput key and `unit` its unit, `example` what an example is called; `notes(spec)` ({JSON key: value}, lines)
    of untimed facts about it."""
    title: str
    sizes: dict
    batch: int
    config: dict
    settings: Callable
    net: Callable
    data: Callable
    peer: Callable
    rate: str = "images_per_sec"
    unit: str = "img/s"
    example: str = "img"
    notes: Callable = lambda spec: ({}, [])


def vision_transformer(spec):
    from ..models import build
    return build("transformer", layers=spec["layers"], d_model=spec["d_model"], heads=spec["heads"], patch=0)


def gpt(spec):
    from ..datasets import Spec
    from ..models import build
    tokens = Spec((spec["seq_len"],), spec["vocab"], spec["vocab"], task="next-token")
    return build("gpt", layers=spec["layers"], d_model=spec["d_model"], heads=spec["heads"], spec=tokens)


def images(spec):
    from .worker import training_data
    return training_data(spec)


def token_windows(spec):
    """spec['images'] random windows of seq_len + 1 token ids below vocab: X the first seq_len (float32, as
    a corpus's), y the same shifted by one (int32): the next token at every position."""
    ids = np.random.RandomState(0).randint(0, spec["vocab"], size=(spec["images"], spec["seq_len"] + 1))
    return ids[:, :-1].astype(np.float32), ids[:, 1:].astype(np.int32)


def causal_work(spec):
    """({"causal_work": [...]}, lines): the score entries (per head and example) each rank of a causal
    context-parallel group of C in CAUSAL_GROUPS computes at the bench's seq_len, the sequence cut in C
    contiguous chunks or in the balanced cut's 2C (fast/causal_attention.py's work); no timing."""
    from ..fast.causal_attention import chunks_of, work
    T, rows, lines = spec["seq_len"], [], []
    for C in (c for c in CAUSAL_GROUPS if 2 * c <= T):
        row = {"contexts": C, "contiguous": work(chunks_of(T, C, False)), "balanced": work(chunks_of(T, C, True))}
        rows.append(row)
        lines.append(f"  causal attention work per rank at seq_len {T}, C={C}: " + "; ".join(
            f"{cut} {row[cut]} (max / mean {max(row[cut]) * C / sum(row[cut]):.2f})" for cut in ("contiguous", "balanced")))
    return {"causal_work": rows}, lines


MODELS = {
    "transformer": Subject("transformer", TRANSFORMER, 256, {"patch": 0}, lambda args: {}, vision_transformer, images,
                           lambda params, spec: peer_torch.torch_transformer(params, spec["layers"], spec["d_model"],
                                                                              spec["heads"])),
    "gpt": Subject("GPT", GPT, MODEL_RUN_DEFAULTS["gpt"]["batch_size"], {"model": "gpt"},
                   lambda args: {"seq_len": args.seq_len or CORPUS_SEQ_LEN, "vocab": VOCAB}, gpt, token_windows,
                   lambda params, spec: peer_torch.torch_gpt(params, spec["layers"], spec["d_model"], spec["heads"],
                                                             spec["seq_len"], spec["vocab"]),
                   rate="tokens_per_sec", unit="tok/s", example="window", notes=causal_work),
}


# --- one measurement, in a fresh child process -------------------------------------------------
def final_loss(net, params, X, y):
    """The mean loss (models.contract.example_loss) of `net` with host copies of `params` on (X, y), on cpu(0)."""
    from mxnet import nd
    from ..models.contract import example_loss
    W = [nd.array(p.asnumpy() if hasattr(p, "asnumpy") else p) for p in params]
    return float(example_loss(net.forward(nd.array(X), W), nd.array(y)).mean().asscalar())


def manual_passes(net, params, X, y, spec):
    """(wall, CPU) seconds of each of spec['repeats'] + 1 passes of manual_dp's step over (X, y)
    (fast, or the lesson's with spec['impl'] == 'lesson'), and the final parameters of cpu(0)."""
    import mxnet as mx
    from ..loop import run_epoch
    from ..strategies.data.data_parallel import DataParallel
    from .train import cpu_seconds
    ctx = [mx.cpu(i) for i in range(spec["devices"])]
    lesson = spec["impl"] == "lesson"
    model = DataParallel(params, ctx, "sgd", model=net, lesson=lesson, conv_pad=None if lesson else 1)
    times = []
    for _ in range(spec["repeats"] + 1):
        start = time.perf_counter(), cpu_seconds()
        run_epoch(model, X, y, spec["batch"], spec["lr"], rng=None)
        mx.nd.waitall()
        times.append((time.perf_counter() - start[0], cpu_seconds() - start[1]))
    return times, model.replicas[0]


def measure(spec):
    """The record of one measurement of spec['model'] (bench.worker.train_record, plus the FLOPs per
    example, the load average as it began and, for a rate in tokens, tokens/s), taken in this process."""
    from .worker import train_record
    subject = MODELS[spec["model"]]
    load = os.getloadavg()[0]
    X, y = subject.data(spec)
    net = subject.net(spec)
    params = net.init_params(spec["seed"])
    if spec["impl"] == "torch":
        host = [p.asnumpy() for p in params]
        times, final = peer_torch.transformer_single_process(host, X, y, spec, lambda p: subject.peer(p, spec))
    else:
        times, final = manual_passes(net, params, X, y, spec)
    record = train_record(spec, times, final_loss(net, final, X[:1024], y[:1024]))
    if subject.rate == "tokens_per_sec":
        record["tokens_per_sec"] = record["images_per_sec"] * y[0].size
    return dict(record, bench="transformer", flops_per_image=list(net.flops_per_example()), load_before=load)
