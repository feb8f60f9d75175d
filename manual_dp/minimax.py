"""The best fit by the worst error: x >= 0 minimising max_i |A_i x - 1|, a small linear programme.

Fitting a cost model so that its worst relative error is least (manual_dp.costmodel_cpu) is this
problem with A_i = the model's terms of point i over its measured time. It is solved here, without
a solver library, as the dual programme

    maximise  sum(z) - sum(y)   subject to   A^T (z - y) <= 0,  sum(y) + sum(z) <= 1,  y, z >= 0

whose origin is feasible, by the simplex method with Bland's rule (no cycling on the many ties);
the primal x and the least worst error are read from the final tableau's objective row.
"""
import numpy as np

TOLERANCE = 1e-12


def pivot(T, basis, row, col):
    """Afterwards column `col` is the unit vector of `row` in T, and basis[row] = col."""
    T[row] /= T[row, col]
    for r in range(len(T)):
        if r != row:
            T[r] -= T[r, col] * T[row]
    basis[row] = col


def tableau(A):
    """The dual programme's simplex tableau (constraints, then the objective row) and its slack basis."""
    N, m = A.shape
    T = np.zeros((m + 2, 2 * N + m + 2))
    T[:m, :N], T[:m, N:2 * N] = -A.T, A.T          # A^T (z - y) <= 0, one row per parameter
    T[m, :2 * N], T[m, -1] = 1.0, 1.0               # sum(y) + sum(z) <= 1
    T[:m + 1, 2 * N:2 * N + m + 1] = np.eye(m + 1)  # slacks
    T[-1, :N], T[-1, N:2 * N] = 1.0, -1.0           # -(objective)
    return T, list(range(2 * N, 2 * N + m + 1))


def minimax(A):
    """(x >= 0 minimising max_i |A_i x - 1|, that maximum). Columns are scaled to at most 1 in size
    first (the programme is solved on those, x scaled back), so terms of any units can be mixed."""
    A = np.asarray(A, dtype=float)
    scale = np.abs(A).max(axis=0)
    scale[scale == 0] = 1.0
    T, basis = tableau(A / scale)
    N, m = A.shape
    for _ in range(100 * (N + m)):
        entering = np.flatnonzero(T[-1, :-1] < -TOLERANCE)
        if not len(entering):
            break
        col = entering[0]                                        # Bland: the first improving column
        rows = np.flatnonzero(T[:-1, col] > TOLERANCE)
        ratios = T[rows, -1] / T[rows, col]
        ties = rows[ratios <= ratios.min() + 1e-15]
        pivot(T, basis, min(ties, key=lambda r: basis[r]), col)  # Bland: the lowest basic variable
    x = np.maximum(T[-1, 2 * N:2 * N + m], 0.0) / scale
    return x, float(np.abs(A @ x - 1).max())
