"""N-D meshes: data x pipeline x tensor (or context) parallelism at once (manual_dp/mesh.py's groups).

    group_stages.py        a pipeline stage run on a group of contexts
    mesh_parallel.py       MeshParallel: dp x pp x tp, cp, or both, with ZeRO over dp
    mesh_deterministic.py  MeshDeterministic: --deterministic dp x pp x tp in --tensor-pieces
    mesh_lanes.py          MeshLanes: --deterministic dp x pp x cp in --sequence-pieces
"""
