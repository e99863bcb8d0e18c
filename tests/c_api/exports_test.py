#!/usr/bin/python3
"""libstrata.so exports exactly the symbols of strata.map (each under its
version node) and nothing of the engine or the static libraries it links; the
newest node is the header's version (STRATA_VERSION_MAJOR.MINOR), so a release's
new symbols get its own node.
Usage: exports_test.py NM LIBSTRATA_SO STRATA_MAP [STRATA_H]"""
import re
import subprocess
import sys


def main():
    nm, lib, map_path = sys.argv[1:4]
    text = open(map_path).read()
    nodes = re.findall(r"^(\w[\w.]*)\s*\{", text, re.M)
    wanted = set(re.findall(r"^\s+(strata_\w+);", text, re.M))
    out = subprocess.run([nm, "-D", "--defined-only", lib], check=True, capture_output=True, text=True).stdout
    got = set()
    bad = []
    for line in out.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        name = parts[2]
        base, _, version = name.partition("@")
        version = version.lstrip("@")
        if base in nodes:  # the version node's own symbol
            continue
        if not base.startswith("strata_") or version not in nodes:
            bad.append(name)
        got.add(base)
    missing = sorted(wanted - got)
    extra = sorted(got - wanted)
    for name in bad:
        print(f"exported but not a versioned strata_ symbol: {name}")
    for name in missing:
        print(f"in {map_path} but not exported: {name}")
    for name in extra:
        print(f"exported but not in {map_path}: {name}")
    version_bad = False
    if len(sys.argv) > 4:
        header = open(sys.argv[4]).read()
        major = re.search(r"#define STRATA_VERSION_MAJOR (\d+)", header).group(1)
        minor = re.search(r"#define STRATA_VERSION_MINOR (\d+)", header).group(1)
        if not nodes or nodes[-1] != f"STRATA_{major}.{minor}":
            print(f"the newest node of {map_path} is {nodes[-1] if nodes else 'none'}, but strata.h says "
                  f"{major}.{minor}: give the release's symbols a node STRATA_{major}.{minor}")
            version_bad = True
    if bad or missing or extra or version_bad:
        return 1
    print(f"{len(got)} symbols, all strata_*, all in {', '.join(nodes)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
