#!/usr/bin/python3
"""Runs the shell commands shown in README.md and docs/*.md (```sh / ```bash
blocks), so the docs' examples are executed, not trusted.

Each command is either run, rewritten onto this build's binaries, or skipped
for a stated reason (SKIP); a command that matches no rule fails the test, so
a new command in the docs has to be classified here.

Rewrites (scripts/run.sh builds a release tree first; here the build under
test stands in for it):
  bash scripts/run.sh plan ARGS      -> strata plan [--config examples/configs/strata_default.json] ARGS
  bash scripts/run.sh --native ARGS  -> strata-train [--config examples/configs/strata_default.json] ARGS
  bash scripts/run.sh ARGS           -> python3 examples/python/train_llama.py ARGS (needs torch)
  examples/python/train_llama.py ARGS   the same
  strata COMMAND ARGS                -> this build's strata COMMAND ARGS (config paths made absolute)
Shortening rule for training runs: --steps is capped at STEPS_CAP and
--save-every at the (capped) step count, so a saving run still saves. The
commands of one file run in order in one scratch directory (holding
./strata_swap), so a later command finds what an earlier one wrote (an
export, a checkpoint).

Usage: docs_commands_test.py SOURCE_ROOT STRATA_EXE STRATA_TRAIN_EXE LIBSTRATA_SO [--no-python]
(--no-python: a sanitizer build, whose libstrata.so the interpreter cannot load; the Python
commands are skipped there and run in the normal build)"""
import glob
import os
import re
import shlex
import subprocess
import sys
import tempfile

STEPS_CAP = 3
NO_PYTHON = False  # set by --no-python
# README.md and every docs/*.md (a new page is covered without a change here).
# (regex on the command, reason): commands not run here.
SKIP = [
    (r"^bash scripts/run\.sh$", "the whole main job: installs packages, builds a release tree, trains 120 steps "
                                "(its parts run below through the rewrites)"),
    (r"^bash scripts/test\.sh( --full)?$", "the whole test suite, which runs this test"),
    (r"^bash scripts/install-deps\.sh", "installs Debian packages (root, network)"),
    (r"^export PATH=", "sets up a shell, runs nothing"),
    (r"^meson (setup|test)\b", "the build and the test suite themselves"),
    (r"^ninja\b", "the build itself"),
    (r"^bash scripts/bench\.sh\b", "a benchmark: minutes long, overwrites docs/results (scripts/bench.sh builds "
                                   "it in build-bench/ first)"),
    (r"^STRATA_LIBRARY=\S+ \S*python3 benchmarks/", "a benchmark: minutes long, overwrites docs/results"),
    (r"^\S*python3 scripts/plot_step_bench\.py docs/results/", "redraws a figure in docs/results from benchmark "
                                                              "results (matplotlib); checks nothing"),
    (r"\bBUILD/", "a before/after comparison of two builds (BUILD names each; the configs it uses are described "
                  "beside it): minutes, 20 GiB of memory"),
    (r"^\.\./shared/tools/device-debs\b", "downloads Debian packages for the GPU machine (network, apt)"),
    (r"^(bash )?scripts/gpu-test\.sh\b", "the GPU check: builds build-gpu/ and runs every GPU stage (minutes; on "
                                          "a GPU machine through the device tool)"),
    (r"^python3 -m venv --system-site-packages \.venv$", "makes a venv for the pip install below"),
    (r"^\.venv/bin/pip install --no-build-isolation \.$", "builds libstrata from scratch into a venv (minutes): "
                                                        "tests/python/test_packaging.py does it from a copy of the "
                                                        "tree (meson test --suite wheel, scripts/test.sh --full)"),
    (r"^cd \S+ && mkdir -p strata_swap$", "makes a scratch directory with ./strata_swap (the commands here run in "
                                         "one)"),
    (r"^sync; echo 3 > /proc/sys/vm/drop_caches$", "drops the page cache before a timed run (root)"),
    (r"^build-release/examples/train/strata-train --config lv_\S+\.json ", "a timed benchmark run of configs "
                                                                          "described beside it (a minute each, "
                                                                          "4 GiB of swap files)"),
]


def commands(text):
    """The commands of ```sh / ```bash blocks: continuation lines joined,
    comments and prompts dropped."""
    out = []
    for block in re.findall(r"^```(?:sh|bash|shell)\n(.*?)^```", text, re.M | re.S):
        joined = block.replace("\\\n", " ")
        for line in joined.splitlines():
            line = line.strip()
            if line.startswith("$ "):
                line = line[2:]
            if not line or line.startswith("#"):
                continue
            # A trailing comment: everything from a '#' preceded by whitespace.
            line = re.sub(r"\s+#.*$", "", line).strip()
            out.append(re.sub(r"\s+", " ", line))
    return out


def cap_steps(args):
    args = list(args)
    steps = None
    for flag in ("--steps",):
        if flag in args:
            i = args.index(flag)
            steps = min(int(float(args[i + 1])), STEPS_CAP)
            args[i + 1] = str(steps)
    if steps is None and "--init-from" not in args:
        args += ["--steps", str(STEPS_CAP)]
        steps = STEPS_CAP
    if "--save-every" in args:
        i = args.index("--save-every")
        args[i + 1] = str(min(int(args[i + 1]), steps or STEPS_CAP))
    return args


def absolute_configs(args, root):
    return [os.path.join(root, a) if a.startswith("examples/") else a for a in args]


def with_default_config(args, root):
    if any(a == "--config" or a.startswith("--config=") for a in args):
        return args
    return ["--config", os.path.join(root, "examples/configs/strata_default.json")] + args


def rewrite(cmd, root, strata, strata_train, have_torch):
    """(argv, why_not): the command on this build's binaries, or None and why."""
    for pattern, why in SKIP:
        if re.search(pattern, cmd):
            return None, why
    argv = shlex.split(cmd)
    if argv[:1] == ["examples/python/train_llama.py"]:  # the PyTorch example run directly: as run.sh runs it
        argv = ["bash", "scripts/run.sh"] + argv[1:]
    if argv[:2] == ["bash", "scripts/run.sh"]:
        rest = argv[2:]
        if rest[:1] == ["plan"]:
            return [strata, "plan"] + with_default_config(absolute_configs(rest[1:], root), root), None
        if rest[:1] == ["--native"]:
            args = with_default_config(absolute_configs(rest[1:], root), root)
            return [strata_train] + cap_steps(args), None
        if not have_torch:
            return None, "the PyTorch example needs torch (python3-torch), not installed"
        if NO_PYTHON:
            return None, ("a sanitizer build: the interpreter cannot load its instrumented libstrata.so "
                          "(the normal build runs this command)")
        args = cap_steps(absolute_configs(rest, root))
        if "--init-from" in args and "--steps" not in args:
            args += ["--steps", str(STEPS_CAP)]
        quiet = [f for f in (["--no-progress"], ["--sample", "0"], ["--eval-every", "0"]) if f[0] not in args]
        return [sys.executable, os.path.join(root, "examples/python/train_llama.py")] + sum(quiet, []) + args, None
    if argv[:1] == ["strata"]:
        return [strata] + absolute_configs(argv[1:], root), None
    return None, None


def main():
    global NO_PYTHON
    NO_PYTHON = "--no-python" in sys.argv[5:]
    root, strata, strata_train, lib = (os.path.abspath(a) for a in sys.argv[1:5])
    try:
        import torch  # noqa: F401
        have_torch = True
    except ImportError:
        have_torch = False
    env = dict(os.environ, STRATA_LIBRARY=lib, PYTHONDONTWRITEBYTECODE="1")
    ran, skipped, failures = [], [], []
    docs = ["README.md"] + sorted(os.path.relpath(p, root) for p in glob.glob(os.path.join(root, "docs", "*.md")))
    for doc in docs:
        path = os.path.join(root, doc)
        if not os.path.exists(path):
            continue
        with tempfile.TemporaryDirectory(prefix="strata_docs_") as tmp:
            os.mkdir(os.path.join(tmp, "strata_swap"))
            for cmd in commands(open(path).read()):
                argv, why = rewrite(cmd, root, strata, strata_train, have_torch)
                if argv is None and why is None:
                    failures.append(f"{doc}: `{cmd}`: no rule runs or skips it: add one to {__file__}")
                    continue
                if argv is None:
                    skipped.append(f"{doc}: `{cmd}`: {why}")
                    continue
                r = subprocess.run(argv, cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
                shown = " ".join(shlex.quote(a) for a in argv)
                if r.returncode != 0:
                    failures.append(f"{doc}: `{cmd}` exited {r.returncode}\n  ran: {shown}\n"
                                    f"{r.stdout[-2000:]}{r.stderr[-2000:]}")
                else:
                    ran.append(f"{doc}: `{cmd}`\n    as: {shown}")
    print(f"ran {len(ran)} commands:")
    for line in ran:
        print("  " + line)
    print(f"skipped {len(skipped)}:")
    for line in skipped:
        print("  " + line)
    for f in failures:
        print("FAILED " + f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
