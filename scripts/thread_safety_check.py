#!/usr/bin/python3
"""Clang's thread-safety analysis over the C++ sources that use core::Mutex.

Configures (or reconfigures) a clang build directory without CUDA, benchmarks
or the example model, and never builds it: only its compile_commands.json is
used (about 2 s). Each C++ source under SOURCE_DIRS whose quoted includes reach core/mutex.h or
core/thread_annotations.h (followed through headers) is run through
`clang++ -fsyntax-only -Wthread-safety -Wthread-safety-beta
-Werror=thread-safety` with the build's own include paths and defines; the
project's other warning flags are dropped (the GCC builds check those).
EXCLUDED sources are not checked, and diagnostics located in EXCLUDED files
(headers included from checked sources) are counted apart and do not fail the
check; everything else a checked source includes is checked where it is
included. A clang error of any other kind fails it. New sources are picked up
from the compile database.

Writes one meson-testlog-style line to --log ("thread-safety (clang)", OK,
FAIL or SKIP when clang++ is missing) for scripts/test_summary.py.
Usage: scripts/thread_safety_check.py [--build-dir build-tsa] [--log FILE] [-j N]
Exit status: 0 clean (or skipped), 1 on any diagnostic or failure.
"""
import argparse
import concurrent.futures
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time

SOURCE_DIRS = ("core/", "gpu/", "nvme/", "cpu_adam/", "engine/", "bindings/c/",
               # Their unit tests: the only includers of some private headers
               # (engine/internal/) besides excluded files, and where templates
               # such as BufferCache get instantiated (and so analyzed).
               "tests/core/", "tests/gpu/", "tests/nvme/", "tests/cpu_adam/", "tests/engine/",
               "tests/c_api/")
ANNOTATION_HEADERS = {"core/mutex.h", "core/thread_annotations.h"}

# Files (or folders, ending in '/') left out while a rewrite is in progress;
# empty since the engine carries its annotations. Sources listed here are not
# checked; diagnostics inside any file listed here are ignored wherever it is
# included.
EXCLUDED = ()

CLANG = "clang++"
TSA_FLAGS = [
    "-fsyntax-only",
    "-Wthread-safety",
    "-Wthread-safety-beta",
    "-Werror=thread-safety",
    "-Werror=thread-safety-beta",
    "-Wno-unknown-warning-option",  # GCC-only -Wno-* flags of some sources
    "-fno-color-diagnostics",
    "-ferror-limit=0",
]
# Flags of the compile database that this check drops: outputs and
# dependency files (with their argument), and the GCC build's warning set.
DROP_WITH_ARG = {"-o", "-MF", "-MQ", "-MT"}
DROP = {"-c", "-MD", "-MMD", "-Werror", "-Wall", "-Wextra", "-Wpedantic", "-pedantic",
        "-fcolor-diagnostics", "-fdiagnostics-color=always"}
INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)
# The first line of a clang diagnostic (notes belong to the one before).
DIAGNOSTIC = re.compile(r"^(?P<file>[^:\s][^:]*):\d+:\d+: (?P<kind>error|warning|fatal error): ")
INCLUDED_FROM = re.compile(r"^In file included from ")


def is_excluded(rel):
    return any(rel == e or (e.endswith("/") and rel.startswith(e)) for e in EXCLUDED)


class IncludeGraph:
    """Quoted includes, resolved from the repository root (the project's rule)
    or from the including file's folder."""

    def __init__(self, root):
        self.root = root
        self.edges = {}

    def includes(self, rel):
        if rel not in self.edges:
            found = set()
            try:
                with open(os.path.join(self.root, rel), encoding="utf-8", errors="replace") as f:
                    text = f.read()
            except OSError:
                text = ""
            for name in INCLUDE.findall(text):
                for cand in (name, os.path.join(os.path.dirname(rel), name)):
                    cand = os.path.normpath(cand)
                    if os.path.isfile(os.path.join(self.root, cand)):
                        found.add(cand)
                        break
            self.edges[rel] = found
        return self.edges[rel]

    def reaches(self, rel, targets):
        seen, stack = {rel}, [rel]
        while stack:
            for inc in self.includes(stack.pop()):
                if inc in targets:
                    return True
                if inc not in seen:
                    seen.add(inc)
                    stack.append(inc)
        return rel in targets


def configure(root, build_dir):
    env = dict(os.environ, CXX=CLANG, CC="clang")
    options = ["-Dcuda=disabled", "-Dtests=enabled", "-Dbenchmarks=disabled", "-Dopenblas=disabled"]
    if os.path.exists(os.path.join(build_dir, "build.ninja")):
        cmd = ["meson", "setup", "--reconfigure", build_dir] + options
    else:
        cmd = ["meson", "setup", build_dir] + options
    r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        sys.stdout.write(r.stdout + r.stderr)
    return r.returncode == 0


def check_command(entry):
    args = shlex.split(entry["command"]) if "command" in entry else list(entry["arguments"])
    out, skip = [], False
    for a in args[1:]:
        if skip:
            skip = False
        elif a in DROP_WITH_ARG:
            skip = True
        elif a not in DROP:
            out.append(a)
    return [CLANG] + TSA_FLAGS + out


def split_diagnostics(text):
    """Clang's output as (file, lines) blocks: each error or warning with the
    include stack before it and the source lines and notes after it."""
    blocks, pending = [], []
    for line in text.splitlines(keepends=True):
        m = DIAGNOSTIC.match(line)
        if m:
            blocks.append((m.group("file"), pending + [line]))
            pending = []
        elif INCLUDED_FROM.match(line):
            pending.append(line)
        elif blocks:
            blocks[-1][1].extend(pending + [line])
            pending = []
        else:
            pending.append(line)
    if pending:
        blocks.append(("", pending))  # no diagnostic of a file: counted, never ignored
    return blocks


def select(root, entries):
    graph = IncludeGraph(root)
    chosen = []
    for e in entries:
        path = os.path.normpath(os.path.join(e["directory"], e["file"]))
        rel = os.path.relpath(path, root)
        if not rel.endswith((".cpp", ".cc")) or not rel.startswith(SOURCE_DIRS):
            continue
        if is_excluded(rel) or not graph.reaches(rel, ANNOTATION_HEADERS):
            continue
        chosen.append((rel, e))
    return sorted(chosen, key=lambda x: x[0])


def write_log(path, result, text, seconds):
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(json.dumps({"name": "thread-safety (clang)", "result": result,
                            "duration": seconds, "stdout": text}) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-dir", default="build-tsa")
    ap.add_argument("--log", default="")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    build_dir = os.path.join(root, args.build_dir)
    start = time.monotonic()

    if shutil.which(CLANG) is None:
        msg = f"thread-safety: SKIP: {CLANG} not found (scripts/install-deps.sh installs clang)\n"
        sys.stdout.write(msg)
        write_log(args.log, "SKIP", msg, 0.0)
        return 0
    if not configure(root, build_dir):
        msg = f"thread-safety: FAIL: configuring {args.build_dir} with {CLANG} failed\n"
        sys.stdout.write(msg)
        write_log(args.log, "FAIL", msg, time.monotonic() - start)
        return 1
    with open(os.path.join(build_dir, "compile_commands.json")) as f:
        entries = json.load(f)
    chosen = select(root, entries)
    if not chosen:
        msg = f"thread-safety: FAIL: no source in {args.build_dir}/compile_commands.json to check\n"
        sys.stdout.write(msg)
        write_log(args.log, "FAIL", msg, time.monotonic() - start)
        return 1

    def run(item):
        rel, entry = item
        r = subprocess.run(check_command(entry), cwd=entry["directory"], capture_output=True, text=True)
        return rel, entry["directory"], r.returncode, r.stdout + r.stderr

    failed, report, ignored = [], [], []
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for rel, directory, rc, text in pool.map(run, chosen):
            counted = ignored_here = 0
            for path, lines in split_diagnostics(text):
                where = os.path.relpath(os.path.normpath(os.path.join(directory, path)), root) if path else ""
                if where and is_excluded(where):
                    ignored.append(where)
                    ignored_here += 1
                else:
                    report.append("".join(lines))
                    counted += 1
            # A failed run is explained only by diagnostics in excluded files.
            if counted or (rc != 0 and ignored_here == 0):
                failed.append(rel)
    secs = time.monotonic() - start
    excluded_files = sorted(set(ignored))
    summary = (f"thread-safety: {len(chosen)} sources checked, {len(failed)} failed"
               f" ({', '.join(failed) if failed else 'clean'}), {secs:.1f} s;"
               f" {len(ignored)} diagnostics ignored in excluded files"
               f"{' (' + ', '.join(excluded_files) + ')' if excluded_files else ''};"
               f" excluded: {', '.join(EXCLUDED) if EXCLUDED else 'none'}\n")
    text = "".join(report) + summary
    sys.stdout.write(text)
    write_log(args.log, "FAIL" if failed else "OK", text, secs)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
