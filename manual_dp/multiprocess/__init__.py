"""More than one process: the same strategies, with a second sum across processes from an existing
engine (Horovod, MXNet's parameter-server KVStore). Nothing here runs on import: the parameter
servers unpickle ps_server while MXNet itself is still loading.

    world        this process's place in the job (rank, size, collectives, watchdog); connect()
    distributed  the cross-process all-reduce and the wrapper that feeds a strategy its rows
    horovod      --backend horovod
    kvstore      --backend dist_sync and dist_async (MXNet's parameter server)
    ps_server    what the parameter servers run under dist_async
    launcher     python -m manual_dp.launch: scheduler, servers and workers of a KVStore job
"""
