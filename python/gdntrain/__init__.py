"""gdntrain from Python (docs/PYTHON.md).

gdntrain.torch: gdntrain's kernels as PyTorch custom ops. gdntrain.Trainer: the trainer of
`gdntrain train` with a per-step callback. gdntrain.Tokenizer and gdntrain.probe: the tokenizer
and the kernel probe of `gdntrain tokenize` and `gdntrain probe --model`. The extension module gdntrain._C holds
libgdn (no libtorch); it is found next to this file (an installed wheel) or in another `gdntrain`
folder on sys.path (the CMake build's build/<preset>/python/gdntrain, for the tests).
"""
import pkgutil

__path__ = pkgutil.extend_path(__path__, __name__)

from . import _C  # noqa: E402
from .tools import Tokenizer, dump, probe  # noqa: E402
from .trainer import Trainer, default_config  # noqa: E402

__all__ = ["_C", "Trainer", "default_config", "Tokenizer", "probe", "dump"]
