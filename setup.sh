#!/usr/bin/env bash
# Set up manual_dp on a fresh Debian-like machine; safe to run again.
#   bash setup.sh           virtual environment .venv, the package, Fashion-MNIST (Debian package)
#   bash setup.sh --test    the same, plus what the tests and notebooks need
set -euo pipefail
cd "$(dirname "$0")"

extras=""
for arg in "$@"; do
  case "$arg" in
    --test) extras="[test]" ;;
    *) echo "setup.sh: unknown option $arg (use --test)" >&2; exit 2 ;;
  esac
done

# MXNet 1.9.1 has wheels for Python <= 3.11 only.
python=""
for candidate in "${PYTHON:-}" python3.11 python3.10 python3.9 python3.8 python3; do
  [ -n "$candidate" ] || continue
  if command -v "$candidate" >/dev/null &&
     "$candidate" -c 'import sys; sys.exit(not (3, 8) <= sys.version_info[:2] <= (3, 11))'; then
    python=$candidate; break
  fi
done
if [ -z "$python" ]; then
  echo "setup.sh: needs Python 3.8 to 3.11 (MXNet 1.9.1 has no wheels for newer); set PYTHON=..." >&2
  exit 1
fi

# Fashion-MNIST and the fortunes (--data fortunes) from Debian's packages, where apt is at hand
# (otherwise see README: --data-dir, --data fortunes:DIR).
packages=""
[ -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] || packages="dataset-fashion-mnist"
[ -d /usr/share/games/fortunes ] || packages="$packages fortunes"
if [ -n "$packages" ] && command -v apt-get >/dev/null; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
  if ! { $sudo apt-get update -qq && $sudo apt-get install -y -qq $packages; } >/dev/null; then
    echo "setup.sh: could not install$packages; pass --data-dir or --data fortunes:DIR to training" >&2
  fi
fi

[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip setuptools wheel
.venv/bin/python -m pip install -q -e ".$extras"

# --test: horovod built against this mxnet (Gloo, no MPI), for the Horovod backend and its tests.
if [ "$extras" = "[test]" ] && ! .venv/bin/python -c 'import horovod.mxnet' 2>/dev/null; then
  if ! { command -v cmake && command -v g++; } >/dev/null && command -v apt-get >/dev/null; then
    sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
    { $sudo apt-get update -qq && $sudo apt-get install -y -qq cmake g++; } >/dev/null
  fi
  echo "setup.sh: building horovod 0.28.1 for mxnet (about 10 minutes, once)"
  HOROVOD_WITH_MXNET=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_WITHOUT_TENSORFLOW=1 \
    HOROVOD_WITHOUT_PYTORCH=1 .venv/bin/python -m pip install -q --no-build-isolation horovod==0.28.1
fi
echo "setup.sh: ready (.venv, $(.venv/bin/python -c 'import mxnet; print("mxnet", mxnet.__version__)'))"
