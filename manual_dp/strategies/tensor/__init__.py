"""Tensor parallelism (Megatron-LM): every layer's weights split over the contexts of a group.

    tensor_layout.py     how a group cuts values: a batch's copies, a parameter's shards, even splits
    tensor.py            TensorParallel: f and g around the model's split_forward; Megatron-SP
    tensor_pieces.py     --tensor-pieces Q: every split layer in Q fixed pieces, one tree
    tensor_sums.py       TensorParallel's --deterministic half: its layers in those pieces, the batch's in the tree
    sequence_sums.py     its Megatron-SP half: the sequence in lanes, each lane's layer norms at home
"""
