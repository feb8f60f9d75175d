"""The planner's predictions for a layout (planner/layouts.py) of a model (models.contract): bytes on
the busiest device, and seconds per step. Every count is read off the model's layers: parameter
sizes from Layer.params, stages from Model.cuts, tensor shards from each Param's split, FLOPs from
Layer.flops, activations from Layer.inputs and Layer.acts (manual_dp.memory), tensor traffic from
Model.tensor_traffic.

Memory, per device, in float32 bytes (4 a number), for a model of N parameters (ZeRO under a 16-bit
--precision below):
  parameters + gradients + optimiser state (sgd 0, momentum 1, adam 2 copies of the parameters),
    data       N + N + cN on every device (and the running statistics of a model with BatchNorm,
               whole on every device, in ZeRO's stages too)
    zero 1     N + N + c n_i        (n_i: device i's shard of the flat vector, fast.collectives.chunk_bounds)
    zero 2     N + n_i + c n_i      plus the gradient pieces a layer's reduce-scatter holds
    zero 3     n_i + n_i + c n_i    plus the layer gathered (and its gradient, where autograd makes it)
    tensor     (2 + c) x (split parameters / T + the unsplit ones)   (Param.split), with or without SP
    context    N + N + cN on every context (whole parameters, 1/C of the tokens); cp x tp (a C x T
               grid) as tensor on every block
    pipeline   P_d + P_d + c P_d    (P_d: the parameters of device d's stages, Model.cuts)
    mesh       (2 + c) x (device d's stages' split parameters / T + their unsplit ones); pp x cp
               with T = 1: the stages' whole parameters
  zero under --precision bf16|fp16 (strategies/zero/zero_mixed.py, DeepSpeed's layout): the parameters and
    gradients above in 2 bytes, the optimiser state c n_i beside a float32 master shard n_i, so
    2N + 2N + 4(1 + c) n_i, 2N + 2 n_i + 4(1 + c) n_i, 2 n_i + 2 n_i + 4(1 + c) n_i bytes
    (adam: 2 + 2 + 12 a parameter, sharded as the stage says); transients in 2 bytes, every layer's
    gradient from autograd (models.precise runs dense layers as blocks; bf16 on a CPU without
    native bf16 sums its pieces on float32 copies, more than priced). Every other
    layout keeps float32 parameters, gradients and state under any precision (PyTorch AMP's layout).
  ZeRO's transients are counted from strategies/zero/zero_layers.py: the moments of a step (each
  layer's fetch; in the backward the layer fetched again, with its whole gradient unless a dense
  layer's is made by hand, a piece at a time; each reduce of a shard's piece) and what each device
  holds then; the moment with the most bytes over all devices is the peak (as ZeroRedundancy's
  Peak picks it).
  Activations per example (memory.stage_activation_elems for a whole network on one device, each
  layer's output once; memory.part_activation_elems for a stage's layers and its received input),
  times the examples held at the peak: data and ZeRO the device's shard of the batch; tensor,
  sequence parallel and context layouts planner/sequence.py (1/T or 1/C of the group's examples',
  plus what runs whole on every rank: the strategies' layout() counts the same; cp x tp 1/(C T),
  ContextTensorParallel's floor); pipelines planner/pipelines.py (the micro-batches each schedule
  holds per stage, schedules.held); dp x pp x tp planner/pipelines.py (those micro-batches,
  tensor-split as tensor layouts price them; with cp 1/(C T) of them and the images whole on the
  first stage, MeshParallel's floor).
Not counted: MXNet's workspace, the optimiser's and the collectives' temporaries, the batch itself.

Time, per step, no overlap of compute and communication:
  compute = FLOPs (Layer.flops; backward twice forward but for the first layer's input gradient)
  of the busiest device / the device's rate (ZeRO 2 and 3 forward layers 0..L-2 once more,
  recompute each stage once more; context 1/C of the group's); pipelines planner/pipelines.py
  (M ticks of the slowest device, the bubble from the schedule's simulation). Communication
  priced by costmodel's alpha-beta terms:
  data one ring all-reduce of 4N bytes (2N under a 16-bit --precision, as ZeRO's collectives below);
  ZeRO 1 a reduce-scatter and an all-gather (each half a
  ring all-reduce); ZeRO 2 one reduce-scatter per layer and an all-gather; ZeRO 3 an all-gather per
  layer in forward (but the last) and backward and a reduce-scatter per layer (a layer without
  parameters, a Flatten, none: ZeroRedundancy.fetch and reduce skip it); tensor one ring
  all-reduce over the tensor group of n x elements x 4 bytes per entry of Model.tensor_traffic
  (Megatron's g on a row-parallel layer's partial output in forward, f on a column-parallel
  layer's input gradient in backward; LeNet: 4,050 + 800 + 10 values an example), then the
  data-parallel all-reduce of 4N/T bytes (sequence parallelism sends the same bytes as an
  all-gather and a reduce-scatter, priced the same); context planner/sequence.py (ring hops or
  Ulysses' all-to-alls per attention layer, cp x tp on each rank's H/T heads with the tensor
  collectives on a block of tokens, and the gradient all-reduce over dp x cp); pipelines the
  boundary copies (activation forward, gradient back, per micro-batch) and each device's
  all-reduce over dp; dp x pp x tp planner/pipelines.py (compute per stage / T and the schedule's
  bubble, the tensor collectives inside each stage group, the boundary copies, the all-reduce over
  dp; with cp compute per stage / (C T), the attention's collectives per micro-batch as for
  context, the all-reduce over dp x cp).
On CPU contexts (--verify) the devices share one machine: their work runs one after another
(measured: 8 contexts took as long as 8 one-context steps on their shares), so compute is every
device's FLOPs over the measured rate of one device's share, with no bubble.
"""
from collections import namedtuple

from .. import costmodel
from ..fast.collectives import chunk_bounds
from ..lesson import shard_sizes
from ..memory import FLOAT_BYTES, stage_activation_elems
from ..config import PRECISION_BYTES as BYTES
from ..strategies.zero.zero_layers import hand_made
from . import pipelines, sequence
from .layouts import model_of

OPT_COPIES = {"sgd": 0, "momentum": 1, "adam": 2}
# What is laid out: `model` (a models.Model; None: the lesson's LeNet of `width`), the global batch
# and the optimiser.
Setting = namedtuple("Setting", "width batch optimizer model precision", defaults=(None, "fp32"))
# A device type: FLOP/s it sustains, the link's latency (s) and s/byte, whether devices share cores.
Device = namedtuple("Device", "name rate alpha beta shared")
GPU_RATE = 5e12   # stated: a V100-class GPU at about a third of its 15.7 TFLOP/s fp32 peak on LeNet's layers
LINK_NAMES = {"pcie": "PCIe 3.0 x16", "nvlink": "NVLink (V100)", "eth25": "25 Gb/s Ethernet",
              "eth100": "100 Gb/s Ethernet"}
CPU_LINK = (20e-6, 5e9)   # stated: CPU contexts read each other's arrays in place: an op launch, memory speed


def gpu(link):
    """The device type of --link: a GPU at GPU_RATE on costmodel.LINKS[...]."""
    alpha, bandwidth = costmodel.LINKS[LINK_NAMES[link]]
    return Device(f"GPU at {GPU_RATE / 1e12:g} TFLOP/s, {LINK_NAMES[link]}", GPU_RATE, alpha, 1 / bandwidth, False)


def cpu(rate):
    """CPU contexts of this machine, sharing its cores, at `rate` FLOP/s (measured)."""
    return Device(f"CPU contexts sharing {rate / 1e9:.1f} GFLOP/s", rate, CPU_LINK[0], 1 / CPU_LINK[1], True)


def net_of(setting):
    """The models.Model the setting lays out: its model, or the lesson's LeNet of its width."""
    return model_of(setting.width, setting.model)


def layer_sizes(net):
    """Parameters of each layer of the model (Layer.params), in order."""
    return [sum(p.size for p in layer.params) for layer in net.layers]


def zero_moments(stage, net, bounds, by_hand=True):
    """The transient elements each device holds at each moment of a ZeRO 2/3 step, in step order
    (strategies/zero/zero_layers.py): the largest moment over all devices. by_hand False: no layer's
    gradient is made by hand (a model in a precision: models.precise runs dense layers as blocks)."""
    layers, k, L = layer_sizes(net), len(bounds) - 1, len(net.layers)
    starts = [sum(layers[:l]) for l in range(L + 1)]
    moments = [[layers[l]] * k for l in range(L - 1)] if stage == 3 else []   # forward fetches
    for l in reversed(range(L)):
        grad = not (by_hand and hand_made(net.layers[l], l == L - 1))   # autograd holds the layer's gradient whole
        if stage == 3 or grad:            # fetched parameters (stage 3), the gradient beside them
            moments.append([layers[l] * ((stage == 3) + grad)] * k)
        for i in range(k):               # one reduce per owner's piece: a piece everywhere, twice on i
            piece = max(0, min(bounds[i + 1], starts[l + 1]) - max(bounds[i], starts[l]))
            if piece:
                moments.append([piece * (2 if j == i else 1) for j in range(k)])
    return max(moments, key=sum, default=[0] * k)


def per_device_state(l, setting):
    """[(parameter + gradient + state elements, transient elements)] per device of one replica."""
    net, c = net_of(setting), OPT_COPIES[setting.optimizer]
    layers = layer_sizes(net)
    n = sum(layers)
    stats = sum(p.size for p in net.stats())       # running statistics (BatchNorm's): whole on every context
    if l.kind == "data":
        return [((2 + c) * n + stats, 0)] * l.dp
    if l.kind in ("context", "tensor"):   # split parameters 1/T each (Param.split), the others whole
        return [((2 + c) * rank_params(l, net) + stats, 0)] * (l.cp * l.tp)   # on every rank (cp alone: T = 1)
    if l.kind == "mesh":
        return [(kept, 0) for kept in pipelines.mesh_state(l, net, c)]
    if l.kind == "pipeline":
        return [((2 + c) * kept, 0) for kept in pipelines.devices_of(
            l, [sum(layers[p] for p in pieces) for pieces in pipelines.stage_cuts(l, net)])]
    bounds = chunk_bounds(n, l.dp)
    shards = [b - a for a, b in zip(bounds, bounds[1:])]
    keep = {1: lambda s: 2 * n + c * s, 2: lambda s: n + (1 + c) * s, 3: lambda s: (2 + c) * s}[l.zero_stage]
    moment = zero_moments(l.zero_stage, net, bounds) if l.zero_stage > 1 else [0] * l.dp
    return [(keep(s) + stats, m) for s, m in zip(shards, moment)]


def rank_params(l, net):
    """Parameter elements a tensor rank keeps: the split ones 1/T (Param.split), the rest whole."""
    return sum(p.size // l.tp if p.split is not None else p.size for p in net.param_table())


def per_device_bytes(l, setting):
    """[(parameter + gradient + state bytes, transient bytes)] per device of one replica: float32
    (per_device_state), but ZeRO under a 16-bit precision in its mixed layout (the module's table)."""
    state = per_device_state(l, setting)
    low = BYTES[setting.precision]
    if l.kind != "zero" or low == FLOAT_BYTES:
        return [(kept * FLOAT_BYTES, moment * FLOAT_BYTES) for kept, moment in state]
    net, c = net_of(setting), OPT_COPIES[setting.optimizer]
    n = sum(layer_sizes(net))
    bounds = chunk_bounds(n, l.dp)
    held = {1: lambda s: 2 * n, 2: lambda s: n + s, 3: lambda s: 2 * s}[l.zero_stage]    # parameters + gradients
    moments = zero_moments(l.zero_stage, net, bounds, by_hand=False) if l.zero_stage > 1 else [0] * l.dp
    return [(low * held(b - a) + FLOAT_BYTES * (1 + c) * (b - a), low * moment)
            for a, b, moment in zip(bounds, bounds[1:], moments)]


def activation_elems(l, setting):
    """Activation elements held at the peak by each device of replica 0 (the largest shard)."""
    net, n = net_of(setting), shard_sizes(setting.batch, l.dp)[0]
    if l.kind in ("data", "zero"):
        whole = sum(stage_activation_elems(model=net))            # every layer's output once
        return [whole * m for m in shard_sizes(setting.batch, l.dp)]
    if l.kind == "tensor":
        return sequence.tensor_activations(l, net, n)
    if l.kind == "context":
        return sequence.context_activations(l, net, n)
    if l.kind == "mesh":
        return pipelines.mesh_activations(l, net, n)
    return pipelines.activations(l, net, n)


def memory(l, setting):
    """Predicted bytes of the busiest device: {"state", "activations", "total"} (state: parameters,
    gradients, optimiser state and ZeRO's transients)."""
    state, acts = per_device_bytes(l, setting), activation_elems(l, setting)
    per = [(kept + moment, a * FLOAT_BYTES) for (kept, moment), a in zip(state, acts)]
    s, a = max(per, key=sum)
    return {"state": int(s), "activations": int(a), "total": int(s + a)}


def half(k, nbytes, dev):
    """Seconds of a ring reduce-scatter or all-gather of nbytes over k devices (half an all-reduce)."""
    return costmodel.allreduce_time("ring", k, nbytes, dev.alpha, dev.beta) / 2


def stage_flops(net, pieces, recompute):
    """FLOPs per example of a stage of the layers `pieces` (Layer.flops): forward, backward (no
    input gradient for layer 0), and the forward again under recompute."""
    flops = [net.layers[p].flops for p in pieces]
    forward = sum(flops)
    backward = sum(f * (1 if p == 0 else 2) for f, p in zip(flops, pieces))
    return forward * (2 if recompute else 1) + backward


def tensor_values(net):
    """Elements per example and step that a tensor group's f and g all-reduce (Model.tensor_traffic:
    for LeNet conv2's unpooled partial output, dense1's input gradient and the scores)."""
    return sum(elems for _, elems, _ in net.tensor_traffic())


def communication(l, setting, dev):
    """Seconds of l's collectives per step on device type dev."""
    net = net_of(setting)
    layers = [FLOAT_BYTES * s for s in layer_sizes(net)]
    total, k = sum(layers), l.dp
    low = BYTES[setting.precision] / FLOAT_BYTES     # --precision: data parallelism's gradients on 16-bit links
    if l.kind == "data":
        return costmodel.allreduce_time("ring", k, total * low, dev.alpha, dev.beta)
    if l.kind == "zero":
        held = [b for b in layers if b]                        # a layer without parameters: no collective
        gathers = {1: [total], 2: [total], 3: [b for b in layers[:-1] if b] + held}[l.zero_stage]
        scatters = [total] if l.zero_stage == 1 else held
        return sum(half(k, b * low, dev) for b in gathers + scatters)     # 16-bit parameters and gradients
    n = shard_sizes(setting.batch, k)[0]
    if l.kind == "tensor":      # each f and g: one all-reduce over the tensor group, as the step sends it
        pairs = sum(costmodel.allreduce_time("ring", l.tp, n * elems * FLOAT_BYTES, dev.alpha, dev.beta)
                    for _, elems, _ in net.tensor_traffic())
        return pairs + costmodel.allreduce_time("ring", k, total / l.tp, dev.alpha, dev.beta)
    if l.kind == "context":
        return sequence.context_communication(l, net, n, rank_params(l, net), dev)
    if l.kind == "mesh":
        return pipelines.mesh_communication(l, net, n, dev)
    return pipelines.communication(l, net, n, layers, low, dev)


def seconds(flops, rate):
    """flops / rate; 0 for a model whose FLOPs are unknown (a user's layers of kinds not counted)."""
    return flops / rate if rate else 0.0


def compute(l, setting, dev):
    """(compute seconds, bubble seconds) of a step of l on device type dev."""
    net, n = net_of(setting), shard_sizes(setting.batch, l.dp)[0]
    L = len(net.layers)
    if l.kind in ("pipeline", "mesh"):
        run = pipelines.mesh_compute if l.kind == "mesh" else pipelines.compute
        return run(l, net, n, setting.batch, dev, seconds)
    flops = stage_flops(net, range(L), False)                     # per example
    if l.kind == "zero" and l.zero_stage > 1:                     # layers 0..L-2 forward again (zero_layers)
        flops += stage_flops(net, range(L - 1), True) - stage_flops(net, range(L - 1), False)
    if dev.shared:                                                # every device's work on one machine
        return seconds(setting.batch * flops, dev.rate), 0.0
    return seconds(n * flops / (l.tp * l.cp), dev.rate), 0.0


def step_time(l, setting, dev):
    """Predicted seconds per step: {"compute", "bubble", "comm", "total"}."""
    work, bubble = compute(l, setting, dev)
    comm = communication(l, setting, dev)
    return {"compute": work, "bubble": bubble, "comm": comm, "total": work + bubble + comm}
