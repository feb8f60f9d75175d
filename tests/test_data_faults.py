"""Data faults end in one DataError naming the file or directory: damaged deflate streams,
unreadable directories and files, a $MANUAL_DP_DATA without the data set."""
import gzip
import os
import shutil
import subprocess
import sys
import zlib

import pytest

from conftest import write_dataset
from manual_dp.datasets import fashion_mnist as data
from manual_dp.datasets.fashion_mnist import DataError, load_fashion_mnist, locate_data

# As root, permissions only bind without the capabilities that override them.
AS_USER = ([] if os.geteuid() != 0 else
           ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"])
LOAD = ("import sys\nfrom manual_dp.datasets.fashion_mnist import DataError, load_fashion_mnist\n"
        "try:\n    load_fashion_mnist(sys.argv[1], allow_download=False)\n"
        "except DataError as e:\n    print('DataError:', e)\nelse:\n    print('loaded')\n")


def load_elsewhere(directory):
    """What a process without permission overrides reports on loading `directory`: one line."""
    done = subprocess.run([*AS_USER, sys.executable, "-c", LOAD, str(directory)],
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert done.returncode == 0 and done.stderr == "", done.stderr
    return done.stdout.strip()


needs_setpriv = pytest.mark.skipif(AS_USER and not shutil.which("setpriv"), reason="setpriv is missing")


def test_a_damaged_deflate_stream_is_a_data_error_naming_the_file(tmp_path):
    write_dataset(tmp_path, n_train=30, n_test=10)
    path = tmp_path / "train-labels-idx1-ubyte.gz"
    raw = bytearray(path.read_bytes())
    deflate = raw.index(b"\0", 10) + 1 if raw[3] & 8 else 10  # after the stored file name, if any
    raw[deflate] = 0xFF  # first deflate block: final, of block type 3, which does not exist
    path.write_bytes(bytes(raw))
    with pytest.raises(zlib.error):
        gzip.decompress(bytes(raw))  # what the loader used to let through
    with pytest.raises(DataError, match=rf"^{path}: not a readable gzip file \(.*invalid block type"):
        load_fashion_mnist(tmp_path)


@needs_setpriv
def test_an_unreadable_data_directory_is_one_data_error(tmp_path):
    d = write_dataset(tmp_path / "fashion", n_train=30, n_test=10)
    assert load_elsewhere(d) == "loaded"  # the same process can read it before the chmod
    d.chmod(0)
    try:
        line = load_elsewhere(d)
    finally:
        d.chmod(0o755)
    assert line.startswith(f"DataError: --data-dir {d} cannot be read (Permission denied); "), line


@needs_setpriv
def test_an_unreadable_file_is_one_data_error_naming_it(tmp_path):
    write_dataset(tmp_path, n_train=30, n_test=10)
    (tmp_path / "t10k-images-idx3-ubyte.gz").chmod(0)
    line = load_elsewhere(tmp_path)
    assert line == f"DataError: {tmp_path}/t10k-images-idx3-ubyte.gz: cannot be read (Permission denied)", line


def test_a_data_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(DataError, match=rf"^--data-dir {tmp_path}/f is not a directory; "):
        load_fashion_mnist(tmp_path / "f")


def test_manual_dp_data_must_hold_the_files_no_other_copy_is_used(tmp_path, monkeypatch, data_dir):
    monkeypatch.setattr(data, "DEBIAN_DIR", str(data_dir))  # a good copy it must not fall back to
    partial = write_dataset(tmp_path / "partial", n_train=30, n_test=10)
    (partial / "train-images-idx3-ubyte.gz").unlink()
    monkeypatch.setenv("MANUAL_DP_DATA", str(partial))
    with pytest.raises(DataError, match=rf"^\$MANUAL_DP_DATA={partial} lacks train-images-idx3-ubyte.gz; "):
        load_fashion_mnist(allow_download=False)
    monkeypatch.setenv("MANUAL_DP_DATA", str(tmp_path / "nope"))
    with pytest.raises(DataError, match=rf"^\$MANUAL_DP_DATA={tmp_path}/nope does not exist; "):
        load_fashion_mnist(allow_download=False)


def test_locate_data_says_where_the_data_came_from(tmp_path, monkeypatch, data_dir):
    monkeypatch.setenv("MANUAL_DP_DATA", str(data_dir))
    assert locate_data(data_dir) == (data_dir, f"--data-dir {data_dir}")
    assert locate_data() == (data_dir, f"$MANUAL_DP_DATA={data_dir}")
    monkeypatch.setenv("MANUAL_DP_DATA", "")  # set but empty: as if unset
    monkeypatch.setattr(data, "DEBIAN_DIR", str(tmp_path / "no-debian"))
    monkeypatch.setattr(data, "MXNET_CACHE", str(data_dir))
    assert locate_data(allow_download=False) == (data_dir, f"MXNet's cache {data_dir}")
    monkeypatch.setattr(data, "DEBIAN_DIR", str(data_dir))
    assert locate_data(allow_download=False) == (data_dir, f"Debian's package {data_dir}")


def test_a_cache_that_cannot_be_made_is_one_data_error(tmp_path, monkeypatch):
    monkeypatch.delenv("MANUAL_DP_DATA", raising=False)
    monkeypatch.setattr(data, "DEBIAN_DIR", str(tmp_path / "no-debian"))
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(data, "MXNET_CACHE", str(tmp_path / "file" / "cache"))
    monkeypatch.setattr(data, "DOWNLOAD_URL", "http://127.0.0.1:9/")  # never reached
    with pytest.raises(DataError, match=rf"{tmp_path}/file/cache cannot be made for a download \(Not a directory\)"):
        load_fashion_mnist()
