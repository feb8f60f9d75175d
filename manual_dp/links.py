"""Emulated links and stragglers: what `--link` and `--straggler` name, parsed without MXNet.

A link is the cost model's (manual_dp.costmodel): a message of n bytes takes
latency + n / bandwidth seconds (costmodel.message_time); manual_dp.fast.link delays every transfer
between contexts by that, hop by hop, so that a run on CPU contexts sharing one memory takes the time
it would take over the link. The presets, per direction, with where each figure comes from:

    pcie3   12 GB/s, 10 us   PCI-SIG PCIe 3.0: 8 GT/s x 16 lanes, 128b/130b = 15.75 GB/s raw per
                             direction; ~12 GB/s is what CUDA's bandwidthTest measures for pinned
                             host-device copies on x16 slots (NVIDIA's CUDA samples); 10 us: a
                             cudaMemcpy's launch and completion (the figure costmodel.LINKS states)
    pcie4   25 GB/s, 10 us   PCI-SIG PCIe 4.0: 16 GT/s x 16 = 31.5 GB/s raw; ~25 GB/s measured the same
                             way (about 80% of raw, as for PCIe 3.0); the same latency
    nvlink  150 GB/s, 5 us   NVIDIA Tesla V100 whitepaper (2017): 6 NVLink 2.0 links x 25 GB/s per
                             direction (300 GB/s both ways); 5 us as costmodel.LINKS states for it
    eth1    0.125 GB/s, 50 us 1 Gb/s Ethernet (IEEE 802.3ab, 1000BASE-T) line rate; the same latency as
                             eth10 (a TCP message through the kernel's stack)
    eth10   1.25 GB/s, 50 us 10 Gb/s Ethernet (IEEE 802.3ae) line rate; ~50 us a TCP message through
                             the kernel's stack (as costmodel.LINKS states for 25 Gb/s Ethernet)
    eth100  12.5 GB/s, 20 us 100 Gb/s Ethernet (IEEE 802.3ba) line rate; 20 us as costmodel.LINKS
    ib      25 GB/s, 1 us    InfiniBand HDR: 200 Gb/s per port (NVIDIA ConnectX-6 product brief, which
                             states a latency under 0.6 us; ~1 us an MPI message end to end)

`--link GBPS,LATENCY_US` names any other link: `--link 5,30` is 5 GB/s (1e9 bytes/s) and 30 us.
"""
import math
from collections import namedtuple

from .costmodel import LINKS, allreduce_time, message_time
from .errors import UsageError

GB, US = 1e9, 1e-6

# name: (latency in s, bandwidth in bytes/s per direction), costmodel.LINKS's form, and its very entries
# where it states the link (the planner's --link reads those): sources in the module docstring
LINK_PRESETS = {"pcie3": LINKS["PCIe 3.0 x16"], "pcie4": (10 * US, 25 * GB), "nvlink": LINKS["NVLink (V100)"],
                "eth1": (50 * US, 0.125 * GB), "eth10": (50 * US, 1.25 * GB),
                "eth100": LINKS["100 Gb/s Ethernet"], "ib": (1 * US, 25 * GB)}


class LinkSpec(namedtuple("LinkSpec", "name bandwidth latency")):
    """A link: its name, bandwidth in bytes/s and latency in s, priced by the cost model."""

    @property
    def alpha_beta(self):
        """The cost model's (alpha, beta): latency per message, seconds per byte."""
        return self.latency, 1.0 / self.bandwidth

    def seconds(self, nbytes):
        """Seconds one message of `nbytes` takes over this link (costmodel.message_time)."""
        return message_time(nbytes, *self.alpha_beta)

    def allreduce_seconds(self, algorithm, k, nbytes):
        """The cost model's seconds to all-reduce `nbytes` over k contexts joined by this link."""
        return allreduce_time(algorithm, k, nbytes, *self.alpha_beta)


def parse_link(text):
    """The LinkSpec `--link` names: a preset of LINK_PRESETS or GBPS,LATENCY_US; UsageError if bad."""
    if text in LINK_PRESETS:
        latency, bandwidth = LINK_PRESETS[text]
        return LinkSpec(text, bandwidth, latency)
    try:
        gbps, us = (float(part) for part in text.split(","))
    except ValueError:
        raise UsageError(f"--link {text}: give a preset ({', '.join(LINK_PRESETS)}) or GBPS,LATENCY_US "
                         f"(e.g. 12,10)") from None
    if not (gbps > 0 and us > 0 and math.isfinite(gbps) and math.isfinite(us)):
        raise UsageError(f"--link {text}: the bandwidth (GB/s) and the latency (us) must be positive and finite")
    return LinkSpec(f"{gbps:g} GB/s, {us:g} us", gbps * GB, us * US)


Straggler = namedtuple("Straggler", "context factor")


def parse_straggler(text, n_contexts):
    """The Straggler `--straggler CONTEXT:FACTOR` names: context index in 0..n_contexts-1, factor >= 1
    (finite); UsageError if bad."""
    try:
        index, factor = text.split(":")
        index, factor = int(index), float(factor)
    except ValueError:
        raise UsageError(f"--straggler {text}: give CONTEXT:FACTOR, e.g. 1:2 (context 1 twice as slow)") from None
    if not 0 <= index < n_contexts:
        raise UsageError(f"--straggler {text}: context {index} is not one of the {n_contexts} contexts (0..{n_contexts - 1})")
    if not (factor >= 1 and math.isfinite(factor)):
        raise UsageError(f"--straggler {text}: the factor must be >= 1 and finite, got {factor:g}")
    return Straggler(index, factor)
