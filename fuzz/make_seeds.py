#!/usr/bin/python3
"""Writes the generated seeds of fuzz/corpus/ (safetensors files and swap indexes) in the
formats engine/checkpoint/safetensors.h and nvme/internal/swap_index.h describe: small valid files and
edge cases. The config seeds are copies of examples/configs/*.json plus hand-written cases,
and crash regressions are added by hand; none of those are touched here.
Usage: fuzz/make_seeds.py   (from anywhere; rewrites only the files it names)"""
import json
import os
import struct

ROOT = os.path.dirname(os.path.abspath(__file__))


def crc64(data, crc=0):
    """CRC-64/XZ (ECMA-182 polynomial, reflected, init and final XOR all ones), as nvme/crc64.h."""
    crc ^= 0xFFFFFFFFFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0xC96C5795D7870F42 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFFFFFFFFFF


assert crc64(b"123456789") == 0x995DC9BBDF1939FA


def write(folder, name, data):
    os.makedirs(os.path.join(ROOT, "corpus", folder), exist_ok=True)
    with open(os.path.join(ROOT, "corpus", folder, name), "wb") as f:
        f.write(data)


# --- safetensors: 8-byte little-endian header length, JSON header, data ---------------------
def safetensors(tensors, metadata=None, pad=True):
    """tensors: [(name, dtype, shape, bytes)] laid out in order."""
    header, data = {}, b""
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape, payload in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(payload)]}
        data += payload
    text = json.dumps(header, separators=(",", ":")).encode()
    if pad:  # the reference writer pads the header with spaces to a multiple of 8
        text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


f32 = struct.pack("<6f", 1.0, -2.5, 0.0, float("inf"), 1e-40, 3.0)
bf16 = bytes([0x80, 0x3F, 0x00, 0xC0, 0x49, 0x40, 0x00, 0x00])  # 1.0, -2.0, 3.140625, 0.0
f16 = struct.pack("<4e", 1.0, -0.5, 65504.0, 6e-8)
write("safetensors", "three_dtypes.safetensors",
      safetensors([("w", "F32", [2, 3], f32), ("b", "BF16", [4], bf16), ("h", "F16", [2, 2], f16)],
                  metadata={"format": "pt"}))
write("safetensors", "empty_header.safetensors", safetensors([]))
write("safetensors", "scalar_and_empty.safetensors",
      safetensors([("s", "F32", [], struct.pack("<f", 7.0)), ("z", "BF16", [0, 5], b"")], pad=False))
write("safetensors", "unsupported_dtype.safetensors", safetensors([("i", "I64", [1], struct.pack("<q", 1))]))
overlap = json.dumps({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                      "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, separators=(",", ":")).encode()
write("safetensors", "overlap.safetensors", struct.pack("<Q", len(overlap)) + overlap + bytes(8))


# --- swap index (version 1) -----------------------------------------------------------------
def swap_index(stripe, paths, blocks, version=1):
    """paths: [(path, file_bytes)]; blocks: [(id, size, written, crc_valid, [(path, offset, length, crc)])]."""
    out = b"STRATASW" + struct.pack("<IIQI", version, 0, stripe, len(paths))
    for p, size in paths:
        out += struct.pack("<I", len(p)) + p.encode() + struct.pack("<Q", size)
    out += struct.pack("<Q", len(blocks))
    for bid, size, written, crc_valid, extents in sorted(blocks):
        out += struct.pack("<I", len(bid)) + bid.encode()
        out += struct.pack("<QBBI", size, written, crc_valid, len(extents))
        for e in extents:
            out += struct.pack("<IQQQ", *e)
    return out + struct.pack("<Q", crc64(out))


zeros = crc64(bytes(4096))
# One path, three blocks as a store writes them (extents 4 KiB aligned), one never written.
write("swap_index", "one_path.index", swap_index(8 << 20, [("/tmp/strata_swap", 1 << 20)], [
    ("opt.g0.m", 4096, 1, 1, [(0, 0, 4096, zeros)]),
    ("opt.g0.v", 5000, 1, 1, [(0, 4096, 5000, crc64(bytes(5000)))]),
    ("never-written", 100, 0, 0, [(0, 12288, 100, 0)]),
]))
# Two paths, a block striped over both in 8 KiB units.
write("swap_index", "two_paths_striped.index", swap_index(8192, [("/a", 65536), ("/b", 65536)], [
    ("p", 24576, 1, 1, [(0, 0, 8192, crc64(bytes(8192))), (1, 0, 8192, crc64(bytes(8192))),
                        (0, 8192, 8192, crc64(bytes(8192)))]),
]))
write("swap_index", "empty_store.index", swap_index(8 << 20, [("/tmp/s", 4096)], []))
write("swap_index", "version2.index", swap_index(8 << 20, [("/tmp/s", 4096)], [], version=2))
write("swap_index", "bad_path_index.index", swap_index(4096, [("/tmp/s", 8192)], [
    ("x", 4096, 1, 1, [(3, 0, 4096, zeros)]),
]))
write("swap_index", "overlapping_extents.index", swap_index(4096, [("/tmp/s", 8192)], [
    ("x", 4096, 1, 1, [(0, 0, 4096, zeros)]), ("y", 4096, 1, 1, [(0, 0, 4096, zeros)]),
]))
