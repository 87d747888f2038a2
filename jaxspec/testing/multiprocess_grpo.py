"""One process of the multi-process GRPO test (tests/rl/test_multiprocess_grpo.py).

    python -m jaxspec.testing.multiprocess_grpo PROCESS_ID NUM_PROCESSES PORT WORKDIR MODE

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

After every step each process gathers the state (policy, optimizer, head, draft optimizer)
to the host; process 0 writes them, the generated batches and the metrics rows of
metrics.jsonl to WORKDIR/MODE.npz.
"""

import json
import os
import shutil
import signal
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


def state_arrays(trainer) -> dict:
    """The trainer's state gathered to this host: {name: [B...] numpy}, the same on every
    process."""
    import jax

    from jaxspec.rl.cluster import host_arrays

    s = trainer.state
    out = {}
    for name, tree in (("policy", s.policy.params), ("opt", s.opt_state),
                       ("head", s.head.params), ("draft_opt", s.draft_opt_state)):
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


def main(process_id: int, num_processes: int, port: int, workdir: str, mode: str) -> None:
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
    from jaxspec.rl.faults import Preempted
    from jaxspec.rl.trainer import GRPOTrainer

    run_dir = os.path.join(workdir, mode)
    out: dict = {}
    batches = []
    start = time.perf_counter()

    def on_step(trainer):
        def record(step, row):
            for k, v in state_arrays(trainer).items():
                out[f"s{step}_{k}"] = v
            b = trainer.last_batch
            batches.append({"tokens": b.tokens, "lengths": b.lengths,
                            "gen_logprobs": b.gen_logprobs, "accepted_at": b.stats.accepted_at})
        return record

    def config(steps, *extra):
        return load_config(TINY, OVERRIDES + [f"run.dir={run_dir}", f"run.steps={steps}", *extra])

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


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
