"""Build the optional native selection kernel ahead of time.

    python redsync_hvd/core/_native/build.py          # builds next to this file (~1 min)
    python redsync_hvd/core/_native/build.py --clean  # removes built modules

scripts/install.sh runs this; a failure only costs speed, since
the selection falls back to pure torch ops (core/select/). It uses setuptools'
build_ext through torch.utils.cpp_extension (ninja is used when present, not
required) with -O3 -fopenmp (the OpenMP runtime resolves to the libgomp torch has
already loaded), and AVX2 + baseline clones of the hot loops (picked at load time).
The output is ``_redsync_select.<torch tag><ext suffix>`` (gitignored as *.so): the
loader only takes the module built for the running torch. Rebuild after changing torch.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def _loader():
    # Loaded by path: importing the package would pull in the rest of redsync_hvd.
    spec = importlib.util.spec_from_file_location("_redsync_native_loader", os.path.join(HERE, "__init__.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def clean() -> None:
    for path in glob.glob(os.path.join(HERE, _loader().NAME + ".*")):
        if not path.endswith(".cpp"):
            os.remove(path)


def build(verbose: bool = False) -> str:
    import torch
    from setuptools import setup
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    loader = _loader()
    name = loader.NAME
    # Build in a scratch dir and move the result in with os.replace: processes loading
    # the module meanwhile see the old build or the new one, never a partial file.
    tmp = tempfile.mkdtemp(prefix="redsync_native_")
    ext = CppExtension(
        name,
        [os.path.join(HERE, f) for f in ("select_kernels.cpp", "exact_kernels.cpp", "golomb_kernels.cpp")],
        extra_compile_args=["-O3", "-fopenmp", "-std=c++17", "-Wno-psabi"],
        extra_link_args=["-fopenmp"],
    )
    try:
        setup(
            name=name,
            ext_modules=[ext],
            cmdclass={"build_ext": BuildExtension.with_options(use_ninja=shutil.which("ninja") is not None)},
            script_args=["-v" if verbose else "-q", "build_ext",
                         "--build-lib", os.path.join(tmp, "lib"), "--build-temp", os.path.join(tmp, "obj")],
        )
        built = glob.glob(os.path.join(tmp, "lib", name + "*.so"))
        if not built:
            raise RuntimeError("native selection build produced no module")
        dest = loader.module_path(torch.__version__)
        shutil.copy2(built[0], dest + ".tmp")
        os.replace(dest + ".tmp", dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for stale in glob.glob(os.path.join(HERE, name + ".*")):  # builds for other torch versions
        if stale != dest and not stale.endswith(".cpp"):
            os.remove(stale)
    return dest


if __name__ == "__main__":
    if "--clean" in sys.argv:
        clean()
        print("removed native selection modules")
        sys.exit(0)
    path = build(verbose="-v" in sys.argv)
    try:
        _loader().find()  # import once: a broken build fails here, not in training
    except Exception as e:
        print("built %s but it does not load: %s" % (path, e), file=sys.stderr)
        sys.exit(1)
    print("built native selection kernel: %s" % path)
