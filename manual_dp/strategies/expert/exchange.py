"""The two all-to-alls of an expert-parallel group (GShard's dispatch and combine across devices),
written on manual_dp.fast.mesh_ops.all_to_all, whose backward is the all-to-all back: so the gradient
of an expert's weights on its context sums the tokens of every context that sent it slots.

    send   context i's slots (E, B_i*C, d), cut by expert into N runs of E/N; context j receives
           run j of every context, joined along the rows: (E/N, sum_i B_i*C, d), rows of context
           0 first
    back   the inverse: context j's outputs (E/N, sum_i B_i*C, d) cut along the rows by B_i*C,
           context i receiving every context's run of its own rows, joined by expert: (E, B_i*C, d)
"""
from ...fast.mesh_ops import all_to_all


class ExpertGroup:
    """The contexts of one expert-parallel group, in order; context j holds experts
    j*E/N .. (j+1)*E/N - 1 of every MoE block."""

    def __init__(self, ctx, experts):
        if experts % len(ctx):
            raise ValueError(f"--expert-parallel {len(ctx)} does not divide --experts {experts}")
        self.ctx, self.experts, self.size = list(ctx), experts, len(ctx)

    def owned(self, j):
        """The experts context j of the group holds: a range."""
        per = self.experts // self.size
        return range(j * per, (j + 1) * per)

    def send(self, slots):
        """Every context's slots (E, B_i*C, d) -> each context's experts' slots from all (E/N, S, d)."""
        if self.size == 1:
            return list(slots)
        return all_to_all(list(slots), 0, 1, [self.experts // self.size] * self.size)

    def back(self, outputs, rows):
        """Each context's experts' outputs (E/N, S, d) -> every context's own rows of all (E, B_i*C, d);
        rows[i]: B_i*C, the rows context i sent."""
        if self.size == 1:
            return list(outputs)
        return all_to_all(list(outputs), 1, 0, list(rows))
