"""Build the loraplex._C extension (pybind11) from csrc/, and find the packages.

The top-level folders import as `loraplex.<folder>`; every package below them is
found here (a hand-kept list once missed `loraplex.gpu_engine.tp`, and a regular
install could not serve). The rest of the metadata is in pyproject.toml.
"""
from setuptools import find_packages

# import name -> folder; subpackages follow their folder
ROOTS = {"loraplex": "loraplex", **{f"loraplex.{folder}": folder for folder in (
    "daemon", "ipc", "gpu_engine", "cpu_lora", "kernels", "tui", "gateway", "cluster")}}


def packages() -> list[str]:
    found = []
    for name, folder in ROOTS.items():
        found += [name] + [f"{name}.{sub}" for sub in find_packages(where=folder)]
    return sorted(found)


if __name__ == "__main__":  # setuptools runs this file as __main__; tests import packages() alone
    from pybind11.setup_helpers import Pybind11Extension, build_ext
    from setuptools import setup

    setup(
        packages=packages(),
        package_dir=ROOTS,
        ext_modules=[
            Pybind11Extension(
                "loraplex._C",
                sorted(["csrc/module.cpp", "csrc/words.cpp", "csrc/futex.cpp", "csrc/waits.cpp",
                        "csrc/cuda_stream_ops.cpp"]),
                depends=sorted(["csrc/words.h", "csrc/futex.h", "csrc/waits.h", "csrc/cuda_stream_ops.h"]),
                cxx_std=17,
                extra_compile_args=["-O3"],
                libraries=["dl"],
            )
        ],
        cmdclass={"build_ext": build_ext},
    )
