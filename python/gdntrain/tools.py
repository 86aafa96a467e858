"""gdntrain's tokenizer, kernel probe and dump from Python: the same code as `gdntrain tokenize` /
`gdntrain prepare` (src/text/tokenizer.h), `gdntrain probe --model` (src/model/probe_model.h) and
`gdntrain dump` (src/model/dump.h)."""
import json
import os
from typing import List, Optional, Union

from . import _C


class Tokenizer:
    """An HF tokenizer.json (byte-level BPE, as Qwen3.5's), encoded exactly as HF `tokenizers`
    does (tests/text checks it). Tokenizer(path).encode(text) -> ids; decode(ids) -> text."""

    def __init__(self, path: Union[str, os.PathLike]):
        self._t = _C.Tokenizer.from_file(os.fspath(path))

    def encode(self, text: str) -> List[int]:
        return self._t.encode(text)

    def decode(self, ids) -> str:
        return self._t.decode([int(i) for i in ids])

    @property
    def vocab_size(self) -> int:
        return self._t.vocab_size()

    def token_to_id(self, token: str) -> Optional[int]:
        return self._t.token_to_id(token)

    def __repr__(self) -> str:
        return f"gdntrain.Tokenizer({self._t.describe()})"


def probe(model: Union[str, os.PathLike] = "tiny", backend: str = "cpu",
          recompute: str = "none") -> List[dict]:
    """Every (op, shape class) one training step of `model` resolves on `backend` ("ref", "cpu" or
    "cuda"), each implementation probed against the fp64 reference as at start-up: a list of
    {op, backend, shape_class, impl, fwd_err, bwd_err, probe_ms, rejected}. `model` is "tiny" or a
    config.json / checkpoint directory."""
    return json.loads(_C.probe_model(os.fspath(model), backend, recompute))


def dump(model: Union[str, os.PathLike], docs: Union[str, os.PathLike],
         backend: str = "cpu") -> dict:
    """`gdntrain dump` without the file: an HF checkpoint directory `model` run forward and
    backward on the documents of the safetensors file `docs` (doc{i}.input_ids) packed into one
    micro-batch. Returns {"tensors": {name: array}, "mean_loss", "tokens", "docs"}, the arrays
    named as in the dump file (doc{i}.logits, doc{i}.loss_sum, grad.<HF name>; src/model/dump.h):
    float32 NumPy arrays over gdntrain's own memory, no copy (torch.from_numpy or
    torch.from_dlpack shares it too)."""
    arrays, mean_loss, tokens, ndocs = _C.dump(os.fspath(model), os.fspath(docs), backend)
    return {"tensors": dict(arrays), "mean_loss": mean_loss, "tokens": tokens, "docs": ndocs}
