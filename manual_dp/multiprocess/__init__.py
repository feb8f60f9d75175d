"""More than one process: the same strategies, with a second sum across processes from an existing
engine (Horovod, MXNet's parameter-server KVStore). Nothing here runs on import: the parameter
servers unpickle ps_server while MXNet itself is still loading.

    world.py        this process's place in the job: rank, size, collectives, a watchdog
    distributed.py  the cross-process all-reduce and the wrapper that feeds a strategy its rows
    connect.py      connect(): the World of this process for --backend, opened and closed around a run
    agree.py        every process's settings equal to rank 0's before any of them trains
    flight.py       the flight recorder: every process's last collectives, written when the job goes wrong
    horovod.py      --backend horovod (Gloo on CPU, NCCL on GPUs)
    kvstore.py      --backend dist_sync and dist_async (MXNet's parameter server)
    ps_server.py    what the parameter servers run under dist_async
    launcher.py     python -m manual_dp.launch: scheduler, servers and workers of a KVStore job
    elastic.py      --max-restarts: the launcher's jobs, restarted on the workers that remain
    board.py        the job's progress board: who is behind when a collective hangs
"""
