"""A model in a precision: the same layers, their products in bf16 or fp16 (manual_dp.precision).

Precise(model, policy) is a Model with the same parameters, cuts and table whose every layer's
forward sees `policy.low(F)` instead of F, so that every strategy that runs the model's layers (sync,
ZeRO 1-3, pipelines, hybrid, local SGD, async, the deterministic ones) computes in the precision
without a line of its own. Under fp16 the last layer's output carries the loss scale into the
backward (precision.scaled). A "dense" layer becomes a "block": ZeRO-3's hand-made dense gradient
(strategies/zero/zero_layers.py) would compute in float32.

reading_stored(model) is the model reading 16-bit stored parameters (ZeRO's mixed-precision layout,
strategies/zero/zero_mixed.py): each layer casts its parameters to float32 where it reads them.
"""
import copy
import dataclasses

import numpy as np
from mxnet import nd

from ..precision import scaled, widened
from .contract import Model


class Precise(Model):
    """`model` (a models.Model) computing in `policy` (precision.Policy)."""

    def __init__(self, model, policy):
        if model.stats():
            raise ValueError(f"--precision {policy.precision}: --model {model.name}'s BatchNorm trains in fp32 only")
        if any(layer.kind == "gluon" for layer in model.layers):
            raise ValueError(f"--precision {policy.precision}: a Gluon block's layers run as MXNet's cached "
                             f"graphs, which the precision does not reach: it trains in fp32 only")
        self.inner, self.policy = model, policy
        self.largest = float(np.finfo(np.float16).max) if policy.precision == "fp16" else float("inf")
        self.name, self.config, self.noise, self.spec = model.name, model.config, model.noise, model.spec
        last = len(model.layers) - 1
        self.tokens, self.causal, self.aux = getattr(model, "tokens", None), model.causal, model.aux
        self.layers = tuple(dataclasses.replace(
            layer, forward=self.lowered(layer.forward, i == last), kind="block" if layer.kind == "dense" else layer.kind,
            split_forward=layer.split_forward and self.lowered_group(layer.split_forward, i == last),
            sequence_forward=layer.sequence_forward and self.lowered_group(layer.sequence_forward, i == last),
            grid_forward=layer.grid_forward and self.lowered_grid(layer.grid_forward))
            for i, layer in enumerate(model.layers))

    def lowered(self, forward, last):
        policy = self.policy

        def forward_low(h, params, F=nd, shapes=None):
            out = forward(h, params, policy.low(F), shapes)
            return scaled(out, policy.scaler, F) if last else out
        return forward_low

    def lowered_group(self, forward, last):
        """A layer's split_forward or sequence_forward (one array per context of a group) in the
        precision: what meshes run layer by layer (strategies/mesh/mesh_parallel.py, context.py)."""
        policy = self.policy

        def forward_low(hs, params, join, F=nd):
            outs = forward(hs, params, join, policy.low(F))
            return [scaled(o, policy.scaler, F) for o in outs] if last else outs
        return forward_low

    def lowered_grid(self, forward):
        """A layer's grid_forward in the precision (never the last layer: no loss scale here)."""
        policy = self.policy

        def forward_low(hs, params, join, seq, F=nd):
            return forward(hs, params, join, seq, policy.low(F))
        return forward_low

    def grid_refusal(self, C, T, attention):
        return self.inner.grid_refusal(C, T, attention)

    def dropout_sites(self):
        return self.inner.dropout_sites()

    def splits_by_layer(self):
        return self.inner.splits_by_layer()

    def sequence_refusal(self, C, attention):
        return self.inner.sequence_refusal(C, attention)

    def graph_params(self, params, shapes, pad):
        return self.inner.graph_params(params, shapes, pad)

    def cuts(self, n_stages):
        return self.inner.cuts(n_stages)

    def split_forward(self, Xs, shards, join, F=nd):
        """The inner model's split (Megatron's), its products in the precision; g sums the rounded
        partial products in float32."""
        outs = self.inner.split_forward(Xs, shards, join, self.policy.low(F))
        return [scaled(o, self.policy.scaler, F) for o in outs]

    def tensor_refusal(self, T):
        return self.inner.tensor_refusal(T)

    def tensor_traffic(self):
        return self.inner.tensor_traffic()


def reading_stored(model):
    """`model` whose layers take their parameters as 16-bit arrays (precision.STORED) and read
    float32 copies of them, made at use and dropped with the step (transient); recorded, each
    cast's backward writes its parameter's gradient in the 16-bit dtype. Imperative (nd) only."""
    out = copy.copy(model)
    out.layers = tuple(dataclasses.replace(layer, forward=widening(layer.forward)) for layer in model.layers)
    return out


def widening(forward):
    """`forward` (a layer's) fed float32 copies of its 16-bit parameters."""
    def forward_widened(h, params, F=nd, shapes=None):
        return forward(h, [widened(p) for p in params], F, shapes)
    return forward_widened
