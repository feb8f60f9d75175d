"""Model, pipeline and hybrid parallelism: a model's layers cut into stages on different contexts.

    stages.py         a model cut into stages, and the boundary copy between them
    schedules.py      GPipe, 1F1B, interleaved and ZB-H1 as data, simulated
    stage_costs.py    each action priced with the model's FLOPs (the dry run's bubbles)
    stage_times.py    each action timed on this machine before a run
    pipeline_pass.py  one replica's run of a schedule, action by action
    pipeline_sums.py  --deterministic in a pipeline: each stage's pieces as leaves of sums/'s tree
    pipeline.py       PipelineParallel: model, pipeline, hybrid, --recompute, sums=
"""
