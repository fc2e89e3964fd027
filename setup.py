"""Build the loraplex._C extension (pybind11) from csrc/; everything else is in pyproject.toml."""
from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

setup(
    ext_modules=[
        Pybind11Extension(
            "loraplex._C",
            sorted(["csrc/module.cpp", "csrc/words.cpp", "csrc/futex.cpp", "csrc/waits.cpp", "csrc/cuda_stream_ops.cpp"]),
            depends=sorted(["csrc/words.h", "csrc/futex.h", "csrc/waits.h", "csrc/cuda_stream_ops.h"]),
            cxx_std=17,
            extra_compile_args=["-O3"],
            libraries=["dl"],
        )
    ],
    cmdclass={"build_ext": build_ext},
)
