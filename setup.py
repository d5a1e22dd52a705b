from setuptools import find_packages, setup

setup(
    name="redsync_hvd",
    version="0.1.0",
    description="Residual gradient compression (RedSync, SBC, IWP, DCD/ECD-PSGD) on Horovod",
    packages=find_packages(include=["redsync_hvd", "redsync_hvd.*"]),
    package_data={"redsync_hvd": ["configs/*.yaml"]},
    python_requires=">=3.9",
    # torch and horovod are installed by scripts/install.sh (horovod needs a patched
    # source build against the torch in the venv), so they are not pinned here.
    install_requires=[
        "numpy",
        "pyyaml",
        "pydantic>=2",
        "tqdm",
        "matplotlib",
        "scikit-learn",
        # R's serialization format, for data.name: austen (data/rdb.py); 0.11.2: the last on Python 3.9-3.10
        "rdata==0.11.2",
        # rdata needs pandas; pandas 3 needs numpy 2, which tensorflow-cpu 2.15 (the [tensorflow] extra) refuses
        "pandas>=2.2,<3",
    ],
    extras_require={
        # the code's own hygiene (tests/test_hygiene.py): pinned, so a release cannot change the rules
        "dev": ["pytest", "hypothesis", "pytest-timeout", "ruff==0.17.5", "import-linter==2.16"],
        "tensorflow": ["tensorflow-cpu==2.15.1"],
        # the device selection kernels (core/triton_select.py); their CPU tests run them in
        # Triton's interpreter. CUDA builds of torch bring their own triton: keep that one.
        "kernels": ["triton==3.9.0"],
    },
)
