#!/usr/bin/python3
"""Fails on any include edge that the layering of docs/architecture.md and
STYLE.md section 1 forbids: who may include whom, and which files may include
vendor headers. Usage: layering_test.py SOURCE_ROOT"""
import fnmatch
import os
import re
import sys

INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)
SOURCE_EXT = (".h", ".hpp", ".c", ".cc", ".cpp", ".cu", ".cuh")

# Module -> quoted include prefixes it may use (its own folder is always allowed).
MODULES = {
    "core/": ["core/"],
    "gpu/": ["core/", "gpu/"],
    "nvme/": ["core/", "nvme/"],
    "cpu_adam/": ["core/", "cpu_adam/"],
    "partition/": ["core/", "partition/"],
    "engine/": ["core/", "engine/", "gpu/", "nvme/", "cpu_adam/", "partition/"],
    # partition/launch.h: strata_engine_create_ranked reads the launcher's environment.
    "bindings/c/": ["bindings/c/", "core/", "engine/", "strata/", "partition/launch.h"],
    # The CLI sees the C API and, for the planner, the engine's config and plan
    # headers (and the core helpers they are written in); `strata inspect` reads
    # checkpoints without an engine (engine/checkpoint/inspect.h).
    "bindings/cli/": ["bindings/cli/", "strata/", "engine/config.h", "engine/plan/",
                      "engine/checkpoint/inspect.h",
                      "engine/checkpoint/manifest.h", "core/"],
    "bindings/python/": ["bindings/python/", "strata/"],
    # The example model uses numerics.h's conversions (and Status) from the core.
    "examples/": ["examples/", "strata/", "core/"],
    "tests/c_api/": ["strata/"],
    "tests/core/": ["core/"],
    "tests/gpu/": ["core/", "gpu/"],
    "tests/nvme/": ["core/", "nvme/"],
    "tests/cpu_adam/": ["core/", "cpu_adam/"],
    "tests/partition/": ["core/", "partition/"],
    # Engine tests build the pieces the engine composes (a host device, a swap store).
    "tests/engine/": ["core/", "engine/", "strata/", "gpu/", "nvme/", "cpu_adam/"],
    # The command's flag parser, and the planner types it fills; checkpoints
    # written by hand for `strata inspect` (engine/checkpoint/manifest.h).
    "tests/cli/": ["bindings/cli/", "engine/plan/",
                   "engine/checkpoint/manifest.h", "engine/checkpoint/safetensors.h", "nvme/crc64.h", "core/"],
    # The engine's C++ interface until the C API covers the step (issue #6).
    "tests/e2e/": ["strata/", "core/", "engine/"],
    "tests/examples/": ["examples/", "core/"],
    "benchmarks/": ["core/", "cpu_adam/", "nvme/", "gpu/", "engine/", "strata/",
                    "benchmarks/"],
    # The fuzz targets: the parsers they feed, in the libraries they link.
    "fuzz/": ["core/", "engine/config.h", "engine/checkpoint/safetensors.h", "engine/checkpoint/manifest.h", "nvme/"],
}

# Vendor header -> file patterns allowed to include it (the firewall).
VENDOR = [
    (re.compile(r"^(cuda_runtime|cuda|cuda_fp16|cuda_bf16|cublas.*|cuda_runtime_api)\.h$"),
     # examples/model/cuda/ is a framework's side (the example model on cuBLAS), not the engine's.
     ["gpu/cuda/*", "partition/nccl/*", "examples/model/cuda/*", "tests/partition/nccl_*"]),
    (re.compile(r"^nccl\.h$"), ["partition/nccl/*"]),
    (re.compile(r"^gloo/"), ["partition/gloo/*"]),
    (re.compile(r"^liburing\.h$"), ["nvme/uring/*"]),
    (re.compile(r"^libaio\.h$"), ["nvme/aio/*"]),
    (re.compile(r"^(immintrin|x86intrin)\.h$"),
     ["cpu_adam/kernels/*_avx512*.cpp", "cpu_adam/kernels/*_avx2*.cpp", "cpu_adam/kernels/vec_avx512.h",
      "cpu_adam/kernels/vec_avx2.h",
      "benchmarks/*_avx512*.cpp", "benchmarks/*_avx2*.cpp"]),
    # OpenBLAS: the example model's host matrix products.
    (re.compile(r"^(cblas|openblas_config|f77blas)\.h$"), ["examples/model/*"]),
    # DLPack: the C API's implementation and its C tests (strata.h stays free of it).
    (re.compile(r"^dlpack/"), ["bindings/c/*.cpp", "tests/c_api/*"]),
    # JSON formats: the config, the safetensors header, the checkpoint manifest, and
    # the JSON the code writes (strata plan --json, the trace, the benchmarks' --json).
    (re.compile(r"^nlohmann/"), ["engine/config*", "tests/engine/config*", "engine/checkpoint/*",
                                    "engine/plan/format.cpp",
                                    "engine/trace.cpp", "benchmarks/*"]),
]


# The engine's rooms take narrow references and never see the facade: no file in
# one of these folders includes engine/engine.h (engine/README.md, "Rooms").
ENGINE_ROOMS = ["engine/schedule/", "engine/step/", "engine/fetch/", "engine/state/", "engine/config/",
                "engine/plan/", "engine/checkpoint/"]


def module_of(rel):
    best = None
    for prefix in MODULES:
        if rel.startswith(prefix) and (best is None or len(prefix) > len(best)):
            best = prefix
    return best


def check(root):
    errors = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        dirnames[:] = [d for d in dirnames
                       if not d.startswith(".") and not d.startswith("build") and d != "subprojects"]
        for name in filenames:
            if not name.endswith(SOURCE_EXT):
                continue
            rel = os.path.normpath(os.path.join(rel_dir, name))
            with open(os.path.join(dirpath, name), errors="replace") as f:
                text = f.read()
            mod = module_of(rel)
            for kind, header in INCLUDE.findall(text):
                for pattern, allowed in VENDOR:
                    if pattern.search(header) and not any(fnmatch.fnmatch(rel, a) for a in allowed):
                        errors.append(f"{rel}: includes vendor header <{header}>, allowed only in "
                                      + ", ".join(allowed))
                if kind == '"' and header == "engine/engine.h" and any(rel.startswith(r) for r in ENGINE_ROOMS):
                    errors.append(f"{rel}: includes \"engine/engine.h\": the engine's rooms never see the facade")
                if kind != '"' or mod is None:
                    continue
                if header.startswith("strata_build_config.h") or "/" not in header:
                    continue  # generated config header, or a sibling file
                own = os.path.dirname(rel) + "/"
                if header.startswith(own) or header.startswith(mod):
                    continue
                if not any(header.startswith(p) for p in MODULES[mod]):
                    errors.append(f"{rel}: includes \"{header}\": {mod} may include only "
                                  + ", ".join(MODULES[mod]))
    return errors


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else "."
    errors = check(root)
    for e in errors:
        print(e)
    print(f"layering: {len(errors)} forbidden edge(s)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
