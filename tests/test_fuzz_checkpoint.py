"""Damaged checkpoints at random bytes (fixed seeds): every one is refused with a CheckpointError,
or, where the damage hit bytes the format ignores, loads exactly what was saved."""
import numpy as np
import pytest

from manual_dp import checkpoint
from manual_dp.errors import CheckpointError
from manual_dp.lesson import LENET_SHAPES


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A real checkpoint's bytes, and the state and meta it holds."""
    d = tmp_path_factory.mktemp("ck")
    rng = np.random.RandomState(0)
    params = [rng.randn(*shape).astype(np.float32) for _, shape in LENET_SHAPES]
    state = {"params": params, "opt_state": [[p * 0.5] for p in params], "t": 7, "extra": {}}
    meta = {"epoch": 2, "history": [{"epoch": 1}, {"epoch": 2}], "config": {"lr": 0.05},
            "rng_state": np.random.default_rng(0).bit_generator.state}
    checkpoint.save(d, state, meta)
    return (d / checkpoint.NAME).read_bytes(), checkpoint.load(d)


def same(a, b):
    (sa, ma), (sb, mb) = a, b
    return ma == mb and sa["t"] == sb["t"] and all(
        np.array_equal(x, y) for x, y in zip(sa["params"] + sum(sa["opt_state"], []),
                                             sb["params"] + sum(sb["opt_state"], [])))


@pytest.mark.parametrize("seed", range(8))
def test_random_damage_is_refused_or_harmless(saved, tmp_path, seed):
    raw, want = saved
    rng = np.random.RandomState(seed)
    outcomes = {"refused": 0, "harmless": 0}
    for case in range(25):
        damaged = bytearray(raw)
        if case % 5 == 4:                                    # truncated
            damaged = damaged[:rng.randint(0, len(raw))]
        else:                                                # 1 to 8 bytes overwritten
            for _ in range(rng.randint(1, 9)):
                damaged[rng.randint(0, len(raw))] = rng.randint(0, 256)
        (tmp_path / checkpoint.NAME).write_bytes(bytes(damaged))
        try:
            got = checkpoint.load(tmp_path)
        except CheckpointError as e:
            assert str(e).startswith(str(tmp_path)), e
            outcomes["refused"] += 1
            continue
        assert same(got, want), f"case {case}: damaged checkpoint loaded with other contents"
        outcomes["harmless"] += 1
    assert outcomes["refused"] > 0
