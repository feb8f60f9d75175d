"""Damaged IDX .gz files, at random bytes with fixed seeds: the loader either returns the very
arrays of the intact files (gzip's CRC guards the content, so a harmless change, say in the
header's time stamp, cannot alter them) or raises DataError naming the damaged file, never
anything else."""
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import write_dataset, write_idx
from manual_dp.datasets.fashion_mnist import FILES, DataError, load_fashion_mnist

REAL_LABELS = Path("/usr/share/datasets/fashion-mnist/t10k-labels-idx1-ubyte.gz")


def damaged(raw, rng, kind):
    """`raw` with 4 random bytes at a random offset replaced ("bytes") or cut short ("truncate")."""
    if kind == "truncate":
        return raw[:rng.integers(0, len(raw))]
    at = int(rng.integers(0, len(raw) - 3))
    return raw[:at] + rng.integers(0, 256, 4, dtype=np.uint8).tobytes() + raw[at + 4:]


def fuzz(directory, names, cases, kind, seed):
    """Load `directory` `cases` times, each time with one of `names` damaged; returns how many
    loads succeeded and how many raised DataError (another exception fails the test)."""
    want = load_fashion_mnist(directory, allow_download=False)
    pristine = {name: (directory / name).read_bytes() for name in names}
    rng, outcomes = np.random.default_rng(seed), {"loaded": 0, "refused": 0}
    for case in range(cases):
        name = names[case % len(names)]
        (directory / name).write_bytes(damaged(pristine[name], rng, kind))
        try:
            got = load_fashion_mnist(directory, allow_download=False)
        except DataError as e:
            assert name in str(e), (case, str(e))
            outcomes["refused"] += 1
        else:
            for a, b in zip(sum(got, ()), sum(want, ())):  # X_train, y_train, X_test, y_test
                np.testing.assert_array_equal(a, b, err_msg=f"case {case}: {name} loaded other values")
            outcomes["loaded"] += 1
        finally:
            (directory / name).write_bytes(pristine[name])
    return outcomes


ALL = [name for imgs, lbls, _ in FILES.values() for name in (imgs, lbls)]


@pytest.mark.parametrize("kind,cases,seed", [("bytes", 200, 13), ("truncate", 60, 14)])
def test_damaged_synthetic_files_load_intact_or_raise_data_error(tmp_path, kind, cases, seed):
    write_dataset(tmp_path, n_train=60, n_test=20)
    outcomes = fuzz(tmp_path, ALL, cases, kind, seed)
    assert outcomes["refused"] > 0 and sum(outcomes.values()) == cases, outcomes
    if kind == "bytes":  # the 10-byte gzip header has fields nobody checks
        assert outcomes["loaded"] > 0, outcomes


@pytest.mark.skipif(not REAL_LABELS.is_file(), reason="Debian's dataset-fashion-mnist is not installed")
@pytest.mark.parametrize("kind,cases,seed", [("bytes", 40, 15), ("truncate", 15, 16)])
def test_damaged_real_label_file_loads_intact_or_raises_data_error(tmp_path, kind, cases, seed):
    """A copy of the real test labels, next to 10000 blank test images and a small train split."""
    write_dataset(tmp_path, n_train=60, n_test=20)
    shutil.copy(REAL_LABELS, tmp_path / REAL_LABELS.name)
    write_idx(tmp_path / FILES["test"][0], np.zeros((10000, 28, 28), np.uint8), 2051)
    outcomes = fuzz(tmp_path, [REAL_LABELS.name], cases, kind, seed)
    assert outcomes["refused"] > 0 and sum(outcomes.values()) == cases, outcomes
