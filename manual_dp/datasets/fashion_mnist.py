"""Fashion-MNIST: find the IDX files, verify and load them (images (N, 1, 28, 28) in [0, 1], 10 classes)."""
import gzip
import os
import struct
import urllib.request
import zlib
from pathlib import Path

import numpy as np

from ..errors import DataError

FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", 60000),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz", 10000),
}
DEBIAN_DIR = "/usr/share/datasets/fashion-mnist"
MXNET_CACHE = "~/.mxnet/datasets/fashion-mnist"
DOWNLOAD_URL = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
HOW_TO_GET = ("install Debian's package (apt-get install -y dataset-fashion-mnist) "
              "or pass --data-dir DIR holding the four IDX .gz files")


NAMES = [name for imgs, lbls, _ in FILES.values() for name in (imgs, lbls)]


def missing_files(d, label):
    """The names among NAMES that directory `d` lacks (all, if it is no directory); DataError
    with `label` if `d` cannot be searched."""
    try:
        return [n for n in NAMES if not (d / n).is_file()]
    except OSError as e:
        raise DataError(f"{label} cannot be read ({e.strerror}); {HOW_TO_GET}") from None


def check_dir(d, label):
    """Returns once directory `d` holds all four files; else DataError saying what `label` lacks."""
    missing = missing_files(d, label)
    if missing and not d.is_dir():
        raise DataError(f"{label} {'is not a directory' if d.exists() else 'does not exist'}; {HOW_TO_GET}")
    if missing:
        raise DataError(f"{label} lacks {', '.join(missing)}; {HOW_TO_GET}")


def candidate_dirs(data_dir=None):
    """[(directory, label)] to search in order: --data-dir alone if given, else $MANUAL_DP_DATA
    alone if set (non-empty); else Debian's package, then MXNet's cache."""
    if data_dir is not None:
        return [(Path(data_dir), f"--data-dir {data_dir}")]
    if os.environ.get("MANUAL_DP_DATA"):
        return [(Path(os.environ["MANUAL_DP_DATA"]), f"$MANUAL_DP_DATA={os.environ['MANUAL_DP_DATA']}")]
    return [(Path(DEBIAN_DIR), f"Debian's package {DEBIAN_DIR}"),
            (Path(MXNET_CACHE).expanduser(), f"MXNet's cache {Path(MXNET_CACHE).expanduser()}")]


def download(dest, url=DOWNLOAD_URL, timeout=20):
    """Fetch the four files into `dest` (atomically, one file at a time)."""
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"Fashion-MNIST not found locally and {dest} cannot be made for a download "
                        f"({e.strerror}); {HOW_TO_GET}") from None
    for imgs, lbls, _ in FILES.values():
        for name in (imgs, lbls):
            if (dest / name).is_file():
                continue
            tmp = dest / (name + ".part")
            try:
                with urllib.request.urlopen(url + name, timeout=timeout) as r, open(tmp, "wb") as f:
                    f.write(r.read())
            except OSError as e:
                tmp.unlink(missing_ok=True)
                raise DataError(f"Fashion-MNIST not found locally and the download of {name} "
                                f"failed ({e}); {HOW_TO_GET}") from None
            os.replace(tmp, dest / name)


def locate_data(data_dir=None, allow_download=True):
    """(directory holding the four files, a label saying where it came from). A --data-dir or a
    $MANUAL_DP_DATA must hold them (DataError otherwise, no other copy is used)."""
    dirs = candidate_dirs(data_dir)
    if len(dirs) == 1:
        check_dir(*dirs[0])
        return dirs[0]
    for d, label in dirs:
        if not missing_files(d, label):
            return d, label
    if not allow_download:
        raise DataError(f"Fashion-MNIST not found in {', '.join(str(d) for d, _ in dirs)}; {HOW_TO_GET}")
    cache, label = dirs[-1]
    download(cache)
    return cache, f"{label} (downloaded)"


def find_data_dir(data_dir=None, allow_download=True):
    """The directory the data set is loaded from (see locate_data)."""
    return locate_data(data_dir, allow_download)[0]


def read_gzip(path):
    """The decompressed bytes of `path`; DataError naming it if it cannot be read or unpacked."""
    try:
        with open(path, "rb") as f:
            packed = f.read()
    except OSError as e:
        raise DataError(f"{path}: cannot be read ({e.strerror})") from None
    try:
        return gzip.decompress(packed)
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(f"{path}: not a readable gzip file ({e})") from None


def read_idx(path, magic, expected_shape):
    """The array stored in a gzipped IDX file, after checking magic number and shape."""
    header_len = 8 if magic == 2049 else 16
    raw = read_gzip(path)
    if len(raw) < header_len:
        raise DataError(f"{path}: truncated header ({len(raw)} bytes)")
    got_magic, *dims = struct.unpack(">" + "I" * (header_len // 4), raw[:header_len])
    if got_magic != magic:
        raise DataError(f"{path}: bad magic number {got_magic}, expected {magic}")
    if tuple(dims[1:]) != tuple(expected_shape[1:]) or dims[0] < 1:
        raise DataError(f"{path}: shape {tuple(dims)} does not match {expected_shape}")
    expected_bytes = int(np.prod(dims))
    if len(raw) - header_len != expected_bytes:
        raise DataError(f"{path}: {len(raw) - header_len} data bytes, header promises {expected_bytes}")
    return np.frombuffer(raw, dtype=np.uint8, offset=header_len).reshape(dims)


def load_split(directory, split):
    """(images float32 (N, 1, 28, 28) in [0, 1], labels int32 (N,)) of one split."""
    imgs_name, lbls_name, _ = FILES[split]
    images = read_idx(Path(directory) / imgs_name, 2051, (None, 28, 28))
    labels = read_idx(Path(directory) / lbls_name, 2049, (None,))
    if len(images) != len(labels):
        raise DataError(f"{Path(directory) / imgs_name}: {len(images)} images "
                        f"but {len(labels)} labels in {lbls_name}")
    if labels.max() > 9:
        raise DataError(f"{Path(directory) / lbls_name}: label {labels.max()} outside 0..9")
    return (images.astype(np.float32) / 255.0)[:, None], labels.astype(np.int32)


def load_fashion_mnist(data_dir=None, train_size=None, test_size=None, allow_download=True):
    """((X_train, y_train), (X_test, y_test)) as numpy arrays, optionally cut to the first N."""
    directory = find_data_dir(data_dir, allow_download)
    (Xtr, ytr), (Xte, yte) = load_split(directory, "train"), load_split(directory, "test")
    return (Xtr[:train_size], ytr[:train_size]), (Xte[:test_size], yte[:test_size])
