#!/usr/bin/env python3
"""Round every F32 tensor of a gdntrain checkpoint's model.safetensors to bfloat16 (round to
nearest even), in place, keeping the F32 storage: the "bf16 noise" yardstick of docs/TRAINING.md.

    round_checkpoint_bf16.py RUN_DIR/checkpoints/step-N

Resuming from the rounded checkpoint (`gdntrain train --resume`) continues the run from weights
that differ from the original by one bf16 rounding (relative change <= 2^-9 per element); the
distance between the two loss curves measures how far this model's training amplifies rounding.
Pure Python (no numpy): the checkpoint is written to a temporary file and renamed over the original.
"""
import json
import os
import struct
import sys
from array import array


def round_bf16(words: array) -> None:
    for i, u in enumerate(words):
        if (u & 0x7F800000) == 0x7F800000:  # inf / nan: keep the bits
            continue
        words[i] = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16 << 16) & 0xFFFFFFFF


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    path = os.path.join(sys.argv[1], "model.safetensors")
    with open(path, "rb") as f:
        blob = bytearray(f.read())
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    base = 8 + n
    count = 0
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta["dtype"] != "F32":
            print(f"{path}: tensor {name} is {meta['dtype']}, not F32: left as it is", file=sys.stderr)
            continue
        s, e = meta["data_offsets"]
        words = array("I")
        words.frombytes(bytes(blob[base + s : base + e]))
        if sys.byteorder != "little":
            words.byteswap()
        round_bf16(words)
        if sys.byteorder != "little":
            words.byteswap()
        blob[base + s : base + e] = words.tobytes()
        count += 1
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(blob)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    print(f"{path}: {count} tensors rounded to bf16")
    return 0


if __name__ == "__main__":
    sys.exit(main())
