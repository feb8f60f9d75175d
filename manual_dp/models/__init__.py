"""The models every strategy can train, each described by the contract in models/contract.py:
`build(name, ...)` makes one from the command line's sizes; `as_model` gives the strategies the
model they were handed (or, when none was, the lesson's LeNet of the parameters' width).

    contract.py     the model contract: how a network describes itself to the parallel code
    lenet.py        the lesson's LeNet under the contract: the lesson's own forward functions
    mlp.py          a multilayer perceptron: the image flattened, dense layers with ReLU
    transformer.py  a small vision transformer for Fashion-MNIST, written with MXNet operators
    lstm.py         seed 000's text classifier: an embedding, an LSTM read to its last step, the classes
    gpt.py          a causal language model in nanoGPT's shape: the next token at every position
    moe.py          its MLP as a mixture of experts, routed per window (GShard's dispatch and combine)
    batchnorm.py    batch normalisation by hand: the statistics a forward uses, the running ones it leaves
    resnet.py       d2l's ResNet-18 with BatchNorm, channels scaled to train on CPU contexts
    dropout.py      dropout whose masks no layout changes: drawn per (batch, example), never per context
    gluon_block.py  the user's own Gluon block under the contract (--model PATH.py:FUNCTION)
    precise.py      a model in a precision: the same layers, their products in bf16 or fp16
    room.py         whether a run of a model fits in this machine's memory, from its sizes alone
"""
from ..config import MODELS          # or PATH.py:FUNCTION, the user's own Gluon block
from .contract import Model


def build(name="lenet", width=1, layers=None, d_model=None, heads=None, patch=None, seed=0, spec=None, room=None,
          experts=None):
    """The model `name` of these sizes reading examples of `spec` (a datasets.Spec; default
    Fashion-MNIST's images); a "PATH.py:FUNCTION" name loads the user's block (models.gluon_block).
    ValueError (one line) for sizes or data it cannot take, or, given a models.room.Room, for a run
    that would not fit in it (checked before the transformer makes its blocks and before a user's
    block allocates its parameters). `experts`: a models.moe.Experts, the GPT's MLPs a mixture of experts."""
    net = made(name, width, layers, d_model, heads, patch, seed, spec, room, experts)
    if room is not None:
        room.check(net.n_params(), net.layers[0].inputs + sum(layer.acts for layer in net.layers))
    return net


def made(name, width, layers, d_model, heads, patch, seed, spec, room, experts=None):
    """build's model, made (the transformer and a user's block check `room` as they are made)."""
    from ..datasets import IMAGES
    spec = spec or IMAGES
    if name == "mlp":
        from .mlp import MLP
        return MLP(width, spec)
    if name == "lstm":
        from .lstm import LSTM
        return LSTM(layers, d_model, spec)
    if name == "gpt" or spec.task == "next-token":
        if name != "gpt":
            raise ValueError("predicts one class an example; the data holds the next token at every position "
                             "(--model gpt)")
        from .gpt import GPT
        return GPT(layers, d_model, heads, spec, experts)
    if name not in MODELS:                              # the user's block: it reads what the data holds
        from .gluon_block import GluonModel
        return GluonModel(name, seed, room, spec)
    if spec != IMAGES and (spec.shape, spec.classes, spec.tokens) != (IMAGES.shape, IMAGES.classes, False):
        raise ValueError(f"reads 28x28 images of 10 classes, (1, 28, 28) values; the data holds {spec.describe()}"
                         f" (--model mlp reads any values, --model lstm token sequences)")
    if name == "lenet":
        from .lenet import LeNet
        return LeNet(width)
    if name == "resnet":
        from .resnet import ResNet
        return ResNet(width)
    from .transformer import Transformer
    return Transformer(layers, d_model, heads, patch=patch, room=room)


def as_model(model, params=None):
    """`model`, or when it is None the lesson's LeNet whose width fits `params` (arrays or their
    shapes: a strategy built the way it was before models existed)."""
    if model is not None:
        return model
    from .lenet import LeNet
    first = getattr(params[0], "shape", params[0]) if params else (20,)
    return LeNet(max(first[0] // 20, 1))


def stateless(model, what):
    """`model`, or ValueError (one line) if it keeps running statistics, which `what` (a strategy)
    does not carry yet."""
    if model.stats():
        raise ValueError(f"{what} does not carry running statistics (BatchNorm) yet: --model {model.name} "
                         f"trains with --mode sync")
    return model


__all__ = ["MODELS", "Model", "build", "as_model", "stateless"]
