"""Builds offloadpp and its native core `offloadpp._C` ahead of time.

No torch headers (raw pointers and sizes cross the boundary), so the extension builds once,
against any torch. No -march=native: SIMD variants are compiled side by side with per-function
target attributes and chosen at run time by CPUID (csrc/cpu_features.cpp).
"""

import glob
import os
import sys

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _have_header(name: str) -> bool:
    return any(os.path.exists(os.path.join(d, name)) for d in ("/usr/include", "/usr/local/include"))


sources = sorted(glob.glob("csrc/**/*.cpp", recursive=True))
define_macros = []
libraries = ["pthread"]
# libaio is the default backend; the thread pool is always built so that a machine without
# the system library still runs (doctor reports what is missing).
if _have_header("libaio.h"):
    define_macros.append(("OFFLOADPP_HAVE_LIBAIO", "1"))
    libraries.append("aio")
elif os.environ.get("OFFLOADPP_REQUIRE_LIBAIO") == "1":
    sys.exit("libaio.h not found: install the system libaio (Debian: apt-get install libaio-dev)")
if _have_header("liburing.h"):
    define_macros.append(("OFFLOADPP_HAVE_URING", "1"))
    libraries.append("uring")

ext = Pybind11Extension(
    "offloadpp._C",
    sources=sources,
    include_dirs=["csrc"],
    depends=sorted(glob.glob("csrc/**/*.h", recursive=True)),
    define_macros=define_macros,
    libraries=libraries,
    cxx_std=17,
    extra_compile_args=["-O3", "-Wall", "-Wextra", "-Wno-unused-parameter"],
)


class ParallelBuildExt(build_ext):
    """Compiles the sources in parallel by default: a clean build stays well under 2 minutes."""

    def finalize_options(self):
        super().finalize_options()
        if not self.parallel:
            self.parallel = os.cpu_count() or 1


setup(
    name="offloadpp",
    version="0.1.0",
    description="Fine-tune models larger than GPU and CPU memory by streaming training state through NVMe SSDs",
    packages=find_packages(include=["offloadpp", "offloadpp.*"]),
    ext_modules=[ext],
    cmdclass={"build_ext": ParallelBuildExt},
    python_requires=">=3.9",
    install_requires=["numpy", "pydantic>=2", "psutil", "tqdm", "greenlet"],
    extras_require={
        "deepspeed": ["deepspeed", "hjson"],
        "hf": ["transformers", "safetensors", "accelerate"],
        "dev": ["pytest", "ruff"],
    },
    entry_points={"console_scripts": ["offloadpp=offloadpp.cli.main:main"]},
    zip_safe=False,
)
