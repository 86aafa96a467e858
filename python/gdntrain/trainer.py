"""gdntrain's trainer from Python: the same trainer as `gdntrain train` (src/train/trainer.h), with
a per-step callback receiving each step's logged metrics (the metrics.jsonl record)."""
import json
import os
from typing import Callable, Iterable, Optional, Union

from . import _C


def default_config() -> dict:
    """The built-in defaults (`gdntrain train` with no arguments: a tiny Qwen3.5 on MQAR)."""
    return json.loads(_C.default_train_config())


class Trainer:
    """Trainer(config).run(callback): `config` is a dict (merged over the defaults, as a --config
    JSON file would be), a path to a .json or TOML-style file, or None; `overrides` are
    "key=value" strings as `--set` takes; run_dir, device and steps are --run-dir, --device and
    --steps. run() trains to the end (or stop_after steps, then checkpoints) and returns the
    result: steps_done, final_loss, eval_loss, eval_accuracy, skipped_steps, losses."""

    def __init__(self, config: Union[dict, str, os.PathLike, None] = None,
                 overrides: Iterable[str] = (), run_dir: Optional[str] = None,
                 device: Optional[str] = None, steps: Optional[int] = None, resume: bool = False,
                 quiet: bool = False, stop_after: int = 0):
        if config is not None and not isinstance(config, (dict, str, os.PathLike)):
            raise TypeError(f"gdntrain.Trainer: config must be a dict, a path or None, got "
                            f"{type(config).__name__}")
        self._json = json.dumps(config) if isinstance(config, dict) else ""
        self._path = os.fspath(config) if isinstance(config, (str, os.PathLike)) else ""
        sets = list(overrides)
        if run_dir is not None:
            sets.append(f"run.dir={json.dumps(str(run_dir))}")
        if device is not None:
            sets.append(f"train.device={json.dumps(device)}")
        if steps is not None:
            sets.append(f"train.steps={int(steps)}")
        self._sets, self._resume, self._quiet = sets, resume, quiet
        self._stop_after = int(stop_after)

    def run(self, callback: Optional[Callable[[dict], None]] = None) -> dict:
        on_step = None if callback is None else (lambda text: callback(json.loads(text)))
        out = _C.train(self._json, self._path, self._sets, on_step, self._resume, self._quiet,
                       self._stop_after)
        return json.loads(out)
