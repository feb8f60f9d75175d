"""The planner behind `python -m manual_dp.plan` (manual_dp/plan.py): every layout of N devices of a
model, with its predicted memory per device and step time, the fastest that fits recommended.

    layouts.py    the layouts of N devices the planner weighs, each a device mesh
    predict.py    a layout's predictions: bytes on the busiest device and seconds per step
    sequence.py   the predictions for layouts that cut the sequence: context, context x tensor, Megatron-SP
    pipelines.py  the predictions for pipelines on every schedule, each times data parallelism
    report.py     the planner's table: predictions, those that fit marked, one recommended
    verify.py     plan --verify: the top layouts run for a few steps, measured beside predicted
"""
