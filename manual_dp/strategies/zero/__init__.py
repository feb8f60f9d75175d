"""ZeRO: data parallelism whose contexts stop holding k copies of the same state.

    zero.py                ZeroRedundancy: stages 1-3 (optimiser state, gradients, parameters sharded)
    zero_layers.py         a model a layer at a time, parameters gathered per layer (stages 2 and 3)
    zero_mixed.py          MixedZero: 16-bit parameters and gradients, float32 master shards (DeepSpeed's)
    zero_sums.py           FixedZero: ZeroRedundancy given sums/'s FixedSums (--deterministic), each
                           shard's part of the fixed tree's sum on its context
    dp_zero.py             ZeRO over a mesh's data dimension (--zero-stage with tensor, context, mesh)
"""
