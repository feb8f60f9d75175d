"""LeNet's arithmetic against a hand count, and the GEMM peak as a plausible figure."""
from manual_dp.flops import flops_per_image, gemm_peak, layer_macs
from manual_dp.lesson import lenet_shapes


def test_layer_macs_by_hand():
    conv1 = 20 * 26 * 26 * (1 * 3 * 3)      # 20 maps of 26x26, 3x3 taps over 1 channel
    conv2 = 50 * 9 * 9 * (20 * 5 * 5)       # after 2x2 pooling: 13x13 in, 9x9 out, 5x5 over 20
    dense1, dense2 = 800 * 128, 128 * 10    # 50 * 4 * 4 = 800 inputs after the second pooling
    assert layer_macs() == [conv1, conv2, dense1, dense2] == [121_680, 2_025_000, 102_400, 1_280]


def test_wider_lenet_by_hand():
    shapes = [shape for _, shape in lenet_shapes(2)]
    assert layer_macs(shapes=shapes) == [2 * 121_680, 4 * 2_025_000, 4 * 102_400, 2 * 1_280]


def test_training_flops_by_hand():
    forward, total = flops_per_image()
    assert forward == 2 * 2_250_360 == 4_500_720
    # backward: weight gradients of all four layers, input gradients of the last three
    assert total - forward == 2 * (2_250_360 + 2_250_360 - 121_680) == 8_758_080


def test_gemm_peak_is_a_plausible_figure():
    peak = gemm_peak(n=256, repeats=1)
    assert set(peak) == {"dot", "fully_connected"}
    assert all(0.1 < g < 1e5 for g in peak.values()), peak
