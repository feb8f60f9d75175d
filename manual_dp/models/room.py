"""Whether a model's run fits in the memory this machine has, from its sizes alone, before any of it
is allocated: a model too large for it is refused in one line, instead of being killed by the
system (or ending in a traceback from numpy) halfway through making its parameters.

What a run needs, at least (float32, 4 bytes a number), on CPU contexts, which share the machine:
    copies x N      the initial values the command line keeps, then the parameters, their gradients
                    and the optimiser's state (sgd none, momentum one, adam two) at least once over
                    all the contexts (ZeRO 3 holds exactly that; every other layout more); a user's
                    Gluon block 2 N more (its own arrays and the values read off them)
    examples x A    the activations autograd keeps for the examples recorded at once (the whole
                    batch; a micro-batch in a pipeline; none counted under --recompute), A the
                    model's hand count per example (memory.stage_activation_elems: the input and
                    every layer's outputs)
On GPUs only the initial values are counted here (the host's share). Available memory is
MemAvailable of /proc/meminfo, else the free pages os.sysconf reports; where neither says, nothing
is refused.
"""
import os
from collections import namedtuple

FLOAT_BYTES = 4
GiB = 2 ** 30


def available_bytes():
    """Bytes of memory available for a new run now, or None if the system does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024                     # "MemAvailable: 123 kB"
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


class Room(namedtuple("Room", "bytes copies examples what")):
    """`bytes` available; `copies` float32 copies of the parameters the run keeps at least;
    `examples` whose activations are held at once; `what`: those copies in words."""

    def check(self, n_params, act_elems, own=0):
        """ValueError (one line) if n_params parameters (own: copies the model keeps besides) and
        act_elems activation elements an example need more than `bytes`."""
        if self.bytes is None:
            return
        state = FLOAT_BYTES * n_params * (self.copies + own)
        acts = FLOAT_BYTES * act_elems * self.examples
        if state + acts > self.bytes:
            raise ValueError(
                f"too large for this machine: its {n_params:,} parameters would need about {(state + acts) / GiB:.1f} GiB "
                f"({self.copies + own} float32 copies of them, {state / GiB:.1f} GiB: {self.what}"
                + (", the block's own and the values read off it" if own else "")
                + (f"; the activations of {self.examples} examples, {acts / GiB:.1f} GiB" if acts else "")
                + f"), more than the {self.bytes / GiB:.1f} GiB of memory available")


def room(optimizer_copies, optimizer, examples, on_gpus=False, available=None):
    """The Room of a run of this optimiser (its state: optimizer_copies copies of the parameters) recording
    `examples` at once; on GPUs the host's initial values alone."""
    free = available_bytes() if available is None else available
    if on_gpus:
        return Room(free, 1, 0, "the initial values")
    return Room(free, 3 + optimizer_copies, examples,
                f"the initial values, parameters, gradients" + (f" and {optimizer} state" if optimizer_copies else ""))
