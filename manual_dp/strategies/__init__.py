"""Parallel strategies: one contract (base.py), one folder per parallel dimension, the sums policy and
the wrappers around any strategy. Read in this order:

    base.py      Strategy: backward adds, update normalises and zeroes, one shared step (read this first)
    clipping.py  the global gradient norm, every parameter counted once in any layout (--clip-norm)
    running.py   BatchNorm's running statistics, shared by every layout that keeps replicas
    data/        the lesson's step and the fast one; async; local SGD
    sums/        --deterministic's policy: pieces of every batch added in one fixed tree (imports no layout)
    zero/        ZeRO stages 1-3, in float32 or 16 bits, and over a mesh's data dimension
    pipeline/    stages, the four schedules as data, their prices, PipelineParallel
    tensor/      Megatron's split layers, sequence parallelism, split layers in fixed pieces
    context/     the sequence cut over contexts: ring and Ulysses attention, cp x tp
    mesh/        data x pipeline x tensor (or context) at once
    expert/      an MoE's experts sharded over a group, all-to-all to them and back (expert parallelism)
    wrappers/    around any strategy: gradient accumulation, fp16's loss scale, compression, digests

Each folder's docstring lists its own files in reading order.
"""
