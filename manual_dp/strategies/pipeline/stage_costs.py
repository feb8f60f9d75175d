"""What each pipeline action costs, from the model's own FLOPs: the durations a dry run prices a
schedule with (schedules.simulate), instead of one unit an action.

Per layer (models/contract.py: Layer.flops, forward FLOPs per example):

    forward        F = the layer's FLOPs
    input grad     about one forward (a product's gradient with respect to its input is a product
                   of the same size), none for the model's first layer: its input is the images
    weight grad    about one forward (the same argument, with respect to the weights)

Per stage, as strategies/pipeline/pipeline_pass.py runs its actions (config.PIPELINE_COSTS holds the two
ratios to the forward):

    F    the sum of its layers' forwards
    B    unsplit (gpipe, 1f1b, interleaved): every input and weight gradient of its layers
    B    split (zb-h1, SplitPass): the gradient of the stage's input, so the chain of input gradients
         through its layers; nothing on stage 0, whose input is the images (its chain runs in W)
    W    the weight gradients, and the chain of input gradients again (MXNet's autograd.grad walks
         the stage's graph from its output each time), less the stage's first layer's
    --recompute adds the stage's forward to B (run again, recorded, before the backward).

A real zero-bubble split (Qi et al.; the planner's, planner/pipelines.py) computes each layer's
input gradient in B and its weight gradient in W, so B + W is one backward and stage 0's B holds
its later layers' input gradients; SplitPass, on MXNet's autograd, runs the chain once in B (none
on stage 0) and again in W. The dry run prices what runs here, to be compared with what is measured.
"""
from ...config import PIPELINE_COSTS
from .schedules import bubbles, simulate


def layer_costs(net, ratios=None):
    """[(forward, input grad, weight grad)] FLOPs per example of each of the model's layers."""
    ratios = ratios or PIPELINE_COSTS
    return [(layer.flops, ratios["input_grad"] * layer.flops * (i > 0),
             ratios["weight_grad"] * layer.flops * bool(layer.params)) for i, layer in enumerate(net.layers)]


def stage_costs(net, cuts, split, recompute=False, ratios=None):
    """{(phase, stage): FLOPs per example} of every stage of `cuts` (tuples of layer indices, the
    stages in order), phases F and B, and W if `split` (see the module's docstring)."""
    layers, out = layer_costs(net, ratios), {}
    for k, ids in enumerate(cuts):
        F, I, G = (sum(layers[i][j] for i in ids) for j in range(3))
        again = F if recompute else 0
        out[("F", k)] = F
        if not split:
            out[("B", k)] = I + G + again
            continue
        out[("B", k)] = (I if k else 0) + again
        out[("W", k)] = G + I - layers[ids[0]][1]
    return out


def relative(costs):
    """`costs` over the mean forward of a stage: a stage's average forward takes 1."""
    forwards = [c for (phase, _), c in costs.items() if phase == "F"]
    unit = sum(forwards) / len(forwards) or 1
    return {key: c / unit for key, c in costs.items()}


def plan_costs(net, p, recompute=False):
    """{(phase, stage): duration} of plan p's stages (the model cut as the pipelines cut it,
    Model.cuts of p.n_stages), a stage's average forward taking 1."""
    return relative(stage_costs(net, net.cuts(p.n_stages), p.split, recompute))


def priced(p, costs):
    """(idle share of device time, bubble over busy time) of plan p, each action taking costs[(phase, stage)]."""
    return bubbles(p, simulate(p, costs), costs)


def priced_lines(net, p, recompute=False, costs=None, how="the model's FLOPs"):
    """The dry run's lines on the model's costs (or on `costs`, priced by `how`): each phase's
    duration per stage, and the bubble."""
    costs = costs or plan_costs(net, p, recompute)
    share, ratio = priced(p, costs)
    per_stage = "; ".join(f"{ph} " + " ".join(f"{costs[(ph, k)]:.2f}" for k in range(p.n_stages))
                          for ph in "FBW" if (ph, 0) in costs)
    return [f"priced with {how} (a stage's average forward = 1; {per_stage}):",
            f"bubble (idle share of the step): {share:.3f}; the papers' ratio, idle over compute: {ratio:.3f}"]
