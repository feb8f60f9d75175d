"""Data parallelism: every context a replica of the whole model, each on its rows of the batch.

    data_parallel.py  DataParallel: the lesson's step (lesson=True) or the fast one (flat buffers, the
                      cached graph, buckets under backward); replicas in lock-step
    data_sums.py      FixedData: DataParallel given sums/'s FixedSums (--deterministic), every sum over
                      the batch in its fixed tree, a piece's whole-model gradient per leaf
    async_dp.py       AsyncDataParallel: a master copy and stale replicas (parameter-server style)
    local_sgd.py      LocalSGD: H steps alone, then the replicas meet (DiLoCo's outer step)
"""
