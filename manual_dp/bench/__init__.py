"""The benchmark (`python -m manual_dp.bench`), one file a concern; nothing runs on import.

    command     the command line: plans, one fresh worker process per measurement, the report
    worker      one measurement in a fresh process (`python -m manual_dp.bench.worker SPEC_JSON`)
    comm        all-reduce timings, the copy bound and the memory floor
    train       training throughput of manual_dp, the lesson's code and gluon's Trainer
    peer_torch  the same LeNet and transformer in PyTorch, one process or DDP (optional extra `bench`)
    overlap     do two CPU contexts compute at the same time? (MXNet's profiler)
    report      scaling efficiency, the targets' ratios, tables, results.json
    plots       the PNG plots
    memory      every mode's measured memory per context (--memory)
    local_sgd   local SGD at H = 1, 4, 16: test accuracy and communication rounds per epoch
    modes       every mode's images/s side by side, for any model (`python -m manual_dp.bench.modes`)
    transformer the transformer beside PyTorch and the lesson's step (`python -m manual_dp.bench.transformer`)
    precision   fp32, bf16 (native and emulated) and fp16 side by side, with the bytes all-reduced (`python -m manual_dp.bench.precision`)
"""
