"""Tensor parallelism (Megatron-LM): every layer's weights split over the contexts of a group.

    tensor_layout.py           how a group cuts values: a parameter's shards, even splits
    tensor.py                  TensorParallel: f and g around the model's split_forward; Megatron-SP
    tensor_pieces.py           --tensor-pieces Q: every split layer in Q fixed pieces, one tree
    tensor_deterministic.py    TensorDeterministic: --deterministic --mode tensor in those pieces
    sequence_deterministic.py  --deterministic Megatron-SP: each lane's layer norms at home
"""
