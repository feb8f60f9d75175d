"""Data parallelism: every context a replica of the whole model, each on its rows of the batch.

    data_parallel.py  DataParallel: the lesson's step (lesson=True) or the fast one (flat buffers, the
                      cached graph, buckets under backward); replicas in lock-step
    deterministic.py  --deterministic --mode sync: every sum over the batch in sums/'s fixed tree
    async_dp.py       AsyncDataParallel: a master copy and stale replicas (parameter-server style)
    local_sgd.py      LocalSGD: H steps alone, then the replicas meet (DiLoCo's outer step)
"""
