"""Two JAX processes on this machine (jax.distributed over 127.0.0.1, 4 CPU devices each)
load a policy into its shardings, run a sharded forward + next-token loss + adamw step,
save and restore with orbax onto another mesh; the numbers equal a one-process run on 8
devices, and the checkpoint they wrote restores here onto yet another mesh."""

import os
import pathlib
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from jaxspec import parallel
from jaxspec.checkpoint import CheckpointManager
from jaxspec.models import save_hf
from jaxspec.testing import ROOT
from jaxspec.testing import multiprocess_sharding as worker
from jaxspec.testing.compile import subprocess_env

TIMEOUT_S = 240  # for the whole two-process run


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "PMI_", "JAX_COORDINATOR", "JAXSPEC_"))}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    return subprocess_env(env)  # compiling as this process does, with the suite's cache


def launch(workdir: pathlib.Path, num_processes: int = 2) -> list[subprocess.Popen]:
    port = free_port()
    return [
        subprocess.Popen(
            [sys.executable, "-m", worker.__name__, str(i), str(num_processes),
             str(port), str(workdir)],
            env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(num_processes)
    ]


def wait(procs: list[subprocess.Popen]) -> None:
    """Wait for every process (bounded); on a time-out or a failure, fail with their logs."""
    outputs = []
    deadline = time.monotonic() + TIMEOUT_S
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        logs = [proc.communicate()[0][-3000:] for proc in procs]
        pytest.fail(f"two-process run timed out after {TIMEOUT_S}s:\n" + "\n---\n".join(logs))
    failed = [(i, p.returncode, out[-3000:]) for i, (p, out) in enumerate(zip(procs, outputs)) if p.returncode]
    assert not failed, "\n---\n".join(f"process {i} exited {rc}:\n{log}" for i, rc, log in failed)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, policy):
    """(workdir, what the two processes saw, the one-process results); both runs overlap."""
    workdir = tmp_path_factory.mktemp("multiprocess")
    save_hf(policy, workdir / "hf")
    procs = launch(workdir)
    try:
        mesh = parallel.make_mesh(*worker.MESH)
        one = jax.device_get(worker.sharded_train_step(policy, mesh, worker.make_tokens()))
    finally:
        wait(procs)
    with np.load(workdir / "multiprocess.npz") as f:
        return workdir, dict(f), one


def test_two_processes_match_one_process(runs, policy):
    _, got, (params, opt_state, loss, logits) = runs
    np.testing.assert_array_equal(got["rows"], [0, 1, 2, 3])  # process 0 fed the first half
    assert got["same_shards"].shape == (2 * (1 + 13),) and got["same_shards"].all()
    np.testing.assert_allclose(got["loss"], loss, rtol=1e-6)
    np.testing.assert_allclose(got["logits"], logits, rtol=1e-5, atol=1e-5)
    for name, tree in (("params", params), ("opt", opt_state)):
        leaves = jax.tree.leaves(tree)
        assert sum(k.startswith(f"{name}_") for k in got) == len(leaves)
        for i, ref in enumerate(leaves):
            np.testing.assert_allclose(got[f"{name}_{i}"], ref, rtol=1e-5, atol=1e-6, err_msg=f"{name} {i}")
    # the step moved every param (so the comparison above compares an update)
    for i, before in enumerate(jax.tree.leaves(policy.params)):
        assert np.abs(got[f"params_{i}"] - np.asarray(before)).max() > 1e-3, i


def test_two_process_checkpoint_restores_on_other_meshes(runs):
    workdir, got, (params, opt_state, _, _) = runs
    # restored by the two processes onto fsdp=4, tensor=2: bit-identical to what they saved
    assert str(got["restored_spec"]) == "P('tensor', 'fsdp')"
    assert int(got["restored_step"]) == 1
    for key in [k for k in got if k.startswith(("params_", "opt_"))]:
        np.testing.assert_array_equal(got[f"restored_{key}"], got[key], err_msg=key)
    # restored here, by one process, onto data=8 (replicated params)
    mesh = parallel.make_mesh(8, 1, 1)
    abstract = jax.eval_shape(lambda: (params, opt_state))
    target = {"params": parallel.restore_target(abstract[0], parallel.param_shardings(abstract[0], mesh)),
              "opt": parallel.restore_target(abstract[1], parallel.param_shardings(abstract[1], mesh)),
              "step": 0}
    with CheckpointManager(workdir / "ckpt", create=False) as manager:
        restored, meta = manager.restore(1, target)
    assert meta == {"processes": 2} and restored["step"] == 1
    for i, x in enumerate(jax.tree.leaves(restored["params"])):
        assert x.sharding.mesh.shape == mesh.shape
        np.testing.assert_array_equal(np.asarray(x), got[f"params_{i}"])
