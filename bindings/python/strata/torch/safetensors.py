"""Reading and writing safetensors files with torch tensors (what strata
exports; LoRA adapters), for tools and tests on machines without the
`safetensors` package."""
import json
import os
import struct

import torch

_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


_NAMES = {v: k for k, v in _DTYPES.items()}


def save_file(tensors, path, metadata=None):
    """Writes {name: tensor} as one .safetensors file (the tensors' dtypes,
    in name order, the header padded to 8 bytes as the format asks), through
    a temporary file renamed into place."""
    header, blobs, at = {}, [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        if t.dtype not in _NAMES:
            raise ValueError(f"{path}: tensor {name} has dtype {t.dtype}, which this writer does not know")
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + len(raw)]}
        blobs.append(raw)
        at += len(raw)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for raw in blobs:
            f.write(raw)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def tensor_names(path):
    """The tensor names of a safetensors directory (model.safetensors.index.json
    or model.safetensors) or file, read from the headers alone."""
    if os.path.isdir(path):
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                return set(json.load(f)["weight_map"])
        path = os.path.join(path, "model.safetensors")
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: too short for a safetensors file")
        (n,) = struct.unpack("<Q", head)
        header = json.loads(f.read(n))
    return {k for k in header if k != "__metadata__"}


def load_file(path):
    """{name: tensor} of one .safetensors file (CPU tensors, the file's dtypes)."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        raise ValueError(f"{path}: {len(data)} bytes, too short for a safetensors file")
    (header_len,) = struct.unpack("<Q", data[:8])
    if 8 + header_len > len(data):
        raise ValueError(f"{path}: header of {header_len} bytes runs past the end of the file ({len(data)} bytes)")
    header = json.loads(data[8:8 + header_len])
    base = 8 + header_len
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: tensor {name} has dtype {info['dtype']}, which this reader does not know")
        begin, end = info["data_offsets"]
        raw = bytearray(data[base + begin:base + end])
        t = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
        out[name] = t.reshape(info["shape"]).clone()
    return out


def load_dir(directory):
    """{name: tensor} of a Hugging Face weights directory: model.safetensors, or
    the shards named in model.safetensors.index.json."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    out = {}
    for name in files:
        out.update(load_file(os.path.join(directory, name)))
    return out
