"""The benchmark (`python -m manual_dp.bench`), one file a concern; nothing runs on import. The
files marked * run on their own too: `python -m manual_dp.bench.NAME`.

    command.py            the command line: plans, one fresh worker process per measurement, the report
    worker.py *           one measurement in a fresh process (`python -m manual_dp.bench.worker SPEC_JSON`)
    comm.py               all-reduce timings, the copy bound and the memory floor
    link.py *             LeNet's step under emulated links (--link), measured beside the cost model's prediction
    straggler.py *        LeNet's images/s under --straggler: sync beside async and local SGD, the slow context fixed or moving
    train.py              training throughput of manual_dp, the lesson's code and gluon's Trainer
    peer_torch.py         the same LeNet, transformer and GPT in PyTorch, one process or DDP (extra `bench`)
    overlap.py            do two CPU contexts compute at the same time? (MXNet's profiler)
    report.py             scaling efficiency, the targets' ratios, tables, results.json
    plots.py              the PNG plots
    memory.py             every mode's measured memory per context (--memory)
    local_sgd.py          local SGD at H = 1, 4, 16: test accuracy and communication rounds (--local-sgd)
    lstm.py *             seed 000's LSTM on the fortunes: Gluon's Trainer beside sync, the lesson's step, async
    compress.py           every --compress setting trained side by side: bytes, accuracy, images/s
    kvstore_compress.py * the same run through MXNet's own 2bit, the reference for --compress 2bit
    stages.py *           what 1F1B and --recompute buy: activation bytes per stage, step times
    zero_memory.py *      bytes per context: sync against ZeRO stages 1, 2, 3, in fp32 and 16 bits
    tensor.py *           what tensor parallelism saves and costs, beside sync on the same contexts
    modes.py *            every mode's images/s side by side, for any model
    experts.py *          the MoE GPT's tokens/s: expert parallelism against replicated experts, the all-to-all's share
    precision.py *        fp32, bf16 (native and emulated) and fp16 side by side, with the bytes all-reduced
    transformer.py *      the transformer, or the GPT (--model gpt), beside PyTorch and the lesson's step
    transformer_models.py the models transformer.py measures (a table) and one measurement of either
    gpt_reference.py *    manual_dp.train's GPT against the same GPT trained in PyTorch: validation losses
    kernels.py *          where the fast step's time goes on any model: MXNet operators, oneDNN kernels
    checkpoints.py *      a checkpoint every K updates, in the step and --async-checkpoint, against none
    resume.py *           issue 39's A x B matrix: stopped mid-epoch in layout A, resumed in B, one context's bits
    meshes.py *           issue 22's targets for meshes, sequence and context parallelism, side by side
    mesh_runs.py          the measurements of meshes.py, one function a part
"""
