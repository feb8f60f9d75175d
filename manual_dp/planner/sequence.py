"""The planner's predictions for the layouts that cut the sequence of tokens: context parallelism
(dp x cp, ring or Ulysses attention; strategies/context.py) and tensor parallelism with and without
Megatron's sequence parallelism (dp x tp; strategies/tensor.py). Per example counts come from the
model's layers (Layer.acts, Layer.inputs, Model.tensor_traffic); `n` is a group's examples.

Activations per context (elements):
  tensor   1/T of the group's examples' activations (TensorParallel.layout's floor), plus what runs
           whole on every rank for all n examples: what f takes in and g gives out
           (Model.tensor_traffic: the layer norms' outputs and the summed outputs, 4 T d a
           transformer block) and the layers outside the split runs (the embedding and the head).
  +sp      Megatron-SP (Korthikanti et al. 2022, per layer sbh(10 + 24/t + 5as/(ht)) down to
           sbh(34/t + 5as/(ht))): what f and g join is cut along the sequence too, so only the
           layers outside the split runs stay whole. Below tensor by (1 - 1/T) of the traffic.
  context  1/C of the group's examples' activations (ContextParallel.layout; T x T scores included,
           T/C x T a context), plus for all n examples: the images (copied whole to every context)
           and what the attention keeps for its backward beyond one block's share: ring, the
           C - 1 foreign key and value blocks and the running output each further step makes
           (2 T_j d each); Ulysses, the all-to-all's q, k, v of all T tokens on H/C heads and the
           output sent back (3 T d/C + T_j d). T_j: the largest block, ceil(T/C).
  Not counted: the online softmax's running max and sum (T_j H a step), temporaries of the
  collectives, the ring's in-flight copies; layer norm internals whole under tensor parallelism
  beyond their outputs. So every figure is a floor, a closer one than the strategies' layout().

Communication per step (alpha-beta, as planner/predict.py prices the other collectives):
  tensor and +sp: the same bytes (f and g's all-reduces are a reduce-scatter and an all-gather each;
           SP sends an all-gather and a reduce-scatter instead): priced in planner/predict.py.
  ring     per attention layer, C - 1 hops forward (each context sends its key and value blocks to
           the next, two messages of n T_j d floats) and C - 1 back with their gradients.
  ulysses  per attention layer, 4 all-to-alls forward (q, k, v in, the output back) and 4 backward;
           an all-to-all of n T_j d floats a context: C - 1 messages, (C - 1)/C of the bytes.
  both     the pooled vector's sum over the group (seq.sum, and its backward: two all-reduces of
           n d floats over C) and one ring all-reduce of the 4N gradient bytes over all dp x cp
           contexts (float32 under any --precision).
Compute: the group's FLOPs split C ways (the ring's softmax rescaling not counted).
"""
from .. import costmodel
from ..fast.collectives import chunk_bounds
from ..memory import FLOAT_BYTES, stage_activation_elems


def even(n, k):
    """k counts adding up to n, the larger first (as the strategies cut a batch and a sequence)."""
    bounds = chunk_bounds(n, k)
    return [b - a for a, b in zip(bounds, bounds[1:])]


def whole_per_example(net):
    """Activation elements one context keeps per example running every layer (memory.py)."""
    return sum(stage_activation_elems(model=net))


def outside_split(net):
    """Per example elements of the layers a tensor group runs whole, outside its split runs (none
    for a model that splits itself, Model.split_forward overridden): their outputs, and the images
    if the first runs whole."""
    layers = net.layers
    if not any(layer.split_forward for layer in layers):
        return 0
    whole = [layer for layer in layers if not layer.split_forward]
    return sum(layer.acts for layer in whole) + (layers[0].inputs if not layers[0].split_forward else 0)


def tensor_activations(l, net, n):
    """Activation elements per rank of a tensor group of n examples (see the module's docstring)."""
    shares = even(n, l.tp)
    whole = outside_split(net) + (0 if l.sp else sum(e for _, e, _ in net.tensor_traffic()))
    return [whole_per_example(net) * k + whole * (n - k) for k in shares]


def attention_layers(net):
    """[(tokens T, width d)] of each attention layer (a layer with a head_dim)."""
    T = getattr(net, "tokens", 0)
    return [(T, layer.inputs // T) for layer in net.layers if T and "head_dim" in layer.extra]


def attention_extra(net, C, attention):
    """Per example elements a context of C keeps for attention's backward beyond 1/C of the whole."""
    out = 0
    for T, d in attention_layers(net):
        Tj = -(-T // C)
        out += 2 * (T - Tj) * d + 2 * (C - 1) * Tj * d if attention == "ring" else 3 * T * d // C + Tj * d
    return out


def context_activations(l, net, n):
    """Activation elements per context of a group of n examples (see the module's docstring)."""
    images, attention = net.layers[0].inputs, attention_extra(net, l.cp, l.attention)
    return [whole_per_example(net) * k + images * (n - k) + attention * n for k in even(n, l.cp)]


def all_to_all(k, nbytes, dev):
    """Seconds of an all-to-all of nbytes a device over k devices: k - 1 messages, (k-1)/k of the bytes."""
    return (k - 1) * dev.alpha + (k - 1) / k * nbytes * dev.beta


def width(net):
    """The features the head pools (d): the last layer's input per token."""
    T = getattr(net, "tokens", 0) or 1
    return net.layers[-1].inputs // T


def context_communication(l, net, n, n_params, dev):
    """Seconds of a context-parallel step's collectives (see the module's docstring)."""
    C, total = l.cp, 0.0
    for T, d in attention_layers(net):
        block = n * -(-T // C) * d * FLOAT_BYTES
        total += (2 * (C - 1) * 2 * (dev.alpha + block * dev.beta) if l.attention == "ring"
                  else 8 * all_to_all(C, block, dev))
    pooled = 2 * costmodel.allreduce_time("ring", C, n * width(net) * FLOAT_BYTES, dev.alpha, dev.beta)
    grads = costmodel.allreduce_time("ring", l.dp * C, n_params * FLOAT_BYTES, dev.alpha, dev.beta)
    return total + pooled + grads
