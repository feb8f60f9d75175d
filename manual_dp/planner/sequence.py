"""The planner's predictions for the layouts that cut the sequence of tokens: context parallelism
(dp x cp, ring or Ulysses attention; strategies/context/context.py), context x tensor (dp x cp x tp, a C x T
grid per replica; strategies/context/context_tensor.py) and tensor parallelism with and without Megatron's
sequence parallelism (dp x tp; strategies/tensor/tensor.py). Per example counts come from the
model's layers (Layer.acts, Layer.inputs, Model.tensor_traffic); `n` is a group's examples.

Activations per context (elements): exactly what the strategies' layout() prices (memory.py), so
--verify's measured side equals the prediction.
  tensor   1/T of the group's examples' activations, plus, for the group's other examples, what
           every rank holds whole (strategies/tensor.held_whole): the images (copies), what f takes
           in and g gives out (Model.tensor_traffic: the layer norms' outputs and the summed
           outputs, 4 T d a transformer block) and the layers outside the split runs (the
           embedding and the head).
  +sp      Megatron-SP (Korthikanti et al. 2022, per layer sbh(10 + 24/t + 5as/(ht)) down to
           sbh(34/t + 5as/(ht))): what f and g join is cut along the sequence too, so only the
           images and the layers outside the split runs stay whole. Below tensor by (1 - 1/T) of
           the traffic.
  context  1/C of the group's examples' activations (T x T scores included, T/C x T a context),
           plus the other examples' images (copied whole to every context) and, for all n
           examples, what the attention keeps for its backward beyond one block's share
           (strategies/context.attention_held): ring, a log-sum-exp per head and row (H T_j) less
           the scores and softmax weights it does not keep (2 H T_j T: its backward's second ring
           recomputes them); Ulysses, the all-to-all's q, k, v of all T tokens on H/C heads and
           the output sent back (3 T d/C + T_j d).
  cp x tp  1/(C T) of the group's examples' activations, nothing whole: ContextTensorParallel's
           layout(), a floor (it leaves out the images copied to every context, what f and g
           join for a block of tokens, and attention's extra), so --verify's two sides agree.
  Not counted: the online softmax's temporaries, temporaries of the collectives, the ring's
  in-flight copies; residual sums and layer norm internals beyond their
  outputs whole under tensor parallelism. So every figure is a floor.

Communication per step (alpha-beta, as planner/predict.py prices the other collectives):
  tensor and +sp: the same bytes (f and g's all-reduces are a reduce-scatter and an all-gather each;
           SP sends an all-gather and a reduce-scatter instead): priced in planner/predict.py.
  ring     per attention layer, C - 1 hops forward (each context sends its key and value blocks to
           the next, two messages of n T_j d floats), and in the backward the same C - 1 hops
           again plus C hops of their gradients, which travel with them and then home
           (fast/ring_attention.py).
  ulysses  per attention layer, 4 all-to-alls forward (q, k, v in, the output back) and 4 backward;
           an all-to-all of n T_j d floats a context: C - 1 messages, (C - 1)/C of the bytes.
  both     the pooled vector's sum over the group (seq.sum, and its backward: two all-reduces of
           n d floats over C) and one ring all-reduce of the 4N gradient bytes over all dp x cp
           contexts (float32 under any --precision).
  cp x tp  the same on each tensor rank's column, its blocks d/T wide (rank t's H/T heads), the
           gradients a rank keeps (split parameters 1/T) all-reduced over dp x cp; and each row's
           f and g (one ring all-reduce over T per entry of Model.tensor_traffic, on the row's
           block of tokens: 1/C of the entry).
Compute: the group's FLOPs split C ways (C T on a grid; the ring's softmax rescaling and its
backward's recomputed scores not counted).
"""
from .. import costmodel
from ..fast.collectives import chunk_bounds
from ..memory import FLOAT_BYTES, stage_activation_elems
from ..strategies.context.context import attention_held, attention_layers
from ..strategies.tensor.tensor_layout import held_whole


def even(n, k):
    """k counts adding up to n, the larger first (as the strategies cut a batch and a sequence)."""
    bounds = chunk_bounds(n, k)
    return [b - a for a, b in zip(bounds, bounds[1:])]


def whole_per_example(net):
    """Activation elements one context keeps per example running every layer (memory.py)."""
    return sum(stage_activation_elems(model=net))


def tensor_activations(l, net, n):
    """Activation elements per rank of a tensor group of n examples (see the module's docstring)."""
    whole = held_whole(net, range(len(net.layers)), l.sp)
    return [whole_per_example(net) * k + whole * (n - k) for k in even(n, l.tp)]


def context_activations(l, net, n):
    """Activation elements per context of a group of n examples (see the module's docstring)."""
    if l.tp > 1:                                         # a C x T grid: ContextTensorParallel's floor
        return [whole_per_example(net) * k for k in even(n, l.cp * l.tp)]
    images, attention = net.layers[0].inputs, attention_held(net, l.cp, l.attention)
    return [whole_per_example(net) * k + images * (n - k) + attention * n for k in even(n, l.cp)]


def all_to_all(k, nbytes, dev):
    """Seconds of an all-to-all of nbytes a device over k devices: k - 1 messages, (k-1)/k of the bytes."""
    return (k - 1) * dev.alpha + (k - 1) / k * nbytes * dev.beta


def width(net):
    """The features the head pools (d): the last layer's input per token."""
    T = getattr(net, "tokens", 0) or 1
    return net.layers[-1].inputs // T


def attention_communication(l, layers, n, dev):
    """Seconds of the ring hops or Ulysses' all-to-alls of the attention layers `layers` ((tokens,
    width, heads) each, strategies/context.attention_layers) over C for n examples, each context's
    blocks d/T wide (a tensor rank's heads)."""
    C, total = l.cp, 0.0
    for T, d, _ in layers:
        block, hops = n * -(-T // C) * d // l.tp * FLOAT_BYTES, 3 * (C - 1) + (C > 1)
        total += (2 * hops * (dev.alpha + block * dev.beta) if l.attention == "ring"
                  else 8 * all_to_all(C, block, dev))
    return total


def row_tensor_communication(l, traffic, n, dev):
    """Seconds of a C x T grid row's f and g for n examples: one ring all-reduce over T per entry
    of `traffic` (Model.tensor_traffic), on the row's block of tokens (1/C of the entry)."""
    return sum(costmodel.allreduce_time("ring", l.tp, n * -(-elems // l.cp) * FLOAT_BYTES, dev.alpha, dev.beta)
               for _, elems, _ in traffic)


def pooled_communication(l, net, n, dev):
    """Seconds of the pooled vector's sum over the C blocks (seq.sum) and its backward."""
    return 2 * costmodel.allreduce_time("ring", l.cp, n * width(net) * FLOAT_BYTES, dev.alpha, dev.beta)


def context_communication(l, net, n, kept, dev):
    """Seconds of a context-parallel (or cp x tp) step's collectives, a rank keeping `kept`
    parameters (see the module's docstring)."""
    grads = costmodel.allreduce_time("ring", l.dp * l.cp, kept * FLOAT_BYTES, dev.alpha, dev.beta)
    return (attention_communication(l, attention_layers(net), n, dev) + row_tensor_communication(
        l, net.tensor_traffic(), n, dev) + pooled_communication(l, net, n, dev) + grads)
