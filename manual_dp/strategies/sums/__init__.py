"""How every sum over the batch is taken: the one policy --deterministic passes into a layout.

    fixed_sums.py  FixedSums: the batch cut into pieces of PIECE_ROWS rows, each piece's gradient
                   computed whole, the pieces added in one binary tree over their numbers (across
                   processes too); the same bits on any layout, device or process count

This folder imports no parallel dimension: every layout imports it.
"""
