"""src_c/manifest.py — the one list of fastattn's C sources and how to compile them.

Owns: the .c files of the library, the per-ISA micro-kernels with the macro
and flags each needs, the common flags and the OpenMP flag. setup.py, the C
tests, tools/*.sh and the docs read it. Not here: OpenMP detection (setup.py
probes the compiler) and headers (found by glob). Stdlib only, Python >= 3.9,
loaded by file path. Paths are relative to the repository root: run it there.

    python3 src_c/manifest.py lib [--cc CC] [--out DIR] [--cflags FLAGS] [--program FILE.c] [--isa-objects DIR]
    python3 src_c/manifest.py cc-line [--target x86_64|aarch64] [--cc CC] [FILE.c ...] [-o EXE]
    python3 src_c/manifest.py flags | sources [--target x86_64|aarch64]
    python3 src_c/manifest.py kernels [--runnable [--checking]]
"""
import argparse
import concurrent.futures
import glob
import hashlib
import os
import platform
import shlex
import subprocess
import sys
import threading

SRC = "src_c"
OUT = "build/c"
LIB = "libfastattn.a"

# Every .c file of the library but the per-ISA ones; a new source is one more
# name here. Compiled with the common flags only, on every architecture:
# kernels_vec128.c is SSE2 on x86-64 and NEON on arm64, both baseline there.
SOURCES = ["attention.c", "check.c", "plan.c", "pool.c", "dispatch.c", "kernels_scalar.c", "kernels_vec128.c"]

# x86-64 only: (file, macro, flags). Only these files may hold AVX/AVX-512
# instructions, so each is compiled alone with its own flags; dispatch.c picks
# one at run time, and the library still runs on a CPU without them. The
# macros go to every file, so that all agree on which kernels exist. A build
# leaves out the ones whose flags its compiler does not know (accepts=,
# compiler_accepts): GCC 9 and 10, for one, have no AMX flags.
ISA_X86_64 = [
    ("kernels_avx2.c", "FA_HAVE_AVX2", ["-mavx2", "-mfma", "-mf16c"]),
    ("kernels_avx512.c", "FA_HAVE_AVX512",
     ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"]),
    ("kernels_avx512bf16.c", "FA_HAVE_AVX512BF16",
     ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c", "-mavx512bf16"]),
    ("kernels_amx.c", "FA_HAVE_AMX",
     ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c",
      "-mavx512bf16", "-mamx-tile", "-mamx-bf16"]),
]

# -std=gnu99, not c99: strict ISO mode sets -ffp-contract=off, which turns
# every a*b+c into two roundings and loses the FMA (and the exp2 error bound
# the tests hold the kernels to). -fno-math-errno lets expf and sqrtf inline.
# Never -ffast-math (it breaks inf/NaN handling of masked rows), never
# -march=native (a build must run on any CPU of its architecture).
FLAGS = ["-O3", "-std=gnu99", "-fno-math-errno", "-Wall"]
OPENMP = "-fopenmp"  # compile and link (setup.py also tries Apple clang's spelling)
LIBS = ["-lm"]


# What a build is made of, for source_digest(): the C kernel and the Python
# package (a wheel holds both). Not fastattn/_kernel.c: Cython writes it.
DIGEST_GLOBS = [f"{SRC}/*.c", f"{SRC}/*.h", "fastattn/**/*.py", "fastattn/*.pyx", "fastattn/*.pxi",
                "fastattn/*.pxd"]


def source_digest(root="."):
    """sha256 (16 hex digits) over the names and bytes of the files a build is
    made of. setup.py compiles it into the extension and the test suite compares
    it with the checkout's, so a stale build (say, a wheel pip cached for this
    folder path) is refused instead of tested."""
    h = hashlib.sha256()
    names = sorted({os.path.relpath(path, root).replace(os.sep, "/")
                    for pattern in DIGEST_GLOBS
                    for path in glob.glob(os.path.join(root, pattern), recursive=True)})
    for name in names:
        with open(os.path.join(root, name), "rb") as f:
            data = f.read()
        h.update(f"{name}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()[:16]


def is_x86_64(target):
    """target: a machine (x86_64, AMD64, aarch64, arm64), a platform tag
    (linux-x86_64, macosx-11.0-arm64) or a compiler triple (x86_64-linux-gnu).
    A macOS universal2 build is not: one flag list cannot serve both halves."""
    return any(part in ("x86_64", "amd64") for part in target.lower().split("-"))


# The CPU flags (as /proc/cpuinfo names them) each per-ISA kernel needs to run;
# dispatch.c asks CPUID for the same at run time.
RUNS_ON = {
    "kernels_avx2.c": {"avx2", "fma", "f16c"},
    "kernels_avx512.c": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"},
    "kernels_avx512bf16.c": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c", "avx512_bf16"},
    "kernels_amx.c": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c", "avx512_bf16",
                      "amx_tile", "amx_bf16"},
}

# FASTATTN_ISA_KERNELS=avx2,avx512 builds only the per-ISA kernels named (the
# <name> of kernels_<name>.c; empty: none). For the checking builds of one
# machine (tools/sanitize.sh, tools/valgrind.sh): a kernel this CPU cannot run
# is compiled there for nothing, and the three AVX-512 ones take about 60 % of
# a build's compile time. Unset: every kernel, as a wheel must have.
ONLY_ENV = "FASTATTN_ISA_KERNELS"


def kernel_name(file):
    return file[len("kernels_"):-len(".c")]


def _only():
    """The kernel names FASTATTN_ISA_KERNELS keeps, or None when it is unset."""
    raw = os.environ.get(ONLY_ENV)
    if raw is None:
        return None
    names = {n.strip() for n in raw.split(",") if n.strip()}
    known = {kernel_name(f) for f, _, _ in ISA_X86_64}
    if names - known:
        raise ValueError(f"{ONLY_ENV}={raw!r} names no per-ISA kernel: {', '.join(sorted(names - known))}; "
                         f"it takes a comma-separated list of {', '.join(sorted(known))}")
    return names


def isa_kernels(target, accepts=None):
    """(file, macro, flags) of the per-ISA kernels for target: none off x86-64.
    accepts(flags) -> bool, when given, keeps only those the compiler can build;
    FASTATTN_ISA_KERNELS, when set, only those it names."""
    kernels = ISA_X86_64 if is_x86_64(target) else []
    only = _only()
    return [k for k in kernels if (accepts is None or accepts(tuple(k[2])))
            and (only is None or kernel_name(k[0]) in only)]


def runnable_kernels(cpuinfo="/proc/cpuinfo"):
    """Names of the per-ISA kernels this CPU can run, from cpuinfo's flags
    (Linux); every kernel where there is no such file."""
    try:
        with open(cpuinfo) as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return [kernel_name(f) for f, _, _ in ISA_X86_64]
    return [kernel_name(f) for f, _, _ in ISA_X86_64 if RUNS_ON[f] <= set(flags)]


# The sets that are kernels_avx512.c's code plus one bfloat16 entry
# (kernels_avx512bf16.c and kernels_amx.c include it), best first.
AVX512_FAMILY = ["amx", "avx512bf16", "avx512"]


def checking_kernels(runnable):
    """What a checking build of one machine (tools/sanitize.sh) compiles of
    the runnable kernels: avx2 and the best of the AVX-512 family only. The
    family shares one copy of every setting, so the best set runs avx512's
    code for every entry but its own; each AVX-512 file took minutes under
    ASan (about 140 s of CPU for kernels_avx512.c on Zen 4, stop 30)."""
    family = [n for n in AVX512_FAMILY if n in runnable]
    return [n for n in runnable if n not in AVX512_FAMILY or n == family[0]]


def compiler_accepts(cc):
    """accepts= for isa_kernels: whether cc compiles a C file with these flags
    (asked once per flag list)."""
    known = {}

    def accepts(flags):
        if flags not in known:
            r = subprocess.run([*shlex.split(cc), *flags, "-x", "c", "-c", "-", "-o", os.devnull],
                               input="int fa_probe;\n", capture_output=True, text=True)
            known[flags] = r.returncode == 0
        return known[flags]
    return accepts


def macros(target, accepts=None):
    return [macro for _, macro, _ in isa_kernels(target, accepts)]


def steps(target, accepts=None):
    """The compile steps for target, one per source: (path, flags of its own).
    Each also takes cflags(target)."""
    return ([(f"{SRC}/{name}", []) for name in SOURCES]
            + [(f"{SRC}/{name}", list(own)) for name, _, own in isa_kernels(target, accepts)])


def cflags(target, extra=(), accepts=None):
    """Flags for every file: common, OpenMP, the caller's (later ones win), headers, macros."""
    return [*FLAGS, OPENMP, *extra, f"-I{SRC}", *(f"-D{m}" for m in macros(target, accepts))]


def link_command(cc, programs, inputs, exe, target, extra=(), accepts=None):
    """cc compiling and linking programs with inputs (a library, objects or sources)."""
    return [cc, *cflags(target, extra, accepts), *programs, *inputs, "-o", exe, *LIBS]


def _object(out, path):
    return os.path.join(out, os.path.basename(path)[:-2] + ".o")


def cc_line(target, cc="cc", programs=("your.c",), exe="your"):
    """One shell line that builds programs with the sources, no library: the
    per-ISA kernels first, each alone into an object next to exe."""
    out, commands, objects = os.path.dirname(exe), [], []
    for path, own in steps(target):
        if own:
            objects.append(_object(out, path))
            commands.append([cc, *cflags(target), *own, "-c", path, "-o", objects[-1]])
    common = [path for path, own in steps(target) if not own]
    commands.append(link_command(cc, programs, common + objects, exe, target))
    return " && ".join(shlex.join(c) for c in commands)


def _ask(cc, flag):
    return subprocess.run([cc, flag], capture_output=True, text=True, check=True).stdout.strip()


def build_lib(cc="cc", out=OUT, extra=(), target=None, program=None, isa_objects=None):
    """Build out/libfastattn.a for the machine cc builds for (`cc -dumpmachine`,
    so a cross compiler gets its own kernels), printing each command; with
    program, also link out/<its name> against it. Returns the library's path.

    isa_objects: a folder that already holds the kernels' objects (every
    kernels_<name>.o: the per-ISA ones and the portable scalar and 128-bit
    sets, as setup.py's build leaves them in build/temp.*/src_c), archived as
    they are instead of compiled again. For tools/sanitize.sh, where each
    kernel takes minutes to compile under ASan, and for CI's suite (tests/
    conftest.py): the extension's build has just compiled them with the same
    compiler and macros. The other sources are still compiled here (seconds)."""
    target = target or _ask(cc, "-dumpmachine")
    accepts = compiler_accepts(cc)
    os.makedirs(out, exist_ok=True)

    printing = threading.Lock()

    def run(cmd):
        # One line a command, whole: print() writes the text and its newline
        # separately, so two compiler threads could interleave them (the
        # tests read these lines back).
        with printing:
            sys.stdout.write(shlex.join(cmd) + "\n")
            sys.stdout.flush()
        subprocess.run(cmd, check=True)

    # One compiler per file, as many at once as there are processors: the
    # per-ISA kernels take most of the time and build independently.
    commands, objects = [], []
    for path, own in steps(target, accepts):
        if isa_objects is not None and os.path.basename(path).startswith("kernels_"):
            objects.append(_object(isa_objects, path))
            if not os.path.isfile(objects[-1]):
                raise FileNotFoundError(f"--isa-objects {isa_objects}: no {os.path.basename(objects[-1])} "
                                        f"there; it needs one for every kernel built ({path})")
        else:
            commands.append([cc, *cflags(target, extra, accepts), *own, "-c", path, "-o", _object(out, path)])
            objects.append(commands[-1][-1])
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        list(pool.map(run, commands))
    lib = os.path.join(out, LIB)
    if os.path.exists(lib):
        os.remove(lib)  # `ar r` adds to an archive: a member from an older build would stay
    run([os.environ.get("AR") or _ask(cc, "-print-prog-name=ar"), "rcs", lib, *objects])
    if program:
        exe = os.path.join(out, os.path.splitext(os.path.basename(program))[0])
        run(link_command(cc, [program], [lib], exe, target, extra, accepts))
    return lib


def main(argv=None):
    p = argparse.ArgumentParser(prog="src_c/manifest.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    lib = sub.add_parser("lib", help=f"build DIR/{LIB} with every kernel for CC's target")
    lib.add_argument("--cc", default=os.environ.get("CC", "cc"))
    lib.add_argument("--out", default=OUT, metavar="DIR")
    lib.add_argument("--cflags", default="", help="added after the manifest's flags (later ones win)")
    lib.add_argument("--program", metavar="FILE.c", help="also link DIR/FILE against the library")
    lib.add_argument("--isa-objects", metavar="OBJDIR",
                     help="archive the kernels' objects (kernels_*.o) found in OBJDIR instead of compiling them")
    line = sub.add_parser("cc-line", help="print one shell line that builds FILE.c with the sources")
    line.add_argument("programs", nargs="*", default=["your.c"], metavar="FILE.c")
    line.add_argument("-o", dest="exe", default=None)
    line.add_argument("--cc", default="cc")
    kern = sub.add_parser("kernels", help="print the per-ISA kernels' names, comma-separated")
    kern.add_argument("--runnable", action="store_true", help="only those this CPU can run (/proc/cpuinfo)")
    kern.add_argument("--checking", action="store_true",
                      help="with --runnable: of the AVX-512 sets only the best (a sanitizer build's kernels)")
    for name in ("flags", "sources"):
        sub.add_parser(name, help=f"print the {name} for the target")
    for s in sub.choices.values():
        s.add_argument("--target", default=None, help="default: this machine (lib: CC's target)")
    a = p.parse_args(argv)
    target = a.target or platform.machine()
    if a.command == "lib":
        build_lib(a.cc, a.out, shlex.split(a.cflags), a.target, a.program, a.isa_objects)
    elif a.command == "cc-line":
        print(cc_line(target, a.cc, a.programs, a.exe or os.path.splitext(a.programs[0])[0]))
    elif a.command == "kernels":
        names = runnable_kernels() if a.runnable else [kernel_name(f) for f, _, _ in ISA_X86_64]
        print(",".join(checking_kernels(names) if a.checking else names))
    elif a.command == "sources":
        print("\n".join(path for path, _ in steps(target)))
    else:
        print(shlex.join(cflags(target)))
        for path, own in steps(target):
            if own:
                print(f"{path}: {shlex.join(own)}")
        print(f"link: {shlex.join([OPENMP, *LIBS])}")


if __name__ == "__main__":
    sys.exit(main())
