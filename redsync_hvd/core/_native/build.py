"""Build the optional native selection kernel ahead of time.

    python redsync_hvd/core/_native/build.py          # builds next to this file
    python redsync_hvd/core/_native/build.py --clean  # removes the built module

scripts/install.sh runs this; a failure only costs speed, since
redsync_hvd.core.selection falls back to pure torch ops. It uses setuptools'
build_ext through torch.utils.cpp_extension (ninja is used when present, not
required), compiles with -O3 -fopenmp (the OpenMP runtime resolves to the
libgomp torch already loaded), and records the torch version it was built
against in _build_info.json: the loader ignores a module built for another torch.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
NAME = "_redsync_select"
INFO = os.path.join(HERE, "_build_info.json")


def clean() -> None:
    for path in glob.glob(os.path.join(HERE, NAME + "*.so")) + glob.glob(os.path.join(HERE, NAME + "*.pyd")):
        os.remove(path)
    if os.path.exists(INFO):
        os.remove(INFO)


def build(verbose: bool = False) -> str:
    import torch
    from setuptools import setup
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    # Build into a scratch dir and move the result in with os.replace: processes
    # loading the module meanwhile see the old build or the new one, never none.
    tmp = tempfile.mkdtemp(prefix="redsync_native_")
    ext = CppExtension(
        NAME,
        [os.path.join(HERE, "select_kernels.cpp")],
        extra_compile_args=["-O3", "-fopenmp", "-std=c++17"],
        extra_link_args=["-fopenmp"],
    )
    try:
        setup(
            name=NAME,
            ext_modules=[ext],
            cmdclass={"build_ext": BuildExtension.with_options(use_ninja=shutil.which("ninja") is not None)},
            script_args=["-q" if not verbose else "-v", "build_ext",
                         "--build-lib", os.path.join(tmp, "lib"), "--build-temp", os.path.join(tmp, "obj")],
        )
        built = glob.glob(os.path.join(tmp, "lib", NAME + "*.so"))
        if not built:
            raise RuntimeError("native selection build produced no module")
        dest = os.path.join(HERE, os.path.basename(built[0]))
        shutil.copy2(built[0], dest + ".tmp")
        os.replace(dest + ".tmp", dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    with open(INFO + ".tmp", "w") as f:
        json.dump({"torch": torch.__version__, "module": os.path.basename(dest)}, f)
    os.replace(INFO + ".tmp", INFO)
    return dest


if __name__ == "__main__":
    if "--clean" in sys.argv:
        clean()
        print("removed native selection module")
        sys.exit(0)
    path = build(verbose="-v" in sys.argv)
    # Import it once so a broken build fails here, not on the training hot path.
    # Loaded by path: importing the package would pull in the rest of redsync_hvd.
    import importlib.util

    spec = importlib.util.spec_from_file_location("_redsync_native_loader", os.path.join(HERE, "__init__.py"))
    loader = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loader)
    mod = loader.load(force=True)
    if mod is None:
        print("built %s but it does not load" % path, file=sys.stderr)
        sys.exit(1)
    print("built native selection kernel: %s" % path)
