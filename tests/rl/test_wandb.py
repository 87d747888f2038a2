"""run.wandb: the W&B sink, read back from the offline run it writes.

The offline run's transaction log (<run.dir>/wandb/offline-run-*/run-<id>.wandb) is read
with wandb's own protobuf `Record` and the log's framing (LevelDB's log format: 32 KiB
blocks of chunks, each with a CRC-32 of its type and data, a length and a type; after
wandb's 7-byte header), checked here chunk by chunk: what W&B would upload on `wandb sync`.
"""

import glob
import json
import os
import pathlib
import struct
import sys
import zlib

import pytest

from jaxspec.config import ConfigError, load_config, to_dict
from jaxspec.metrics import MetricsWriter, WandbSink, read_metrics

wandb = pytest.importorskip("wandb", reason="W&B is an optional extra: pip install "
                                            "'jaxspec[wandb]' (the test extra has it)")
from wandb.proto import wandb_internal_pb2  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")

_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4
_BLOCK = 32 * 1024


def _records(path):
    """The `Record`s of a .wandb transaction log, in order."""
    data = pathlib.Path(path).read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<HB", data[4:7]) == (0xBEE1, 0), data[:7]
    pos, pending = 7, None
    while pos + 7 <= len(data):
        room = _BLOCK - pos % _BLOCK
        if room < 7:  # a block's tail too short for a chunk header is padding
            pos += room
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if (crc, length, kind) == (0, 0, 0):  # zero padding to the block's end
            pos += room
            continue
        chunk = data[pos + 7:pos + 7 + length]
        assert zlib.crc32(bytes([kind]) + chunk) == crc, f"bad chunk CRC at byte {pos}"
        pos += 7 + length
        if kind == _FULL:
            yield _parse(chunk)
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            yield _parse(pending + chunk)
            pending = None
        else:
            raise AssertionError(f"unknown chunk type {kind}")


def _parse(raw):
    record = wandb_internal_pb2.Record()
    record.ParseFromString(raw)
    return record


def _key(item):
    return item.key or "/".join(item.nested_key)


def read_offline_run(run_dir):
    """(run record, config {key: value}, history [{key: value, '_step': s}]) of the one
    offline W&B run under run_dir."""
    logs = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))
    assert len(logs) == 1, logs
    run, config, history = None, {}, []
    for record in _records(logs[0]):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
            config.update({_key(i): json.loads(i.value_json) for i in run.config.update})
        elif kind == "config":
            config.update({_key(i): json.loads(i.value_json) for i in record.config.update})
        elif kind == "history":
            history.append({_key(i): json.loads(i.value_json) for i in record.history.item})
    config.pop("_wandb", None)
    return run, config, history


@pytest.fixture(autouse=True)
def _offline(tmp_path, monkeypatch):
    """W&B offline, silent, and its per-user files under tmp_path."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var))


def test_the_sink_logs_each_rows_numbers_at_its_step(tmp_path):
    run_dir = tmp_path / "run"
    sink = WandbSink(run_dir, project="jaxspec-test", mode="offline",
                     config={"run": {"steps": 2}, "draft": {"kind": "none"}})
    with MetricsWriter(run_dir, tensorboard=False, wandb=sink) as writer:
        writer.write(1, {"reward": 0.25, "time/step": 1.5, "grpo/kl": 1e-3,
                         "acceptance_length": float("nan"), "per_position": [0.5, 0.25],
                         "note": "text", "nonfinite": True})
        writer.write(2, {"reward": 0.75, "time/step": 1.25, "grpo/kl": 2e-3})
    run, config, history = read_offline_run(run_dir)
    assert run.project == "jaxspec-test" and run.display_name == "run"
    assert run.run_id == (run_dir / "wandb_run_id").read_text().strip()
    assert config == {"run": {"steps": 2}, "draft": {"kind": "none"}}
    logged = [{k: v for k, v in h.items() if not k.startswith("_") or k == "_step"}
              for h in history]
    # the numbers only (NaN, lists, text and flags are in metrics.jsonl alone)
    assert logged == [{"_step": 1, "reward": 0.25, "time/step": 1.5, "grpo/kl": 1e-3},
                      {"_step": 2, "reward": 0.75, "time/step": 1.25, "grpo/kl": 2e-3}]


def test_a_resumed_run_continues_the_same_wandb_run(tmp_path):
    run_dir = tmp_path / "run"
    first = WandbSink(run_dir, project="p", mode="offline")
    first_id = first.run.id
    first.close()
    assert (run_dir / "wandb_run_id").read_text().strip() == first_id
    again = WandbSink(run_dir, project="p", mode="offline", resume=True)
    assert again.run.id == first_id
    again.close()
    fresh = WandbSink(run_dir, project="p", mode="offline")  # not a resume: a new W&B run
    assert fresh.run.id != first_id
    fresh.close()


def test_run_wandb_without_the_package_is_one_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # find_spec: not installed
    with pytest.raises(ConfigError) as err:
        load_config(TINY, ["run.wandb.mode=offline"])
    assert err.value.key == "run.wandb"
    assert "the wandb package is not installed" in str(err.value)
    assert "pip install 'jaxspec[wandb]'" in str(err.value)
    assert load_config(TINY).run.wandb is None  # off by default, wandb or not


def test_a_failing_wandb_login_is_one_config_error(tmp_path, monkeypatch):
    def no_key(**kwargs):
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.")

    monkeypatch.setattr(wandb, "init", no_key)
    with pytest.raises(ConfigError, match=r"'run.wandb.mode' = 'online': W&B could not start "
                                          r"a run \(No API key configured"):
        WandbSink(tmp_path, project="p", mode="online")


def test_grpo_run_logs_its_metrics_and_config_to_wandb(tmp_path, monkeypatch):
    """A two-step run with run.wandb (mode offline): the W&B history holds every number of
    every metrics.jsonl row at its step, the config is the resolved config; a process
    other than 0 opens no W&B run."""
    from jaxspec.rl import trainer as trainer_lib

    run_dir = tmp_path / "run"
    cfg = load_config(TINY, [f"run.dir={run_dir}", "run.steps=2", "warmup.steps=0",
                             "draft.kind=none", "rollout.prompts_per_step=4",
                             "rollout.group_size=2", "rollout.max_new_tokens=8",
                             "run.compare_plain=0", "run.wandb.mode=offline",
                             "run.wandb.project=jaxspec-test", "run.wandb.name=two-steps"])
    with monkeypatch.context() as patch:
        patch.setattr(trainer_lib, "is_primary", lambda: False)
        assert trainer_lib.GRPOTrainer(cfg)._wandb is None
    assert not (run_dir / "wandb").exists()

    trainer_lib.GRPOTrainer(cfg).run()
    rows = read_metrics(str(run_dir))
    run, config, history = read_offline_run(run_dir)
    assert run.display_name == "two-steps" and run.project == "jaxspec-test"
    assert config == json.loads(json.dumps(to_dict(cfg)))
    assert [h["_step"] for h in history] == [r["step"] for r in rows] == [1, 2]
    for row, logged in zip(rows, history, strict=True):
        numbers = {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))
                   and not isinstance(v, bool)}
        assert {"reward", "time/step", "time/generation", "grpo/kl"} <= numbers.keys()
        assert {k: logged[k] for k in numbers} == numbers
        assert not {k for k in logged if not k.startswith("_")} - numbers.keys()
