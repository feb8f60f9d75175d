"""Parallel strategies, one file each, all keeping the contract written in base.py:

    base           Strategy: backward, update, step, correct, state_dict ... (read this first)
    data_parallel  DataParallel: replicas in lock-step; the lesson's step or the fast one
    accum          GradAccum: N batches, one update, around any strategy
    async_dp       AsyncDataParallel: a master copy and stale replicas (parameter-server style)
    stages         LeNet cut in two stages, the boundary copy, GPipe's schedule
    pipeline       PipelineParallel: model, pipeline (GPipe) and hybrid parallelism
    zero           ZeroRedundancy: ZeRO stages 1-3, state, gradients, parameters sharded
    zero_layers    LeNet a layer at a time, for ZeRO stages 2 and 3
    zero_mixed     MixedZero: ZeRO under bf16/fp16, 16-bit parameters and gradients, float32 masters
    tensor         TensorParallel: Megatron-style split layers, tensor groups data parallel
    zero_deterministic  DeterministicZero: --deterministic's fixed tree in ZeRO stages 1-3
"""
