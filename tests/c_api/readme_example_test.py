#!/usr/bin/python3
"""The C example of bindings/c/README.md ("## Example: ...") compiles as C11
with -Wall -Wextra -Werror -pedantic, links against libstrata.so, as shown,
and does what the README says when run: on an empty swap folder it trains
(exit 0, the loss it prints falls a hundredfold over its 100 steps, and the
folder is left empty), on a missing folder it exits 1 naming the folder in
finalize's error, and without an argument it prints its usage (exit 2).
Usage: readme_example_test.py README INCLUDE_DIR LIBSTRATA_SO CC [CC_ARGS...]"""
import os
import re
import subprocess
import sys
import tempfile


def main():
    readme, include_dir, lib = sys.argv[1:4]
    cc = sys.argv[4:]
    text = open(readme).read()
    section = re.search(r"^## Example\b.*?$(.*?)^## ", text, re.M | re.S)
    if section is None:
        print(f"{readme}: no '## Example' section")
        return 1
    blocks = re.findall(r"^```c\n(.*?)^```", section.group(1), re.M | re.S)
    if len(blocks) != 1:
        print(f"{readme}: expected one ```c block under '## Example', found {len(blocks)}")
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "readme_example.c")
        with open(src, "w") as f:
            f.write(blocks[0])
        out = os.path.join(tmp, "readme_example")
        cmd = cc + ["-std=c11", "-Wall", "-Wextra", "-Werror", "-pedantic", "-I", include_dir, src, "-o", out,
                    lib, "-Wl,-rpath," + os.path.dirname(os.path.abspath(lib))]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            print("the README's C example does not compile as shown:\n" + " ".join(cmd) + "\n" + r.stderr)
            return 1
        failures = run_checks(out, tmp)
        if failures:
            print("the README's C example does not behave as the README says:\n" + "\n".join(failures))
            return 1
    print(f"{readme}: the C example compiles, links and trains ({len(blocks[0].splitlines())} lines)")
    return 0


def run_checks(program, tmp):
    failures = []
    swap = os.path.join(tmp, "swap")
    os.mkdir(swap)
    r = subprocess.run([program, swap], capture_output=True, text=True, timeout=120)
    losses = [float(m) for m in re.findall(r"^step +\d+ +loss ([0-9.e+-]+)", r.stdout, re.M)]
    if r.returncode != 0:
        failures.append(f"on {swap}: exit {r.returncode}\n{r.stdout}{r.stderr}")
    elif len(losses) != 5 or not losses[-1] < losses[0] / 100:
        failures.append(f"on {swap}: the loss did not fall a hundredfold over five report lines:\n{r.stdout}")
    elif os.listdir(swap):
        failures.append(f"on {swap}: left {os.listdir(swap)} (destroy removes the swap files)")
    missing = os.path.join(tmp, "no-such-folder")
    r = subprocess.run([program, missing], capture_output=True, text=True, timeout=120)
    if r.returncode != 1 or "strata_engine_finalize" not in r.stderr or missing not in r.stderr:
        failures.append(f"on a missing folder: want exit 1 and finalize's error naming {missing}; got exit "
                        f"{r.returncode}\n{r.stdout}{r.stderr}")
    r = subprocess.run([program], capture_output=True, text=True, timeout=60)
    if r.returncode != 2 or "usage:" not in r.stderr:
        failures.append(f"without an argument: want its usage and exit 2; got exit {r.returncode}\n{r.stderr}")
    return failures


if __name__ == "__main__":
    sys.exit(main())
