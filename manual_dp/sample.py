"""Text from a trained language model (--model gpt), as nanoGPT's sample.py makes it:

    python -m manual_dp.sample CHECKPOINT_DIR --prompt TEXT --tokens N [--temperature T] [--top-k K] [--seed S]

The checkpoint names the model's sizes and the text of its tokens (models/gpt.py's describe). Each
new token is drawn from the softmax of the last position's scores divided by the temperature, kept
to the top K; the window the model reads is the last seq_len tokens. A shorter text is padded on
the right: the attention is causal, so a position's scores never read the padding after it. The
same seed gives the same text.
"""
import sys

import numpy as np

from .cli.options import OneLineParser
from .cli.output import fail
from .errors import CheckpointError, UsageError

PROMPT = "\n"               # what the text starts from when no --prompt is given


def encode(text, spec):
    """The token ids of `text` in the corpus's vocabulary; UsageError for a character it lacks."""
    if spec.text == "bytes":
        return list(text.encode("utf-8"))
    index = {c: i for i, c in enumerate(spec.names)}
    missing = sorted({c for c in text if c not in index})
    if missing:
        raise UsageError(f"--prompt: {''.join(missing)!r} are not among the model's {len(index)} characters")
    return [index[c] for c in text]


def decode(ids, spec):
    """The text of token ids (bytes that are not UTF-8 shown as U+FFFD)."""
    if spec.text == "bytes":
        return bytes(ids).decode("utf-8", errors="replace")
    return "".join(spec.names[i] for i in ids)


def next_token(scores, temperature, top_k, rng):
    """One id drawn from scores (vocab,): softmax(scores / temperature) over the top_k best."""
    scores = scores.astype(np.float64) / temperature
    if top_k and top_k < len(scores):
        scores = np.where(scores < np.sort(scores)[-top_k], -np.inf, scores)
    p = np.exp(scores - scores.max())
    return int(rng.choice(len(p), p=p / p.sum()))


def generate(net, params, ids, n, temperature=1.0, top_k=None, seed=0):
    """n token ids that follow `ids` (a list, at least one), from the GPT `net` with `params` (on
    one context), drawn with numpy's generator of `seed`."""
    from mxnet import nd
    rng, T, ctx, out = np.random.default_rng(seed), net.tokens, params[0].context, list(ids)
    for _ in range(n):
        window = out[-T:]
        X = np.zeros((1, T), np.float32)
        X[0, :len(window)] = window
        scores = net.forward(nd.array(X, ctx=ctx), params)[0, len(window) - 1].asnumpy()   # (vocab,)
        out.append(next_token(scores, temperature, top_k, rng))
    return out[len(ids):]


def from_checkpoint(directory):
    """(the GPT a checkpoint holds, its parameters on cpu(0)); CheckpointError if it holds another model."""
    import mxnet as mx
    from mxnet import nd
    from . import checkpoint
    from .datasets import Spec
    from .models.gpt import GPT
    from .models.moe import Experts
    state, meta = checkpoint.load(directory)
    model = meta.get("model", {})
    tokens, config = model.get("tokens"), model.get("config", {})
    if model.get("name") != "gpt" or not isinstance(tokens, dict):
        raise CheckpointError(f"{directory}: holds {model.get('name', 'lenet')}, not a GPT trained on a text corpus")
    try:
        spec = Spec((config["seq_len"],), config["vocab"], config["vocab"], "next-token", tuple(tokens["names"]),
                    tokens["text"])
        moe = Experts(config["experts"], config["top_k"], config["capacity_factor"], config["aux_loss_coef"]) \
            if config.get("experts") else None
        net = GPT(config["layers"], config["d_model"], config["heads"], spec, moe)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{directory}: its model description is damaged ({e})") from None
    return net, [nd.array(p, ctx=mx.cpu(0)) for p in state["params"]]


def parse(argv=None):
    p = OneLineParser(prog="python -m manual_dp.sample", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint_dir", help="a --checkpoint-dir of a --model gpt run")
    p.add_argument("--prompt", default=PROMPT, help="the text to continue (default: a new line)")
    p.add_argument("--tokens", type=int, default=200, help="how many tokens to add (default 200)")
    p.add_argument("--temperature", type=float, default=0.8, help="scores divided by T before the softmax (default 0.8)")
    p.add_argument("--top-k", type=int, default=None, help="draw among the K likeliest tokens only (default all)")
    p.add_argument("--seed", type=int, default=0, help="seeds the draws (default 0)")
    args = p.parse_args(argv)
    if args.tokens < 1 or not args.temperature > 0 or (args.top_k is not None and args.top_k < 1):
        raise UsageError("--tokens and --top-k must be at least 1 and --temperature above 0")
    if not args.prompt:
        raise UsageError("--prompt: give at least one character to continue")
    return args


def main(argv=None):
    try:
        args = parse(argv)
        net, params = from_checkpoint(args.checkpoint_dir)
        ids = encode(args.prompt, net.spec)
        text = decode(generate(net, params, ids, args.tokens, args.temperature, args.top_k, args.seed), net.spec)
    except UsageError as e:
        sys.exit(fail(e, 2, "manual_dp.sample"))
    except CheckpointError as e:
        sys.exit(fail(e, 1, "manual_dp.sample"))
    print(args.prompt + text)


if __name__ == "__main__":
    main()
