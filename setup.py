"""Build the fastattn._kernel extension: Cython binding + the C kernel in src_c/.

Metadata lives in pyproject.toml; this file only describes the compiled part:
baseline C sources, per-ISA micro-kernels compiled with their own flags, and
OpenMP detection. Environment:

    FASTATTN_REQUIRE_OPENMP=1   a compiler without OpenMP stops the build
                                (wheels and CI) instead of building serial.
"""

import glob
import os
import sys
import sysconfig
import tempfile

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CompileError, LinkError, PlatformError

SRC = "src_c"

# Compiled with baseline flags on every architecture. kernels_vec128.c is
# SSE2 on x86-64 and NEON on arm64: both are baseline there, so no flag.
BASELINE_SOURCES = ["attention.c", "check.c", "plan.c", "pool.c", "dispatch.c", "kernels_scalar.c", "kernels_vec128.c"]

# Per-ISA micro-kernels: (file, macro telling dispatch.c it exists, gcc/clang flags, MSVC flags).
# setuptools has one flag list per extension, so these are compiled separately
# (see BuildExt) and linked in as extra objects: only these files may contain
# AVX/AVX-512 instructions, and dispatch.c picks one at run time, so the module
# still imports and runs on a CPU without them.
ISA_X86_64 = [
    ("kernels_avx2.c", "FA_HAVE_AVX2", ["-mavx2", "-mfma"], ["/arch:AVX2"]),
    ("kernels_avx512.c", "FA_HAVE_AVX512",
     ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma"], ["/arch:AVX512"]),
]

# -std=gnu99, not c99: strict ISO mode sets -ffp-contract=off, which would turn
# every a*b+c into two roundings and lose the FMA. -fno-math-errno lets expf and
# sqrtf inline. Never -ffast-math (breaks inf/NaN handling of masked rows) and
# never -march=native (a wheel must run on any CPU of its architecture).
GCC_FLAGS = ["-O3", "-std=gnu99", "-fno-math-errno", "-Wall"]
MSVC_FLAGS = ["/O2"]

CYTHON_DIRECTIVES = {
    "language_level": 3,
    "boundscheck": False,   # _api.py validates shapes; the binding only indexes what it checked
    "wraparound": False,
    "cdivision": True,
    "embedsignature": True,
}

OPENMP_PROBE = r"""
#include <omp.h>
int main(void) {
    int n = 0;
    #pragma omp parallel reduction(+:n)
    n += 1;
    return (n > 0 && omp_get_max_threads() > 0) ? 0 : 1;
}
"""


def target_isas():
    """Per-ISA kernels for the platform being built for (none beyond baseline
    off x86-64).

    sysconfig.get_platform() follows cross-compilation (_PYTHON_HOST_PLATFORM,
    as set by cibuildwheel), unlike platform.machine(). A macOS universal2
    build gets the baseline kernels only: one flag list cannot serve both halves.
    """
    plat = sysconfig.get_platform().lower()
    return ISA_X86_64 if plat.endswith(("x86_64", "amd64")) else []


class BuildExt(build_ext):
    def finalize_options(self):
        super().finalize_options()
        # Always rebuild everything. pip builds in-tree, so build/ survives
        # between installs, and distutils skips an extension whose .so is newer
        # than its listed sources and headers: a change it cannot see (a flag
        # here, an included file not listed, a checkout that keeps old file
        # times) would then ship the previous module and hide a broken source.
        # The whole build takes seconds.
        self.force = True

    def build_extensions(self):
        import numpy
        from Cython.Build import cythonize

        msvc = self.compiler.compiler_type == "msvc"
        omp_compile, omp_link = self._find_openmp(msvc)
        base = (MSVC_FLAGS if msvc else GCC_FLAGS) + omp_compile

        isas = target_isas()
        for ext in self.extensions:
            ext.include_dirs += [SRC, numpy.get_include()]
            ext.extra_compile_args += base
            ext.extra_link_args += omp_link
            # The FA_HAVE_* macros go to every source (the Cython module too),
            # so all files agree on which kernels exist.
            ext.define_macros += [(macro, "1") for _, macro, _, _ in isas]
            for name, _, gcc_flags, msvc_flags in isas:
                ext.extra_objects += self.compiler.compile(
                    [os.path.join(SRC, name)],
                    output_dir=self.build_temp,
                    macros=ext.define_macros,
                    include_dirs=ext.include_dirs,
                    extra_postargs=base + (msvc_flags if msvc else gcc_flags),
                    depends=ext.depends,
                )

            # Cythonize here, not at import of setup.py: metadata-only calls
            # (egg_info, sdist) then neither need Cython nor write _kernel.c.
            ext.sources = cythonize(ext, force=True, compiler_directives=CYTHON_DIRECTIVES)[0].sources
        super().build_extensions()

    def _find_openmp(self, msvc):
        """(compile flags, link flags) that build and link an OpenMP program."""
        if msvc:
            candidates = [(["/openmp"], [])]
        else:
            candidates = [(["-fopenmp"], ["-fopenmp"])]
            if sys.platform == "darwin":  # Apple clang: libomp from Homebrew
                for prefix in ("/opt/homebrew/opt/libomp", "/usr/local/opt/libomp"):
                    if os.path.isdir(prefix):
                        candidates.append(
                            (["-Xpreprocessor", "-fopenmp", f"-I{prefix}/include"],
                             [f"-L{prefix}/lib", "-lomp"]))
                candidates.append((["-Xpreprocessor", "-fopenmp"], ["-lomp"]))

        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "omp_probe.c")
            with open(src, "w") as f:
                f.write(OPENMP_PROBE)
            for compile_flags, link_flags in candidates:
                try:
                    objs = self.compiler.compile([src], output_dir=tmp, extra_postargs=compile_flags)
                    self.compiler.link_executable(objs, "omp_probe", output_dir=tmp,
                                                  extra_postargs=link_flags)
                except (CompileError, LinkError):
                    continue
                print(f"fastattn: OpenMP found: compile {compile_flags}, link {link_flags}")
                return compile_flags, link_flags

        message = ("fastattn: the C compiler cannot build an OpenMP program "
                   f"(tried {[c for c, _ in candidates]})")
        if os.environ.get("FASTATTN_REQUIRE_OPENMP") == "1":
            raise PlatformError(message + "; FASTATTN_REQUIRE_OPENMP=1 makes this an error.")
        print(f"WARNING: {message}. Building a SERIAL kernel: every call runs on one "
              "thread. fastattn.info()['openmp'] will say False.", file=sys.stderr)
        return [], []


kernel = Extension(
    "fastattn._kernel",
    sources=["fastattn/_kernel.pyx"] + [os.path.join(SRC, name) for name in BASELINE_SOURCES],
    depends=sorted(glob.glob(os.path.join(SRC, "*.h"))),
    define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
)

setup(ext_modules=[kernel], cmdclass={"build_ext": BuildExt})
