"""Context parallelism: the sequence of tokens cut over the contexts of a group.

    context.py          ContextParallel: ring or Ulysses attention inside a group
    context_tensor.py   ContextTensorParallel: dp x cp x tp
    sequence_pieces.py  --sequence-pieces K: the sequence in K fixed pieces, attention folded in one order
    context_sums.py     ContextParallel's --deterministic half: dp x cp in those pieces
    grid_sums.py        ContextTensorParallel's: dp x cp x tp, lanes' split layers in --tensor-pieces
"""
