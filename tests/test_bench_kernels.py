"""Where the step's time goes (manual_dp.bench.kernels): oneDNN's verbose lines and MXNet's profiler
read into rows, FLOPs of a problem against a hand count, and real runs on a tiny batch of LeNet and
the transformer."""
import json
import subprocess
import sys

from manual_dp.bench.kernels import BEGIN, END, OPERATORS, problem_flops, read_operators, read_verbose

SAMPLE = [
    "dnnl_verbose,info,oneDNN v2.4.4",
    "dnnl_verbose,exec,cpu,convolution,jit:avx2,forward_training,src_f32::blocked:aBcd8b:f0,,"
    "alg:convolution_direct,mb8_ic24oc56_ih13oh9kh5sh1dh0ph0_iw13ow9kw5sw1dw0pw0,9.0",   # warm-up: not counted
    BEGIN,
    "dnnl_verbose,exec,cpu,convolution,jit:avx2,forward_training,src_f32::blocked:aBcd8b:f0,,"
    "alg:convolution_direct,mb8_ic24oc56_ih13oh9kh5sh1dh0ph0_iw13ow9kw5sw1dw0pw0,2.0",
    "dnnl_verbose,exec,cpu,convolution,jit:avx2,forward_training,src_f32::blocked:aBcd8b:f0,,"
    "alg:convolution_direct,mb8_ic24oc56_ih13oh9kh5sh1dh0ph0_iw13ow9kw5sw1dw0pw0,1.0",
    "dnnl_verbose,exec,cpu,inner_product,x64:gemm:jit,backward_data,src_f32::blocked:ab:f0,,,mb8ic896oc128,0.5",
    "dnnl_verbose,exec,cpu,reorder,jit:blk,undef,src_f32::blocked:aBcd8b:f0 dst_f32::blocked:abcd:f0,,,8x24x26x26,0.25",
    END,
    "step cpu ms per image 0.75",
]


def test_flops_of_a_problem_match_a_hand_count():
    # conv2 padded to 8: 9x9 outputs x 56 filters x 24 input channels x 5x5 taps, 2 FLOPs each
    assert problem_flops("convolution", "mb1_ic24oc56_ih13oh9kh5sh1dh0ph0_iw13ow9kw5sw1dw0pw0") \
        == 2 * 9 * 9 * 56 * 24 * 25
    assert problem_flops("inner_product", "mb128ic896oc128") == 2 * 128 * 896 * 128
    assert problem_flops("reorder", "8x24x26x26") == 0


def test_only_the_measured_steps_are_read_and_calls_of_one_problem_add_up():
    rows, step_ms = read_verbose(SAMPLE)
    assert step_ms == 0.75
    conv = [r for r in rows if r["primitive"] == "convolution"]
    assert len(conv) == 1 and conv[0]["calls"] == 2 and conv[0]["ms"] == 3.0    # not the warm-up's 9
    assert rows[0] is conv[0]                                                       # the slowest first
    assert {r["primitive"] for r in rows} == {"convolution", "inner_product", "reorder"}
    assert sum(r["ms"] for r in rows) == 3.75


def test_a_real_run_lists_the_convolutions_and_their_limit():
    done = subprocess.run([sys.executable, "-m", "manual_dp.bench.kernels", "--batch", "8", "--steps", "1",
                           "--conv-pad", "8"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    conv2 = {tuple(line.split()[-2:]) for line in out.splitlines() if " convolution " in line}
    for direction in ("forward_training", "backward_data", "backward_weights"):  # conv2, padded to 24 and 56
        assert (direction, "mb8_ic24oc56_ih13oh9kh5sh1dh0ph0_iw13ow9kw5sw1dw0pw0") in conv2, out
    assert "the convolutions alone:" in out and "commit" in out.splitlines()[0]


def test_the_profilers_operators_are_read_slowest_first():
    stats = {"transpose": {"Count": 16, "Total": 2.0}, "_backward_FullyConnected": {"Count": 40, "Total": 9.5}}
    rows, step_ms = read_operators(["warm-up line", BEGIN, END, OPERATORS + json.dumps(stats),
                                    "step cpu ms per image 0.166"])
    assert step_ms == 0.166
    assert [(r["operator"], r["calls"], r["ms"]) for r in rows] == [("_backward_FullyConnected", 40, 9.5),
                                                                   ("transpose", 16, 2.0)]


def test_a_real_run_of_the_transformer_lists_its_operators_and_dense_layers():
    done = subprocess.run([sys.executable, "-m", "manual_dp.bench.kernels", "--model", "transformer", "--layers", "1",
                           "--batch", "4", "--steps", "1"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout.splitlines()
    ops = {line.split()[-1] for line in out if line.endswith(("FullyConnected", "batch_dot", "softmax"))}
    assert {"FullyConnected", "_backward_FullyConnected", "batch_dot", "softmax"} <= ops, out
    # the query projection's forward on 4 images of 28 tokens: (112, 64) x (64, 64)
    assert any("inner_product" in line and line.endswith("forward_training  mb112ic64oc64") for line in out), out
    assert any(line.startswith("the inner products (dense layers) alone:") for line in out), out
    assert "--model transformer" in out[0] and "commit" in out[0]


def test_a_real_run_of_the_gpt_reads_byte_windows():
    done = subprocess.run([sys.executable, "-m", "manual_dp.bench.kernels", "--model", "gpt", "--layers", "1",
                           "--batch", "4", "--steps", "1"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout.splitlines()
    assert any(line.endswith("log_softmax") for line in out), out               # the next token's loss
    # the query projection's forward on 4 windows of 64 tokens: (256, 128) x (128, 128)
    assert any("inner_product" in line and line.endswith("forward_training  mb256ic128oc128") for line in out), out


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("def net():\n    return 42\n")
    for argv in (["--batch", "0"], ["--model", "transformer", "--conv-pad", "8"], ["--model", "transformer", "--heads", "5"],
                 ["--model", f"{broken}:net"]):
        done = subprocess.run([sys.executable, "-m", "manual_dp.bench.kernels", *argv],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, (argv, done.stderr)
