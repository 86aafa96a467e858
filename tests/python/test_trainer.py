"""gdntrain.Trainer (python/gdntrain/trainer.py) against `gdntrain train` with the same
configuration: the same loss at every step (cpu backend, deterministic for a fixed thread count),
the per-step callback gets every step's metrics record, and bad configurations raise."""
import json
import os
import subprocess

import pytest

import gdntrain

STEPS = 6
# A short run of the built-in tiny model on MQAR; a dict and --set overrides, as a user would.
CONFIG = {"train": {"micro_batch_tokens": 512, "device": "cpu"}, "eval": {"every": 3},
          "checkpoint": {"every": 0, "at_end": False}, "log": {"every": 1}}
SETS = ["optim.lr=0.01", "optim.warmup_steps=2"]


def gdntrain_bin():
    path = os.environ.get("GDN_GDNTRAIN_BIN")
    assert path and os.path.exists(path), "GDN_GDNTRAIN_BIN must name the built gdntrain binary"
    return path


def cli_losses(tmp_path):
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(CONFIG))
    run = tmp_path / "cli"
    cmd = [gdntrain_bin(), "train", "--config", str(cfg), "--run-dir", str(run), "--steps",
           str(STEPS)] + [a for s in SETS for a in ("--set", s)]
    subprocess.run(cmd, check=True, capture_output=True)
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in recs], recs


def test_python_trainer_matches_cli(tmp_path):
    want, cli_recs = cli_losses(tmp_path)
    assert len(want) == STEPS
    seen = []
    res = gdntrain.Trainer(CONFIG, overrides=SETS, run_dir=str(tmp_path / "py"), steps=STEPS,
                           quiet=True).run(seen.append)
    assert [r["step"] for r in seen] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in seen] == want  # bitwise: same config, same kernels, same threads
    assert res["losses"] == want and res["steps_done"] == STEPS
    assert res["final_loss"] == want[-1]
    assert "eval_loss" in seen[2] and seen[2]["eval_loss"] == cli_recs[2]["eval_loss"]
    # the callback saw exactly what metrics.jsonl holds
    lines = (tmp_path / "py" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["loss"] for x in lines] == want


def test_config_file_and_defaults(tmp_path):
    d = gdntrain.default_config()
    assert d["model"]["config"] == "tiny" and d["train"]["steps"] > 0
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps(CONFIG))
    res = gdntrain.Trainer(str(cfg), overrides=SETS, run_dir=str(tmp_path / "f"), steps=2,
                           quiet=True).run()
    assert res["steps_done"] == 2 and len(res["losses"]) == 2


def test_bad_config_raises(tmp_path):
    with pytest.raises(RuntimeError, match="optim.lr"):
        gdntrain.Trainer(CONFIG, overrides=["optim.lr=\"fast\""], run_dir=str(tmp_path / "b"),
                         steps=1, quiet=True).run()
    with pytest.raises(TypeError, match="config must be a dict"):
        gdntrain.Trainer(42)


def test_callback_exception_stops_the_run(tmp_path):
    def boom(rec):
        raise ValueError(f"stop at {rec['step']}")
    with pytest.raises(ValueError, match="stop at 1"):
        gdntrain.Trainer(CONFIG, overrides=SETS, run_dir=str(tmp_path / "e"), steps=3,
                         quiet=True).run(boom)
