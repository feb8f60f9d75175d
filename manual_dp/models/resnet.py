"""The ResNet-18 of d2l's "concise multi-GPU" chapter under the model contract, channels scaled to train
on CPU contexts: a 3x3 stem, four stages of two residual units (8, 16, 32, 64 channels x --width;
width 8 is d2l's 64..512), global average pooling and a dense layer to 10 classes.

    stem     conv 3x3 (no bias), BatchNorm, ReLU                          (B, c, 28, 28)
    unit     conv 3x3 (stride s), BN, ReLU, conv 3x3, BN, + shortcut, ReLU;
             the first unit of stages 2-4 halves the map (stride 2) and its shortcut is a 1x1
             convolution of stride 2 (d2l's use_1x1conv)                  (B, 2c, 14, 14) ...
    head     global average pooling, dense                               (B, 10)

Each BatchNorm keeps running statistics (Layer.stats); a layer with them runs on every context of
a step at once (Layer.group_forward) so that --sync-batchnorm can sum its statistics across them
(models.batchnorm). Convolutions before a BatchNorm have no bias (the BatchNorm's beta is one).
"""
from mxnet import nd

from ..lesson import relu
from .batchnorm import single
from .contract import CLASSES, IMAGE, Layer, Model, Param, fc

CHANNELS = (8, 16, 32, 64)       # x --width


def conv(hs, Ws, k, c, stride=1, bias=None, F=nd):
    """Each context's h convolved with its W (c, in, k, k), 'same' padding, optional bias."""
    return [F.Convolution(h, W, b, kernel=(k, k), stride=(stride, stride), pad=(k // 2, k // 2),
                          num_filter=c, no_bias=b is None)
            for h, W, b in zip(hs, Ws, bias or [None] * len(hs))]


def make_stem(c):
    def stem(hs, P, moments):
        """conv, BatchNorm, ReLU on every context (P[c] = [W, gamma, beta]); moments.F's operators."""
        h = conv(hs, [p[0] for p in P], 3, c, F=moments.F)
        return [relu(x, moments.F) for x in moments.normalize(h, [p[1] for p in P], [p[2] for p in P])]
    return stem


def make_unit(stride, shortcut, c):
    def unit(hs, P, moments):
        """relu(BN(conv(relu(BN(conv(h))))) + shortcut(h)) on every context; P[c] = [W1, g1, b1,
        W2, g2, b2] (+ [W3, b3], the 1x1 shortcut); moments.F's operators."""
        F = moments.F
        y = conv(hs, [p[0] for p in P], 3, c, stride, F=F)
        y = [relu(x, F) for x in moments.normalize(y, [p[1] for p in P], [p[2] for p in P])]
        y = moments.normalize(conv(y, [p[3] for p in P], 3, c, F=F), [p[4] for p in P], [p[5] for p in P])
        skip = conv(hs, [p[6] for p in P], 1, c, stride, [p[7] for p in P], F) if shortcut else hs
        return [relu(a + b, F) for a, b in zip(y, skip)]
    return unit


def head(h, p, F=nd, shapes=None):
    pooled = F.mean(h, axis=(2, 3))                                            # (B, c)
    return fc(pooled, p[0], p[1], F, shapes[0] if shapes else None)           # (B, 10)


class ResNet(Model):
    """ResNet-18 of CHANNELS x `width` channels (see the module docstring)."""
    name = "resnet"

    def __init__(self, width=1):
        self.config = {"width": width}
        chans = [c * width for c in CHANNELS]
        side, layers, self.group = IMAGE[1], [], {"stem": make_stem(chans[0])}

        def bn(prefix, c):
            return ([Param(f"{prefix}_gamma", (c,), "ones"), Param(f"{prefix}_beta", (c,))],
                    [Param(f"{prefix}_mean", (c,)), Param(f"{prefix}_var", (c,), "ones")])
        g, s = bn("stem_bn", chans[0])
        conv_flops = 2 * side * side * chans[0] * 9 * IMAGE[0]
        layers.append(Layer("stem", tuple([Param("stem_w", (chans[0], IMAGE[0], 3, 3), "he", 9 * IMAGE[0])] + g),
                            single(self.group["stem"]), conv_flops, side * side * IMAGE[0], 3 * side * side * chans[0],
                            "block", stats=tuple(s)))
        c_in = chans[0]
        for stage, c in enumerate(chans):
            for r in range(2):
                down = stage > 0 and r == 0
                stride, name = (2 if down else 1), f"stage{stage + 1}_unit{r + 1}"
                g1, s1 = bn(f"{name}_bn1", c)
                g2, s2 = bn(f"{name}_bn2", c)
                params = [Param(f"{name}_w1", (c, c_in, 3, 3), "he", 9 * c_in)] + g1 + \
                         [Param(f"{name}_w2", (c, c, 3, 3), "he", 9 * c)] + g2
                out = -(-side // stride)
                flops = 2 * out * out * c * 9 * (c_in + c)
                if down:
                    params += [Param(f"{name}_w3", (c, c_in, 1, 1), "he", c_in), Param(f"{name}_b3", (c,))]
                    flops += 2 * out * out * c * c_in
                self.group[name] = make_unit(stride, down, c)
                layers.append(Layer(name, tuple(params), single(self.group[name]), flops,
                                    side * side * c_in, 8 * out * out * c, "block", stats=tuple(s1 + s2)))
                side, c_in = out, c
        layers.append(Layer("head", (Param("head_w", (CLASSES, c_in), "lecun", c_in), Param("head_b", (CLASSES,))),
                            head, 2 * c_in * CLASSES, side * side * c_in, c_in + 3 * CLASSES + 1, "head"))
        self.layers = tuple(layers)

    def layer_group(self, l, hs, own, moments, Fs=None):
        """Layer l on every context at once, its BatchNorms normalising with `moments`."""
        name = self.layers[l].name
        return self.group[name](hs, own, moments) if name in self.group else \
            super().layer_group(l, hs, own, moments, Fs)
