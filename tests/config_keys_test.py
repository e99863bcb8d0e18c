#!/usr/bin/python3
"""Every configuration key a message of the code names exists: each key path
(strata.*, zero_optimization.*, optimizer.*, scheduler.*, aio.*, fp16.*,
bf16.*) inside a string literal of the C++ sources is a key of the resolved
configuration (strata_config_resolve, every key written) or of docs/config.md,
or the start of one (a section, "strata.budgets.*").
Usage: config_keys_test.py SOURCE_ROOT LIBSTRATA_SO"""
import ctypes
import json
import os
import re
import sys

DIRS = ("core", "gpu", "nvme", "cpu_adam", "engine", "bindings", "examples")
KEY = re.compile(r"\b(?:strata|zero_optimization|optimizer|scheduler|aio|fp16|bf16)\.[A-Za-z_][A-Za-z0-9_.]*")
LITERAL = re.compile(r'"(?:[^"\\\n]|\\.)*"')
# Configs whose resolved form writes every key (nvme paths and optional ones included).
CONFIGS = [
    {"train_batch_size": 1, "fp16": {"enabled": True},
     "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 10}},
     "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/x", "pin_memory": True},
                           "offload_optimizer": {"device": "nvme", "nvme_path": "/y", "pin_memory": True}},
     "strata": {"io": {"paths": ["/z"]}}},
    {"train_batch_size": 1, "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 2000}}},
]
# A stale name in a file being changed in parallel: (file, key) -> why. The
# test fails when an entry no longer occurs, so that it is removed.
KNOWN_STALE = {
    ("nvme/swap_store.cpp", "strata.budgets.disk_bytes"):
        "the swap store's messages; nvme/ is being changed by the swap-reclaim work of issue 17",
}


def keys_of(d, prefix=""):
    for k, v in d.items():
        yield prefix + k
        if isinstance(v, dict):
            yield from keys_of(v, prefix + k + ".")


def resolved_keys(lib_path):
    lib = ctypes.CDLL(lib_path)
    lib.strata_config_resolve.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p)]
    lib.strata_config_resolve.restype = ctypes.c_int
    lib.strata_last_error.restype = ctypes.c_char_p
    lib.strata_string_free.argtypes = [ctypes.c_void_p]
    keys = set()
    for config in CONFIGS:
        out = ctypes.c_void_p()
        if lib.strata_config_resolve(json.dumps(config).encode(), ctypes.byref(out)) != 0:
            raise SystemExit(f"strata_config_resolve failed: {lib.strata_last_error().decode()}")
        keys.update(keys_of(json.loads(ctypes.string_at(out.value).decode())))
        lib.strata_string_free(out)
    return keys


def main():
    root, lib_path = sys.argv[1:3]
    known = resolved_keys(lib_path)
    docs = open(os.path.join(root, "docs/config.md")).read()
    known.update(m.rstrip(".") for m in re.findall(r"`(" + KEY.pattern + r")`", docs))
    bad, seen_stale, checked = [], set(), 0
    for d in DIRS:
        for dirpath, _, files in os.walk(os.path.join(root, d)):
            for name in files:
                if not name.endswith((".cpp", ".h", ".cu")):
                    continue
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, root)
                for lineno, line in enumerate(open(path, encoding="utf-8", errors="replace"), 1):
                    if line.lstrip().startswith(("//", "#include")):
                        continue
                    for lit in LITERAL.findall(line):
                        for key in KEY.findall(lit):
                            key = key.rstrip(".")
                            checked += 1
                            if any(k == key or k.startswith(key) for k in known):
                                continue
                            if (rel, key) in KNOWN_STALE:
                                seen_stale.add((rel, key))
                                continue
                            bad.append(f"{rel}:{lineno}: {key} is not a configuration key (in {lit})")
    for entry, why in KNOWN_STALE.items():
        if entry not in seen_stale:
            bad.append(f"{entry[0]} no longer names {entry[1]}: remove it from KNOWN_STALE ({why})")
    for b in bad:
        print(b)
    if bad:
        return 1
    print(f"{checked} key names in messages, all keys of the configuration")
    return 0


if __name__ == "__main__":
    sys.exit(main())
