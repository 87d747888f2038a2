"""One process of the multi-process GRPO test (tests/rl/test_multiprocess_grpo.py).

    python -m jaxspec.testing.multiprocess_grpo PROCESS_ID NUM_PROCESSES PORT WORKDIR MODE [KEY=VALUE ...]

with DEVICES CPU devices in every process (the launcher sets XLA_FLAGS), of which the run
uses the first DEVICES / NUM_PROCESSES: XLA on CPU rounds a one-device program (the
warm-up) differently in a process with 1-2 devices than in one with 4, so both runs give
each process 4. NUM_PROCESSES > 1 joins a `jax.distributed` run over 127.0.0.1:PORT through
the JAXSPEC_* variables, as `scripts/train_grpo.py` does on a cluster. Then the real trainer
runs from the short tiny
config (its own warm-up and in-domain EAGLE-3 initialisation, speculative generation,
logprob stage, policy and online draft updates, a checkpoint after every step):

- MODE straight: STEPS steps in one go; then, in the same process, a trainer resumes the
  two-process run's checkpoint of step STEPS - 1 and runs the last step (`resume_here`);
- MODE resume: the last process gets a SIGTERM after step STEPS - 1; all processes stop
  there together (faults.StopSignals agrees on it), then a new trainer resumes from the
  checkpoint they wrote and runs the last step;
- MODE moe: MOE_STEPS steps in one go of a mixture-of-experts policy (MOE: 4 experts, top-2)
  on the expert-parallel mesh MOE_MESH (data across the processes, the experts split in
  two inside each).

KEY=VALUE are config overrides on top of the test's (e.g. draft.kind=history,
tests/rl/test_multiprocess_grpo.py, which runs draft.kind=hybrid). After every step each process gathers the state
(policy, optimizer, and the head, draft optimizer and history store where the run has
them) to the host; process 0 writes them, the generated batches and the metrics rows of
metrics.jsonl to WORKDIR/MODE.npz.

The launching side (`launch`, `wait`) and the comparison of the two runs
(`assert_two_equal_one`) are here too, for the tests that run this worker.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np

from jaxspec.testing import ROOT

TINY = ROOT / "configs" / "tiny.yaml"
DEVICES = 4  # the mesh's devices in every run, whatever its process count
STEPS = 3
MESH = ["mesh.data=2", "mesh.fsdp=1", "mesh.tensor=2"]  # data across processes, tensor inside
# the tiny config shortened; the comparison's settings are tests/parallel/test_train_step.py's (vocabulary
# rows replicated: 25 tokens do not split over tensor=2; AdamW eps 1e-5 so fp32 rounding
# of near-zero gradients is not amplified)
MOE_STEPS = 2
MOE_MESH = ["mesh.data=2", "mesh.fsdp=1", "mesh.tensor=1", "mesh.expert=2"]
MOE = ["model.family=qwen3_moe", "model.num_experts=4", "model.num_experts_per_tok=2",
       "model.moe_intermediate_size=64", "model.norm_topk_prob=true", "model.tie_embeddings=false",
       "grpo.router_aux_coef=0.01", "warmup.steps=30"]
OVERRIDES = [
    "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=8",
    "warmup.steps=60", "warmup.batch_size=32", "warmup.draft_rollouts=8",
    "warmup.draft_steps=4", "run.save_every=1", "run.compare_plain=2",
    "mesh.rules.vocab=null", "optim.eps=1.0e-5", "draft_optim.eps=1.0e-5", *MESH,
]
TIMEOUT_S = 300  # for the runs of one comparison together
TIMING = ("time/", "share/", "generation_time_s", "generation_plain_time_s", "generation_speedup")


def state_arrays(trainer) -> dict:
    """The trainer's state gathered to this host: {name: [B...] numpy}, the same on every
    process."""
    import jax

    from jaxspec.rl.cluster import host_arrays

    s = trainer.state
    out = {}
    for name, tree in (("policy", s.policy.params), ("opt", s.opt_state),
                       ("head", s.head and s.head.params), ("draft_opt", s.draft_opt_state),
                       ("history", s.history)):
        for i, x in enumerate(jax.tree.leaves(host_arrays(tree))):
            out[f"{name}_{i}"] = np.asarray(x)
    return out


def resume_here(workdir: str, config, devices, out: dict) -> None:
    """One process resumes the checkpoint of step STEPS - 1 that the two-process run writes
    (a topology it was not saved on), once it is there, and runs the last step: its state
    and tokens go to `out` as r{STEPS}_*."""
    from jaxspec.rl.trainer import GRPOTrainer

    source = os.path.join(workdir, "resume")
    saved = os.path.join(source, "checkpoints", str(STEPS - 1))  # orbax renames it when final
    deadline = time.monotonic() + 240
    while not os.path.isdir(saved):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the two-process run wrote no {saved}")
        time.sleep(0.2)
    run_dir = os.path.join(workdir, "resumed_here")
    shutil.copytree(saved, os.path.join(run_dir, "checkpoints", str(STEPS - 1)))
    shutil.copy(os.path.join(source, "config.yaml"), run_dir)
    cfg = config(STEPS, "run.resume=true", f"run.dir={run_dir}")
    trainer = GRPOTrainer(cfg, devices=devices, log=lambda line: None)
    assert trainer.completed == STEPS - 1, trainer.completed
    trainer.step()
    for k, v in state_arrays(trainer).items():
        out[f"r{STEPS}_{k}"] = v
    out[f"r{STEPS}_tokens"] = trainer.last_batch.tokens


def main(process_id: int, num_processes: int, port: int, workdir: str, mode: str,
         *overrides: str) -> None:
    if num_processes > 1:  # as a SLURM / ssh launch would set them (docs/scaling.md)
        os.environ.update(JAXSPEC_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                          JAXSPEC_NUM_PROCESSES=str(num_processes),
                          JAXSPEC_PROCESS_ID=str(process_id))
    import jax

    from jaxspec import parallel

    joined = parallel.initialize_distributed(timeout_s=60)
    assert joined == (num_processes > 1)
    assert jax.process_count() == num_processes and jax.local_device_count() == DEVICES
    # the first DEVICES / num_processes devices of each process (process-major)
    devices = [d for d in jax.devices()
               if jax.local_devices(d.process_index).index(d) < DEVICES // num_processes]
    jax.config.update("jax_disable_most_optimizations", True)  # compile time (both runs)

    from jaxspec.config import load_config
    from jaxspec.host import collect_garbage_rarely
    from jaxspec.rl.faults import Preempted
    from jaxspec.rl.trainer import GRPOTrainer

    collect_garbage_rarely()  # as scripts/train_grpo.py
    run_dir = os.path.join(workdir, mode)
    out: dict = {}
    batches = []
    start = time.perf_counter()

    def on_step(trainer):
        def record(step, row):
            for k, v in state_arrays(trainer).items():
                out[f"s{step}_{k}"] = v
            b = trainer.last_batch
            batches.append({"prompts": b.prompts, "prompt_lengths": b.prompt_lengths,
                            "tokens": b.tokens, "lengths": b.lengths,
                            "gen_logprobs": b.gen_logprobs, "accepted_at": b.stats.accepted_at})
        return record

    def config(steps, *extra):
        return load_config(TINY, [*OVERRIDES, *overrides, f"run.dir={run_dir}",
                                  f"run.steps={steps}", *extra])

    lines = []
    log = lines.append
    if mode == "moe":
        trainer = GRPOTrainer(config(MOE_STEPS, *MOE, *MOE_MESH), log=log, devices=devices)
        trainer.run(on_step=on_step(trainer))
    elif mode == "straight":
        trainer = GRPOTrainer(config(STEPS), log=log, devices=devices)
        trainer.run(on_step=on_step(trainer))
        resume_here(workdir, config, devices, out)
    else:
        first = GRPOTrainer(config(STEPS), log=log, devices=devices)
        record = on_step(first)

        def preempt_the_last_process(step, row):
            record(step, row)
            if step == STEPS - 1 and process_id == num_processes - 1:
                os.kill(os.getpid(), signal.SIGTERM)  # a preemption notice to one node only

        try:
            first.run(on_step=preempt_the_last_process)
        except Preempted as e:  # every process: they agree on the signal of one
            out["preempted"] = np.asarray(f"{e.step} {e.signame}")
        resumed = GRPOTrainer(config(STEPS, "run.resume=true"), log=log, devices=devices)
        assert resumed.completed == STEPS - 1, resumed.completed
        resumed.run(on_step=on_step(resumed))
        trainer = resumed
    mesh = trainer.train_mesh
    out["mesh_shape"] = np.asarray([mesh.shape[a] for a in ("data", "fsdp", "expert", "tensor")])
    out["mesh_processes"] = np.vectorize(lambda d: d.process_index)(mesh.devices)
    out["seconds"] = np.float64(time.perf_counter() - start)
    for i, b in enumerate(batches):
        for k, v in b.items():
            out[f"b{i + 1}_{k}"] = np.asarray(v)
    if jax.process_index() == 0:
        with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
            out["metrics"] = np.asarray(json.dumps([json.loads(line) for line in fh]))
        out["log"] = np.asarray("\n".join(lines))
        np.savez(os.path.join(workdir, f"{mode}.npz"), **out)
    print(f"process {process_id}/{num_processes} {mode}: done in {out['seconds']:.1f}s", flush=True)
    if num_processes > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("results written")
        jax.distributed.shutdown()


# --------------------------------------------------------------------------- the launching side


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(devices: int) -> dict:
    """This process's environment for a worker with `devices` CPU devices, without any
    launcher's variables (SLURM's, MPI's, JAXSPEC_*)."""
    from jaxspec.testing.compile import subprocess_env

    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "PMI_", "JAX_COORDINATOR", "JAXSPEC_"))}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    return subprocess_env(env)  # compiling as this process does, with the suite's cache


def launch(workdir, num_processes: int, mode: str, *overrides: str) -> list[subprocess.Popen]:
    """The processes of one run of this worker (their output piped, for `wait`)."""
    port = free_port()
    return [
        subprocess.Popen(
            [sys.executable, "-m", "jaxspec.testing.multiprocess_grpo", str(i),
             str(num_processes), str(port), str(workdir), mode, *overrides],
            env=child_env(DEVICES), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(num_processes)
    ]


def wait(procs: list[tuple[str, subprocess.Popen]], returncode: int = 0) -> dict[str, str]:
    """Wait for every process (bounded by TIMEOUT_S): {name: its output}. On a time-out or
    another exit code than `returncode`, fail the test with their logs."""
    import pytest

    deadline = time.monotonic() + TIMEOUT_S
    outputs = {}
    try:
        for name, proc in procs:
            outputs[name] = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
    except subprocess.TimeoutExpired:
        for _, proc in procs:
            proc.kill()
        logs = [f"{name}:\n{proc.communicate()[0][-3000:]}" for name, proc in procs]
        pytest.fail(f"the runs timed out after {TIMEOUT_S}s:\n" + "\n---\n".join(logs))
    failed = [f"{name} exited {proc.returncode}:\n{outputs[name][-4000:]}"
              for name, proc in procs if proc.returncode != returncode]
    assert not failed, "\n---\n".join(failed)
    return outputs


def run_both(workdir, *overrides: str) -> tuple[dict, dict]:
    """The two-process run (MODE resume) and the one-process run (MODE straight) at once:
    (the two-process results, the one-process results), as saved."""
    procs = [(f"two processes, process {i}", p)
             for i, p in enumerate(launch(workdir, 2, "resume", *overrides))]
    procs.append(("one process", launch(workdir, 1, "straight", *overrides)[0]))
    wait(procs)
    with np.load(os.path.join(workdir, "resume.npz")) as two, \
            np.load(os.path.join(workdir, "straight.npz")) as one:
        return dict(two), dict(one)


def metric_rows(results) -> list[dict]:
    """A run's metrics.jsonl rows without the timings."""
    return [{k: v for k, v in row.items() if not k.startswith(TIMING)}
            for row in json.loads(str(results["metrics"]))]


def assert_two_equal_one(two: dict, one: dict) -> None:
    """The two-process run equals the one-process run on the same mesh (data across the
    processes, tensor inside each): `assert_same_runs` over STEPS steps."""
    np.testing.assert_array_equal(two["mesh_shape"], [2, 1, 1, 2])  # data, fsdp, expert, tensor
    np.testing.assert_array_equal(one["mesh_shape"], [2, 1, 1, 2])
    np.testing.assert_array_equal(two["mesh_processes"], [[[[0, 0]]], [[[1, 1]]]])  # data across
    np.testing.assert_array_equal(one["mesh_processes"], np.zeros((2, 1, 1, 2)))
    assert_same_runs(two, one, STEPS)


def assert_same_runs(two: dict, one: dict, steps: int) -> None:
    """Every step's tokens, lengths and accepted drafts identical, generation log-probs,
    state arrays and non-timing metrics within 1e-5 (relative above 1: the tolerances of
    tests/parallel/test_train_step.py)."""
    for step in range(1, steps + 1):
        for k in ("tokens", "lengths", "accepted_at"):
            np.testing.assert_array_equal(two[f"b{step}_{k}"], one[f"b{step}_{k}"], err_msg=(step, k))
        np.testing.assert_allclose(two[f"b{step}_gen_logprobs"], one[f"b{step}_gen_logprobs"],
                                   rtol=0, atol=1e-5)
        keys = [k for k in one if k.startswith(f"s{step}_")]
        assert keys and sorted(keys) == sorted(k for k in two if k.startswith(f"s{step}_"))
        for k in keys:
            np.testing.assert_allclose(two[k], one[k], rtol=0, atol=1e-5, err_msg=k)
    rows_two, rows_one = metric_rows(two), metric_rows(one)
    assert [r["step"] for r in rows_two] == [r["step"] for r in rows_one] == list(range(1, steps + 1))
    for got, want in zip(rows_two, rows_one, strict=True):
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert abs(got[key] - value) <= 1e-5 * max(1.0, abs(value)), (got["step"], key, got[key], value)


def assert_resumed_here(one: dict) -> None:
    """The one-process run's resume of the two-process checkpoint of step STEPS - 1
    (`resume_here`) made the same last step as its own straight run."""
    np.testing.assert_array_equal(one[f"r{STEPS}_tokens"], one[f"b{STEPS}_tokens"])
    keys = [k for k in one if k.startswith(f"s{STEPS}_")]
    assert len(keys) == sum(k.startswith(f"r{STEPS}_") for k in one) - 1
    for k in keys:
        np.testing.assert_allclose(one["r" + k[1:]], one[k], rtol=0, atol=1e-5, err_msg=k)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:])
