"""The same step, faster: what the lesson's code becomes when it has to run at speed.

    collectives.py     all-reduce algorithms with the lesson's contract, and their registry
    prepared.py        the lesson's call path, one all-reduce per gradient, its engine calls built once
    sharded.py         reduce-scatter and all-gather, the two halves of an all-reduce (naive and ring)
    flat.py            one flat buffer per device for parameters, gradients and optimiser state
    graph.py           a model's forward and cross_entropy traced once into a cached symbolic graph
    prefetch.py        batches prepared ahead in a thread, handed to MXNet without waiting
    buckets.py         the flat buffer cut into buckets, each all-reduced as backward writes it (--bucket-mb)
    link.py            emulated links (--link): every transfer delayed on the engine by the link's time
    compress.py        gradient compression with error feedback: fp16, 2bit, 1bit, top-k (--compress)
    powersgd.py        PowerSGD: each weight gradient sent as two thin matrices, with error feedback
    runtime.py         thread and engine settings, chosen before MXNet loads
    autotune.py        settings whose best value depends on the CPU, measured once per machine
    memtrack.py        bytes MXNet's storage holds on each context: its profiler's memory counters
    tensor_ops.py      Megatron-LM's conjugate operators f and g, by hand across contexts
    mesh_ops.py        a mesh's collectives beyond the all-reduce: all-gather, reduce-scatter, all-to-all
    attention.py       attention over a sequence cut into blocks, one per context (ring, Ulysses)
    ring_attention.py  ring attention with a backward of its own: a second ring for the gradients
    causal_attention.py  causal ring and Ulysses over chunks of the sequence, the balanced (zig-zag) cut
    trace.py           --trace PATH: a few steps as one Chrome trace (MXNet's profiler and our spans)
"""
