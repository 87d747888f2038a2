"""jaxspec.testing.compile: the XLA flag of a cheap compile goes only to an XLA that knows it
(jaxlib 0.11's XLA aborts the process on `--xla_cpu_use_fusion_emitters`, an unknown flag
there: seen on the 2026-11-27 H200 run)."""

import importlib.metadata

import pytest

from jaxspec.testing import compile as testing_compile


@pytest.mark.parametrize("version, known", [("0.10.2", True), ("0.10.0", True), ("0.9.1", True),
                                            ("0.10rc1", True), ("0.11.2", False), ("0.11.0.dev20260901", False),
                                            ("1.0.0", False)])
def test_the_emitter_flag_only_for_jaxlib_up_to_0_10(monkeypatch, version, known):
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: version if name == "jaxlib" else real(name))
    flags = testing_compile.cheap_xla_flags()
    assert flags == (["--xla_cpu_use_fusion_emitters=false"] if known else [])


def test_a_subprocess_gets_only_flags_its_xla_knows(monkeypatch):
    monkeypatch.setattr(testing_compile, "_cheap", [True])  # this process compiles cheaply
    monkeypatch.setattr(testing_compile, "cheap_xla_flags", lambda: [])
    env = testing_compile.subprocess_env({"XLA_FLAGS": "--xla_force_host_platform_device_count=2 "
                                                       "--xla_cpu_use_fusion_emitters=false"})
    assert "xla_cpu_use_fusion_emitters" not in env["XLA_FLAGS"]
    assert "--xla_force_host_platform_device_count=2" in env["XLA_FLAGS"]
