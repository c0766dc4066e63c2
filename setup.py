"""Build the fastattn._kernel extension: Cython binding + the C kernel in src_c/.

Metadata lives in pyproject.toml; the C sources and their flags in
src_c/manifest.py. This file adds the binding, the per-ISA objects and OpenMP
detection. GCC or clang only: the C uses GCC vector extensions,
posix_memalign and __atomic builtins, so MSVC cannot build it. Environment:

    FASTATTN_REQUIRE_OPENMP=1   a compiler without OpenMP stops the build
                                (wheels and CI) instead of building without it.
"""

import concurrent.futures
import glob
import importlib.util
import os
import shlex
import sys
import sysconfig
import tempfile

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CompileError, LinkError, PlatformError


def load_manifest():
    # By file path: a PEP 517 build does not put the project folder on sys.path.
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "src_c", "manifest.py")
    spec = importlib.util.spec_from_file_location("fastattn_c_manifest", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


manifest = load_manifest()
# sysconfig.get_platform() follows cross-compilation (_PYTHON_HOST_PLATFORM, as
# set by cibuildwheel), unlike platform.machine().
TARGET = sysconfig.get_platform()

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


class BuildExt(build_ext):
    def finalize_options(self):
        super().finalize_options()
        # Always rebuild everything. pip builds in-tree, so build/ survives
        # between installs, and distutils skips an extension whose .so is newer
        # than its listed sources and headers: a change it cannot see (a flag
        # in the manifest, an included file not listed, a checkout that keeps
        # old file times) would then ship the previous module and hide a
        # broken source. The whole build takes seconds.
        self.force = True

    def build_extensions(self):
        import numpy
        from Cython.Build import cythonize

        omp_compile, omp_link = self._find_openmp()
        base = manifest.FLAGS + omp_compile
        # Per-ISA kernels whose flags this compiler does not know are left
        # out (dispatch.c then never offers them), not a failed build.
        accepts = manifest.compiler_accepts(shlex.join(self.compiler.compiler_so)) \
            if hasattr(self.compiler, "compiler_so") else None

        for ext in self.extensions:
            ext.include_dirs += [manifest.SRC, numpy.get_include()]
            ext.extra_compile_args += base
            ext.extra_link_args += omp_link
            # The FA_HAVE_* macros go to every source (the Cython module too),
            # so all files agree on which kernels exist.
            ext.define_macros += [(macro, "1") for macro in manifest.macros(TARGET, accepts)]
            # Every C file is compiled here, one compiler process per core:
            # setuptools compiles an extension's sources one after the other
            # with one flag list, and the per-ISA kernels need flags of their
            # own. The four kernel files take most of a minute on one core.
            with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
                jobs = [pool.submit(self._compile, ext, path, base + own)
                        for path, own in manifest.steps(TARGET, accepts)]
                # Cythonize here, not at import of setup.py: metadata-only calls
                # (egg_info, sdist) then neither need Cython nor write _kernel.c.
                binding = cythonize(ext, force=True, compiler_directives=CYTHON_DIRECTIVES)[0].sources
                jobs += [pool.submit(self._compile, ext, path, ext.extra_compile_args) for path in binding]
                ext.extra_objects += [obj for job in jobs for obj in job.result()]
            ext.sources = []  # all compiled above: setuptools only links
        super().build_extensions()

    def _compile(self, ext, path, flags):
        """Objects of one source, with the arguments setuptools would pass."""
        return self.compiler.compile([path], output_dir=self.build_temp, macros=ext.define_macros,
                                     include_dirs=ext.include_dirs, debug=self.debug,
                                     extra_postargs=flags, depends=ext.depends)

    def _find_openmp(self):
        """(compile flags, link flags) that build and link an OpenMP program."""
        candidates = [([manifest.OPENMP], [manifest.OPENMP])]
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
        # src_c/attention.c: fa_max_threads() is omp_get_max_threads(), or 1 without OpenMP.
        print(f"WARNING: {message}. Building without OpenMP: the kernel's worker threads are "
              "POSIX threads (src_c/pool.c) and still run with an explicit num_threads=N, but "
              "num_threads=None now means 1 thread, since the default count comes from "
              "omp_get_max_threads(): OMP_NUM_THREADS and threadpoolctl no longer apply. "
              "fastattn.info()['openmp'] will say False.", file=sys.stderr)
        return [], []


kernel = Extension(
    "fastattn._kernel",
    sources=["fastattn/_kernel.pyx"],  # the C files: manifest.steps(), compiled by BuildExt
    depends=sorted(glob.glob(os.path.join(manifest.SRC, "*.h"))),
    # FA_SOURCE_DIGEST: which sources this build came from (fastattn._kernel.source_digest()).
    define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION"),
                   ("FA_SOURCE_DIGEST", '"%s"' % manifest.source_digest(os.path.dirname(os.path.abspath(__file__))))],
)

setup(ext_modules=[kernel], cmdclass={"build_ext": BuildExt})
