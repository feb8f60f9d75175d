"""A user's own Gluon block, as `--model notebooks/user_block.py:net` takes it (notebook 09)."""
from mxnet.gluon import nn


def net():
    """Images (B, 1, 28, 28) -> 10 class scores: flatten, two hidden Dense layers, the output."""
    block = nn.HybridSequential()
    block.add(nn.Dense(128, activation="relu"), nn.Dense(64, activation="relu"), nn.Dense(10))
    return block
