"""Are the replicas still identical? Checksums of every copy of every parameter, compared.

Every strategy keeps copies that must hold the same bits after each update (data parallelism's
replicas; in hybrid, each stage's copies; across processes, every rank's). A wrong reduction, a
flipped bit or a process that missed an update shows as a copy whose checksum differs: the loop
checks every N updates (--check-replicas N) and stops the run, naming the step, the copy and the
parameter, before a checkpoint of the bad state is written.
"""
import zlib

from .errors import ReplicaMismatchError


def checksum(array):
    """CRC-32 of an NDArray's bytes (one copy to the host)."""
    return zlib.crc32(array.asnumpy().tobytes())


def fingerprint(place, params, names=None):
    """(place, [(name, checksum)]) of one copy of `params` (named p0, p1, ... unless `names`)."""
    names = names or [f"p{i}" for i in range(len(params))]
    return str(place), [(name, checksum(p)) for name, p in zip(names, params)]


def check(groups, step):
    """ReplicaMismatchError naming the first copy that differs from the first of its group."""
    for group, copies in groups.items():
        (ref_place, ref), others = copies[0], copies[1:]
        for place, sums in others:
            for (name, want), (_, got) in zip(ref, sums):
                if got != want:
                    raise ReplicaMismatchError(f"update {step}: the {group} on {place} differs from the one on "
                                               f"{ref_place} in {name} (checksum {got:08x}, not {want:08x})")
