"""Kernel A/B timing from C: builds of tools/decode_timing.c against several
variants of the library, run in turn, process by process.

    python tools/decode_ab.py build DIR [--checkout PATH] [--cflags=FLAGS]
    python tools/decode_ab.py run ROUNDS "DTYPE B HQ HKV L S E THREADS CALLS COPIES" DIR_A DIR_B ...

`build` compiles the library of PATH's src_c (default: this checkout; a
`git worktree` of the base commit for an A/B of two commits) with FLAGS
added (a knob set with -D, say) into DIR, and links DIR/decode_timing.
`run` runs every DIR's program once a round for ROUNDS rounds, in reversed
order every other round (so that neither side always runs first on a
warmer or cooler machine), and prints each DIR's median time and the median
of its per-round ratios over DIR_A's: the figures docs/tuning.md gives.
It sets HUGE=1 (huge pages, as NumPy's arrays get) unless HUGE is set, and
passes FASTATTN_ISA through, so the set under test is named by the caller.
Stdlib only; a tool, not a test: figures depend on the machine and its load.
"""
import argparse
import os
import pathlib
import statistics
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
PROGRAM = HERE / "decode_timing.c"


def build(out, checkout, cflags):
    out = pathlib.Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "src_c/manifest.py", "lib", "--out", str(out), "--program", str(PROGRAM)]
    if cflags:
        cmd.append(f"--cflags={cflags}")
    r = subprocess.run(cmd, cwd=checkout, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"decode_ab: the build in {checkout} failed:\n{r.stdout}\n{r.stderr}")
    print(out / "decode_timing")


def run(rounds, args, dirs):
    programs = [pathlib.Path(d) / "decode_timing" for d in dirs]
    for p in programs:
        if not p.is_file():
            sys.exit(f"decode_ab: {p} does not exist; build it first (decode_ab.py build {p.parent})")
    env = dict(os.environ)
    env.setdefault("HUGE", "1")
    times = [[] for _ in programs]
    for r in range(rounds):
        order = list(range(len(programs)))
        if r % 2:
            order.reverse()
        for i in order:
            done = subprocess.run([str(programs[i]), *args.split()], capture_output=True, text=True, env=env)
            if done.returncode:
                sys.exit(f"decode_ab: {programs[i]} {args} exited {done.returncode}: {done.stderr.strip()}")
            times[i].append(float(done.stdout))
    print(f"{args} (FASTATTN_ISA={env.get('FASTATTN_ISA', 'default')}, Q_DTYPE={env.get('Q_DTYPE', 'f32')}, {rounds} rounds)")
    for d, t in zip(dirs, times):
        ratios = [x / a for x, a in zip(t, times[0])]
        print(f"  {d}: median {statistics.median(t):.4f} ms; over {dirs[0]}: median {statistics.median(ratios):.3f} "
              f"(min {min(ratios):.3f}, max {max(ratios):.3f})")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build DIR/decode_timing")
    b.add_argument("dir")
    b.add_argument("--checkout", default=str(HERE.parent), help="the checkout whose src_c to build")
    b.add_argument("--cflags", default="", help="extra compiler flags, e.g. -DFA_ROWS_CONVERT_G=4")
    r = sub.add_parser("run", help="alternate the builds and print medians")
    r.add_argument("rounds", type=int)
    r.add_argument("args", help="decode_timing's arguments, in one string")
    r.add_argument("dirs", nargs="+")
    a = ap.parse_args(argv)
    if a.cmd == "build":
        build(a.dir, a.checkout, a.cflags)
    else:
        if a.rounds < 1:
            ap.error(f"rounds must be at least 1, got {a.rounds}")
        run(a.rounds, a.args, a.dirs)


if __name__ == "__main__":
    main()
