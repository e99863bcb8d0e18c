#!/usr/bin/python3
"""The C example of bindings/c/README.md ("## Example: ...") compiles as C11
with -Wall -Wextra -Werror and links against libstrata.so, as shown.
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
            # The example defines train(); a program calls it.
            f.write("\nint main(void) { return 0; }\n")
        out = os.path.join(tmp, "readme_example")
        cmd = cc + ["-std=c11", "-Wall", "-Wextra", "-Werror", "-pedantic", "-I", include_dir, src, "-o", out,
                    lib, "-Wl,-rpath," + os.path.dirname(os.path.abspath(lib))]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            print("the README's C example does not compile as shown:\n" + " ".join(cmd) + "\n" + r.stderr)
            return 1
    print(f"{readme}: the C example compiles and links ({len(blocks[0].splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
