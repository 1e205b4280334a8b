"""Set one integer of a GGUF's architecture metadata (``<arch>.<key>``) in place, for scripts/tiny-models.

llama.cpp's test-llama-archs writes its tiny models with a 256-token training context, and
llama-server caps each slot at that (``n_ctx_slot = min(ctx_size / parallel, n_ctx_train)``); tests
that need longer prompts raise ``context_length`` here.  And it gives every architecture a sliding
window, which lfm2 takes (SWA beside its convolutions) where it is optional; ``attention.sliding_window``
0 makes the lfm2 without one.  The value is a fixed-width integer in the header, so the new one
overwrites the old one's bytes and nothing else of the file moves: no dependency beyond the standard
library (the ``gguf`` package would need numpy).  Layout: ggml's docs/gguf.md (magic, version, tensor
and key counts, then typed little-endian key/value pairs).

Usage: python3 tools/gguf_set_int.py KEY VALUE FILE...   (KEY without the architecture: context_length;
prints each file's old and new value)
"""

from __future__ import annotations

import struct
import sys
from typing import BinaryIO

# gguf_metadata_value_type: the fixed-size ones by struct format.
FIXED = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9
INTEGERS = {0, 1, 2, 3, 4, 5, 10, 11}


def read(file: BinaryIO, fmt: str) -> int:
    size = struct.calcsize("<" + fmt)
    data = file.read(size)
    if len(data) != size:
        raise ValueError("the header ends early")
    value: int = struct.unpack("<" + fmt, data)[0]
    return value


def string(file: BinaryIO) -> str:
    n = read(file, "Q")
    data = file.read(n)
    if len(data) != n:
        raise ValueError("the header ends early")
    return data.decode("utf-8", errors="replace")


def skip(file: BinaryIO, kind: int) -> None:
    if kind in FIXED:
        file.seek(struct.calcsize("<" + FIXED[kind]), 1)
    elif kind == STRING:
        file.seek(read(file, "Q"), 1)
    elif kind == ARRAY:
        item, n = read(file, "I"), read(file, "Q")
        if item in FIXED:
            file.seek(n * struct.calcsize("<" + FIXED[item]), 1)
        else:
            for _ in range(n):
                skip(file, item)
    else:
        raise ValueError(f"unknown value type {kind}")


def set_int(path: str, name: str, value: int) -> tuple[str, int]:
    """Overwrite ``<general.architecture>.<name>``; returns the whole key and its old value."""
    with open(path, "r+b") as file:
        if file.read(4) != b"GGUF":
            raise ValueError("not a GGUF file")
        version = read(file, "I")
        if version < 2:
            raise ValueError(f"GGUF version {version} is too old")
        read(file, "Q")  # tensors
        n_kv = read(file, "Q")
        arch = ""
        found: dict[str, tuple[int, int]] = {}  # key: (offset of its value, type)
        for _ in range(n_kv):
            key = string(file)
            kind = read(file, "I")
            if key == "general.architecture" and kind == STRING:
                arch = string(file)
                continue
            if key.endswith("." + name) and kind in INTEGERS:
                found[key] = (file.tell(), kind)
            skip(file, kind)
        key = f"{arch}.{name}"
        if key not in found:
            raise ValueError(f"no integer {key} in the header")
        offset, kind = found[key]
        fmt = "<" + FIXED[kind]
        file.seek(offset)
        old: int = struct.unpack(fmt, file.read(struct.calcsize(fmt)))[0]
        file.seek(offset)
        file.write(struct.pack(fmt, value))
        return key, old


def main(argv: list[str]) -> int:
    if len(argv) < 3 or not argv[1].isdigit():
        print("usage: gguf_set_int.py KEY VALUE FILE...", file=sys.stderr)
        return 2
    name, value = argv[0], int(argv[1])
    for path in argv[2:]:
        try:
            key, old = set_int(path, name, value)
        except (OSError, ValueError, struct.error) as err:
            print(f"gguf_set_int: {path}: {err}", file=sys.stderr)
            return 1
        print(f"{path}: {key} {old} -> {value}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
