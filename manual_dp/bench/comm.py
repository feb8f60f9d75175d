"""The all-reduce part of the benchmark: every algorithm, payload and context count of a plan,
measured with manual_dp.measure in one worker process."""
from ..fast.collectives import ALLREDUCE_ALGORITHMS
from ..measure import allreduce_sweep, copy_bound, lenet_point, memory_floor


def run(spec):
    """All records of one allreduce benchmark spec (payloads, device counts, repeats, rounds of
    the all-reduce sweep)."""
    records = [copy_bound(b, spec["repeats"]) for b in spec["payloads"]]
    names = spec.get("algorithms") or sorted(ALLREDUCE_ALGORITHMS)
    for k in spec["devices"]:
        records += [memory_floor(k, b, spec["repeats"]) for b in spec["payloads"] if k > 1]
    records += allreduce_sweep(names, spec["devices"], spec["payloads"], spec.get("rounds", spec["repeats"]))
    for k in spec.get("lenet_devices", []):
        for name in names:
            records += [lenet_point(name, k, fused, spec["repeats"]) for fused in (False, True)]
    return records
