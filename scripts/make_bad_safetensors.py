#!/usr/bin/env python3
"""Writes the corpus of malformed safetensors files in tests/data/safetensors_bad/.

Each file is named <case>.safetensors; MANIFEST.tsv maps it to a fragment the reader's error
message must contain. Also writes good.safetensors (valid) as the fuzzer's seed. Run from the repo
root; the outputs are committed (a few hundred bytes each).
"""
import json
import os
import struct

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "safetensors_bad")


def image(header, data=b"", pad=True, length=None):
    h = json.dumps(header, separators=(",", ":")).encode()
    if pad:
        h += b" " * ((8 - len(h) % 8) % 8)
    n = len(h) if length is None else length
    return struct.pack("<Q", n) + h + data


def f32(*vals):
    return struct.pack("<%df" % len(vals), *vals)


GOOD = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [8, 16]}}
GOOD_DATA = f32(1.0, 2.0) + b"\x80\x3f" * 4

CASES = {
    "empty": (b"", "too short for a safetensors header length"),
    "short_len": (b"\x01\x02\x03", "too short"),
    "header_past_end": (image(GOOD, GOOD_DATA, length=10_000), "runs past the end of the file"),
    "absurd_dim": (image({"a": {"dtype": "F32", "shape": [1 << 50], "data_offsets": [0, 4]}},
                         f32(1)), "absurd dimension"),
    "header_huge": (struct.pack("<Q", 1 << 40) + b"{}", "exceeds the limit"),
    "bad_json": (struct.pack("<Q", 8) + b"{\"a\":[1" + b" ", "not valid JSON"),
    "not_object": (image([1, 2, 3]), "not a JSON object"),
    "truncated_data": (image(GOOD, GOOD_DATA[:12]), "run past the data"),
    "trailing_bytes": (image(GOOD, GOOD_DATA + b"xx"), "truncated or trailing bytes"),
    "overlap": (image({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                       "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}},
                      f32(1, 2, 3)), "overlap or gap"),
    "gap": (image({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                   "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}},
                  f32(1, 2, 3)), "overlap or gap"),
    "reversed_offsets": (image({"a": {"dtype": "F32", "shape": [0], "data_offsets": [8, 0]}},
                               f32(1, 2)), "reversed"),
    "offset_out_of_range": (image({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 800]}},
                                  f32(1, 2)), "run past the data"),
    "unknown_dtype": (image({"a": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}},
                            b"\0" * 16), "unknown dtype 'F128'"),
    "shape_size_mismatch": (image({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}},
                                  f32(1, 2)), "elements but 8 bytes"),
    "negative_dim": (image({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}},
                           f32(1)), "not a non-negative integer"),
    "no_offsets": (image({"a": {"dtype": "F32", "shape": [1]}}, f32(1)), "no data_offsets"),
    "no_dtype": (image({"a": {"shape": [1], "data_offsets": [0, 4]}}, f32(1)), "no dtype"),
    "metadata_not_strings": (image({"__metadata__": {"k": 1}}), "is not a string"),
    "entry_not_object": (image({"a": 5}), "is not an object"),
    "shape_overflow": (image({"a": {"dtype": "F32", "shape": [1 << 40, 1 << 40],
                                    "data_offsets": [0, 4]}}, f32(1)), "size overflow"),
}


def main():
    os.makedirs(OUT, exist_ok=True)
    manifest = []
    for name, (blob, fragment) in sorted(CASES.items()):
        with open(os.path.join(OUT, name + ".safetensors"), "wb") as f:
            f.write(blob)
        manifest.append(f"{name}.safetensors\t{fragment}")
    with open(os.path.join(OUT, "MANIFEST.tsv"), "w") as f:
        f.write("\n".join(manifest) + "\n")
    with open(os.path.join(OUT, "good.safetensors"), "wb") as f:
        f.write(image(GOOD, GOOD_DATA))


if __name__ == "__main__":
    main()
