#!/usr/bin/env bash
# Set up everything redsync_hvd needs, into the project's own virtualenv.
#
#   scripts/install.sh            # idempotent: a second run only checks
#
# Knobs (environment variables):
#   REDSYNC_VENV         virtualenv path                 (default: <repo>/.venv)
#   REDSYNC_PYTHON       interpreter used to create it   (default: python3)
#   REDSYNC_TORCH_SPEC   pip requirement for torch       (default: torch==2.13.0;
#                        e.g. "torch==2.5.1 --index-url https://download.pytorch.org/whl/cu124"
#                        on a CUDA cluster)
#   REDSYNC_WITH_TF=1    also install tensorflow-cpu==2.15.1 and build Horovod with it
#   REDSYNC_WHEEL_CACHE  where built Horovod wheels are cached (default: ~/.cache/redsync_hvd/wheels)
#   REDSYNC_DATA_CACHE   where downloaded data sets are unpacked (default: ~/.cache/redsync_hvd/data)
#   MPI: if `mpicxx` is on PATH it is used as is (cluster MPI: `module load openmpi`
#   or put its bin/ first on PATH). Otherwise, as root on Debian/Ubuntu, Debian's
#   OpenMPI 4.1 is installed with apt-get, the one `horovodrun` works with.
#   Data sets: as root with apt-get, Fashion-MNIST and Jane Austen's novels come from Debian's
#   packages (scripts/install_data.sh); elsewhere it prints the command that gets them.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${REDSYNC_VENV:-$ROOT/.venv}"
PYTHON="${REDSYNC_PYTHON:-python3}"
TORCH_SPEC="${REDSYNC_TORCH_SPEC:-torch==2.13.0}"
WITH_TF="${REDSYNC_WITH_TF:-0}"
TF_SPEC="tensorflow-cpu==2.15.1"
HOROVOD_VERSION=0.28.1
CACHE="${REDSYNC_WHEEL_CACHE:-$HOME/.cache/redsync_hvd/wheels}"

say() { printf '\033[1m[install]\033[0m %s\n' "$*"; }
die() { printf '\033[31m[install] ERROR:\033[0m %s\n' "$*" >&2; exit 1; }

# ---- toolchain checks: fail early with the fix, not deep inside CMake ----------
command -v "$PYTHON" >/dev/null || die "no '$PYTHON' found. Install Python 3.9-3.11 with venv support, or set REDSYNC_PYTHON."
if ! command -v g++ >/dev/null || ! command -v make >/dev/null; then
  die "a C++ compiler (g++) and make are needed to build Horovod. On Debian/Ubuntu: apt-get install -y build-essential"
fi
if ! command -v cmake >/dev/null; then
  die "cmake is needed to build Horovod. On Debian/Ubuntu: apt-get install -y cmake (or pip install cmake)"
fi
if ! command -v mpicxx >/dev/null || ! command -v mpirun >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "no MPI on PATH: installing Debian's OpenMPI (libopenmpi-dev openmpi-bin)"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libopenmpi-dev openmpi-bin) >/dev/null \
      || die "apt-get could not install OpenMPI. Install libopenmpi-dev and openmpi-bin yourself."
  else
    die "MPI not found: 'mpicxx' and 'mpirun' must be on PATH. On a cluster: 'module load openmpi' (or put your MPI's bin/ first on PATH). On Debian/Ubuntu: sudo apt-get install libopenmpi-dev openmpi-bin"
  fi
fi
say "MPI: $(command -v mpicxx) ($(mpirun --version 2>/dev/null | head -1))"
# sshd: the multi-host tests (tests/test_cluster.py) run one in each emulated host; only as root, who can
# build those hosts (network namespaces). A cluster's own sshd is its administrator's.
if [ "$(id -u)" = 0 ] && [ ! -x /usr/sbin/sshd ] && command -v apt-get >/dev/null; then
  say "no sshd: installing Debian's openssh-server (tests/test_cluster.py starts it in its emulated hosts)"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server) >/dev/null \
    || die "apt-get could not install openssh-server. Install it yourself, or skip tests/test_cluster.py."
fi

# ---- virtualenv ---------------------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
  say "creating virtualenv $VENV"
  "$PYTHON" -m venv "$VENV" || die "could not create a virtualenv. On Debian/Ubuntu: apt-get install python3-venv"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip install -q --disable-pip-version-check)

# ---- torch (and TF) first: Horovod compiles against whatever is installed ----------
if ! "$PY" -c "import torch" 2>/dev/null; then
  say "installing $TORCH_SPEC"
  # shellcheck disable=SC2086
  "${PIP[@]}" $TORCH_SPEC
fi
if [ "$WITH_TF" = 1 ] && ! "$PY" -c "import tensorflow" 2>/dev/null; then
  say "installing $TF_SPEC"
  "${PIP[@]}" "$TF_SPEC"
fi
# Horovod's runtime and build deps (built without isolation, so it sees this venv's torch)
"${PIP[@]}" "cloudpickle" "psutil" "pyyaml" "packaging" "cffi>=1.4.0" "wheel" "setuptools"

# ---- Horovod: patched sdist, wheel cached per torch/TF/CUDA/MPI -----------------
TORCH_VER=$("$PY" -c "import torch; print(torch.__version__)")
CUDA_VER=$("$PY" -c "import torch; print(torch.version.cuda or 'cpu')")
TF_VER=$("$PY" -c "import tensorflow as tf; print(tf.__version__)" 2>/dev/null || echo none)
MPI_TAG=$(mpirun --version 2>/dev/null | head -1 | tr -cd 'A-Za-z0-9.' )
KEY="torch${TORCH_VER}-cuda${CUDA_VER}-tf${TF_VER}-${MPI_TAG}-py$("$PY" -c 'import sys;print("%d%d"%sys.version_info[:2])')-p2"
KEY=$(echo "$KEY" | tr '+/' '__')
WHEEL_DIR="$CACHE/horovod-$HOROVOD_VERSION-$KEY"

have_horovod() {
  REDSYNC_NEED_TF=$([ "$TF_VER" != none ] && echo 1 || echo 0) "$PY" - <<'PY' 2>/dev/null
import horovod, horovod.torch  # noqa: F401  (raises if the extension is missing)
from horovod.common.util import EXTENSIONS, mpi_built, gloo_built
import os, sys
if os.environ["REDSYNC_NEED_TF"] == "1":
    import horovod.tensorflow  # noqa: F401  (a torch-only Horovod must make way for the TF build)
sys.exit(0 if horovod.__version__ == "0.28.1" and EXTENSIONS[0] == "torch" and mpi_built() and gloo_built() else 1)
PY
}

if ! ls "$WHEEL_DIR"/horovod-*.whl >/dev/null 2>&1; then
  say "building Horovod $HOROVOD_VERSION for $KEY (minutes, longer with TensorFlow; once: cached in $WHEEL_DIR)"
  BUILD=$(mktemp -d)
  trap 'rm -rf "$BUILD"' EXIT
  "$PY" -m pip download -q --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$BUILD" \
    || die "could not download the horovod==$HOROVOD_VERSION sdist from PyPI"
  tar -xzf "$BUILD"/horovod-$HOROVOD_VERSION.tar.gz -C "$BUILD"
  SRC="$BUILD/horovod-$HOROVOD_VERSION"
  # Two patches ("-p2" in the key): torch >= 2.1 headers need C++17, 0.28.1 pins C++14; horovodrun asks an
  # extension "built with MPI?" before each launch, TF's first: torch's (same answer) costs 2 s less a launch.
  sed -i 's/CMAKE_CXX_STANDARD 14/CMAKE_CXX_STANDARD 17/; s/-std=c++14/-std=c++17/g' \
    "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"
  sed -i "s/^EXTENSIONS = \['tensorflow', 'torch'/EXTENSIONS = ['torch', 'tensorflow'/" "$SRC/horovod/common/util.py"
  grep -q 'CMAKE_CXX_STANDARD 17' "$SRC/CMakeLists.txt" && grep -q "^EXTENSIONS = \['torch'" "$SRC/horovod/common/util.py" \
    || die "a patch did not apply to Horovod's sdist (CMakeLists.txt: C++17; horovod/common/util.py: torch first)"
  export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MXNET=1
  if [ "$TF_VER" != none ]; then
    export HOROVOD_WITH_TENSORFLOW=1
    sed -i 's/-std=c++14/-std=c++17/g; s/CMAKE_CXX_STANDARD 14/CMAKE_CXX_STANDARD 17/' "$SRC/horovod/tensorflow/CMakeLists.txt" 2>/dev/null || true
  else
    export HOROVOD_WITHOUT_TENSORFLOW=1
  fi
  if [ "$CUDA_VER" != cpu ]; then
    export HOROVOD_GPU_OPERATIONS=NCCL
    say "CUDA $CUDA_VER torch detected: building with NCCL (needs nvcc and NCCL headers; set HOROVOD_NCCL_HOME if not in a default path)"
  fi
  export MAKEFLAGS="-j$(nproc)"
  (cd "$SRC" && "$PY" -m pip wheel -q --no-build-isolation --no-deps . -w "$BUILD/out") >"$BUILD/build.log" 2>&1 || {
    tail -40 "$BUILD/build.log" >&2; die "Horovod build failed (full log above). Check compiler, MPI and torch versions."; }
  mkdir -p "$WHEEL_DIR"
  cp "$BUILD"/out/horovod-*.whl "$WHEEL_DIR"/
fi
if ! have_horovod; then
  say "installing cached Horovod wheel from $WHEEL_DIR"
  "${PIP[@]}" --force-reinstall --no-deps "$WHEEL_DIR"/horovod-*.whl
fi
have_horovod || die "Horovod installed but lacks MPI or Gloo support; delete $WHEEL_DIR and rerun."

# ---- mpi4py against the same MPI Horovod was built with -----------------------
if ! "$PY" -c "import mpi4py.MPI" 2>/dev/null; then
  say "building mpi4py against $(command -v mpicc)"
  env MPICC="$(command -v mpicc)" "${PIP[@]}" --no-binary mpi4py mpi4py
fi

# ---- the package itself (editable) + test deps --------------------------------
EXTRAS="dev"
[ "$WITH_TF" = 1 ] && EXTRAS="dev,tensorflow"
# Triton for the selection kernels, unless torch already brought one (CUDA wheels pin theirs)
"$PY" -c "import triton" 2>/dev/null || EXTRAS="$EXTRAS,kernels"
"${PIP[@]}" -e "$ROOT[$EXTRAS]"
# every Python of the venv imports redsync_hvd._startup as it starts (TF's C++ start-up lines hidden unless
# TF_CPP_MIN_LOG_LEVEL is set; horovodrun waits for its ranks); a checkout without it is skipped silently
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo 'import importlib.util as u; u.find_spec("redsync_hvd") and u.find_spec("redsync_hvd._startup") and __import__("redsync_hvd._startup")' \
  > "$SITE/redsync_hvd.pth"

# Optional native selection kernel (fused count); built here so the hot path never compiles.
[ -f "$ROOT/redsync_hvd/core/_native/build.py" ] && { "$PY" "$ROOT/redsync_hvd/core/_native/build.py" \
  || say "warning: native selection kernel failed to build; the pure-torch path will be used"; }

# ---- the data sets that come from Debian packages (Fashion-MNIST, Jane Austen's novels) ------
bash "$ROOT/scripts/install_data.sh"

say "done: $("$PY" -c 'import torch,horovod;print("torch",torch.__version__,"horovod",horovod.__version__)')"
say "activate with: source $VENV/bin/activate"
