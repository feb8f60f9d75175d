"""The all-reduce part of the benchmark: every algorithm, payload and context count of a plan,
measured with manual_dp.measure in one worker process."""
from ..fast.collectives import ALLREDUCE_ALGORITHMS
from ..measure import allreduce_point, copy_bound, lenet_point, memory_floor


def run(spec):
    """All records of one allreduce benchmark spec (payloads, device counts, repeats)."""
    records = [copy_bound(b, spec["repeats"]) for b in spec["payloads"]]
    names = spec.get("algorithms") or sorted(ALLREDUCE_ALGORITHMS)
    for k in spec["devices"]:
        records += [memory_floor(k, b, spec["repeats"]) for b in spec["payloads"] if k > 1]
        for name in names:
            records += [allreduce_point(name, k, b, spec["repeats"]) for b in spec["payloads"]]
    for k in spec.get("lenet_devices", []):
        for name in names:
            records += [lenet_point(name, k, fused, spec["repeats"]) for fused in (False, True)]
    return records
