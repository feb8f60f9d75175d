"""What a run of a language model (--model gpt) prints besides every run's lines: the share of the
machine's peak its step reaches (MFU) and a few lines of text sampled at the end."""
import os

from .. import flops
from ..fast.runtime import usable_cores
from ..sample import decode, encode, generate, PROMPT

SAMPLE = dict(tokens=200, temperature=0.8, top_k=20, seed=0)    # the text printed at the end of a run
PEAK = dict(n=1024, repeats=3)                                   # the GEMM that measures the peak


def is_language_model(net):
    return net.spec.task == "next-token"


def gemm_peak():
    """This machine's float32 GEMM peak in GFLOP/s: the best of MXNet's two kernels (flops.gemm_peak)
    on this process's threads per operator (OMP_NUM_THREADS: one context's share of the cores),
    times the cores they share out (as the benchmark's "one thread x cores" peak)."""
    threads = max(int(os.environ.get("OMP_NUM_THREADS") or 1), 1)
    return max(flops.gemm_peak(**PEAK).values()) * max(usable_cores() // threads, 1)


def with_mfu(record, net, peak_gflops):
    """record with "mfu": the model's forward and backward FLOPs per example times the examples
    a second, over the GEMM peak (every context shares this machine's cores)."""
    return dict(record, mfu=record["images_per_sec"] * net.flops_per_example()[1] / (peak_gflops * 1e9))


def sample_text(net, params, ctx):
    """PROMPT and SAMPLE's tokens after it (or, where the text has no new line, its first character) from the
    trained parameters (numpy arrays, copied to ctx), as text; None for a model whose tokens have no
    text (npz:PATH)."""
    from mxnet import nd
    if not net.spec.text:
        return None
    prompt = PROMPT if PROMPT in net.spec.names or net.spec.text == "bytes" else net.spec.names[0]
    ids = generate(net, [nd.array(p, ctx=ctx) for p in params], encode(prompt, net.spec), SAMPLE["tokens"], SAMPLE["temperature"],
                   SAMPLE["top_k"], SAMPLE["seed"])
    return prompt + decode(ids, net.spec)
