"""N-D meshes: data x pipeline x tensor (or context) parallelism at once (manual_dp/mesh.py's groups).

    group_stages.py        a pipeline stage run on a group of contexts, a replica's pass, their checks
    mesh_sums.py           MeshParallel's --deterministic half: dp x pp x tp in --tensor-pieces
    lane_sums.py           its dp x pp x cp: each stage's sequence in --sequence-pieces lanes
    mesh_parallel.py       MeshParallel: dp x pp x tp, cp, or both, with ZeRO over dp; sums=
"""
