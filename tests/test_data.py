import gzip

import numpy as np
import pytest

from conftest import write_dataset, write_idx
from manual_dp.datasets import fashion_mnist as data
from manual_dp.datasets.contract import batches
from manual_dp.datasets.fashion_mnist import DataError, load_fashion_mnist


def test_loads_shapes_dtypes_and_ranges(data_dir):
    (Xtr, ytr), (Xte, yte) = load_fashion_mnist(data_dir)
    assert Xtr.shape == (600, 1, 28, 28) and Xte.shape == (200, 1, 28, 28)
    assert Xtr.dtype == np.float32 and ytr.dtype == np.int32
    assert 0 <= Xtr.min() and Xtr.max() <= 1 and set(np.unique(ytr)) <= set(range(10))


def test_train_and_test_size_take_the_first_examples(data_dir):
    (Xall, yall), _ = load_fashion_mnist(data_dir)
    (X, y), (Xt, yt) = load_fashion_mnist(data_dir, train_size=50, test_size=20)
    assert len(X) == 50 and len(Xt) == 20
    np.testing.assert_array_equal(X, Xall[:50])


def test_values_match_the_bytes_on_disk(tmp_path):
    write_dataset(tmp_path, n_train=30, n_test=10)
    with gzip.open(tmp_path / "train-images-idx3-ubyte.gz") as f:
        raw = np.frombuffer(f.read()[16:], dtype=np.uint8).reshape(30, 28, 28)
    (X, _), _ = load_fashion_mnist(tmp_path)
    np.testing.assert_array_equal(X[:, 0], raw / np.float32(255))


def corrupt(directory, name, how):
    path = directory / name
    if how == "truncate":
        with gzip.open(path) as f:
            raw = f.read()
        with gzip.open(path, "wb") as f:
            f.write(raw[:-100])
    elif how == "not-gzip":
        path.write_bytes(b"this is not gzip at all")
    elif how == "bad-magic":
        write_idx(path, np.zeros((30, 28, 28), np.uint8), 1234)
    elif how == "cut-gzip":
        path.write_bytes(path.read_bytes()[:200])
    elif how == "count-mismatch":
        write_idx(path, np.zeros((29,), np.uint8), 2049)
    elif how == "bad-label":
        write_idx(path, np.full((30,), 42, np.uint8), 2049)


@pytest.mark.parametrize("name,how", [
    ("train-images-idx3-ubyte.gz", "truncate"),
    ("train-images-idx3-ubyte.gz", "not-gzip"),
    ("train-images-idx3-ubyte.gz", "bad-magic"),
    ("t10k-images-idx3-ubyte.gz", "cut-gzip"),
    ("train-labels-idx1-ubyte.gz", "count-mismatch"),
    ("train-labels-idx1-ubyte.gz", "bad-label"),
])
def test_corrupt_files_get_a_clear_error_naming_the_file(tmp_path, name, how):
    write_dataset(tmp_path, n_train=30, n_test=10)
    corrupt(tmp_path, name, how)
    with pytest.raises(DataError, match=name.replace(".", r"\.")):
        load_fashion_mnist(tmp_path)


def test_missing_dir_and_missing_files(tmp_path):
    with pytest.raises(DataError, match="does not exist.*dataset-fashion-mnist"):
        load_fashion_mnist(tmp_path / "nope")
    write_dataset(tmp_path, n_train=30, n_test=10)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DataError, match="lacks t10k-labels-idx1-ubyte.gz"):
        load_fashion_mnist(tmp_path)


def test_search_order_env_var_first_and_alone(tmp_path, monkeypatch, data_dir):
    monkeypatch.setenv("MANUAL_DP_DATA", str(data_dir))
    assert data.find_data_dir() == data_dir
    monkeypatch.setenv("MANUAL_DP_DATA", str(tmp_path / "empty"))
    monkeypatch.setattr(data, "DEBIAN_DIR", str(data_dir))
    with pytest.raises(DataError, match=r"\$MANUAL_DP_DATA=.*empty does not exist"):
        data.find_data_dir()  # no silent fall back to another copy


def test_offline_download_fails_with_instructions_and_leaves_no_partial_file(tmp_path, monkeypatch):
    monkeypatch.delenv("MANUAL_DP_DATA", raising=False)
    monkeypatch.setattr(data, "DEBIAN_DIR", str(tmp_path / "debian"))
    monkeypatch.setattr(data, "MXNET_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(data, "DOWNLOAD_URL", "http://127.0.0.1:9/")  # nothing listens there
    with pytest.raises(DataError, match="download of .* failed.*apt-get install -y dataset-fashion-mnist"):
        data.find_data_dir()
    assert not list((tmp_path / "cache").glob("*.part"))
    with pytest.raises(DataError, match="not found in"):
        data.find_data_dir(allow_download=False)


def test_batches_cover_everything_once_and_shuffle_from_the_rng():
    X, y = np.arange(10, dtype=np.float32)[:, None], np.arange(10)
    plain = list(batches(X, y, 4))
    assert [len(b) for b, _ in plain] == [4, 4, 2]
    a = np.concatenate([yb for _, yb in batches(X, y, 4, np.random.default_rng(1))])
    b = np.concatenate([yb for _, yb in batches(X, y, 4, np.random.default_rng(1))])
    np.testing.assert_array_equal(a, b)
    assert sorted(a) == list(range(10)) and list(a) != list(range(10))
