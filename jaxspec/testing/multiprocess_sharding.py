"""One process of the two-process run (tests/parallel/test_multiprocess.py), and the step
both runs share.

As a program: `python -m jaxspec.testing.multiprocess_sharding PROCESS_ID NUM_PROCESSES PORT
WORKDIR`, with 4 CPU devices per process. It joins the run over 127.0.0.1, loads the policy
from the HF directory WORKDIR/hf straight into its shardings on a global data=2, fsdp=2,
tensor=2 mesh, feeds only its own rows, runs two sharded train steps (forward + next-token
loss + adamw), saves params and optimizer state with orbax, restores them onto a fsdp=4,
tensor=2 mesh, and process 0 writes what both saw (gathered to the host) to
WORKDIR/multiprocess.npz.
"""

import os
import sys

import numpy as np

BATCH, LENGTH, VOCAB = 8, 8, 128
MESH = (2, 2, 2)
RESTORE_MESH = (1, 4, 2)


def make_tokens():  # -> [BATCH, LENGTH] int32: the global batch, the same in every process
    return np.random.default_rng(7).integers(0, VOCAB, (BATCH, LENGTH)).astype(np.int32)


def sharded_train_step(policy, mesh, local_tokens):
    """Shard `policy` on `mesh`, then two jitted train steps (forward + next-token loss + adamw).

    local_tokens: [rows, LENGTH], this process's rows of the global batch.
    Returns (params, opt_state, loss, logits [BATCH, LENGTH, VOCAB]), all global arrays.
    """
    import jax
    import jax.numpy as jnp
    import optax

    from jaxspec import parallel

    optimizer = optax.adamw(1e-2)
    policy = parallel.shard_policy(policy, mesh)
    opt_shardings = parallel.param_shardings(jax.eval_shape(optimizer.init, policy.params), mesh)
    opt_state = jax.jit(optimizer.init, out_shardings=opt_shardings)(policy.params)
    tokens = parallel.shard_batch(local_tokens, mesh, process_local=True)

    def loss_fn(params, tokens):  # tokens [B, T]
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        logits, _, _ = policy.replace(params=params).forward(tokens, positions)
        logits = parallel.constrain(logits, ("batch", "length", "vocab"))
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        target = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
        return -jnp.mean(target), logits

    @jax.jit
    def step(params, opt_state, tokens):
        (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        params = jax.lax.with_sharding_constraint(params, parallel.param_shardings(params, mesh))
        return params, opt_state, loss, logits

    with jax.set_mesh(mesh):
        params, opt_state, _, _ = step(policy.params, opt_state, tokens)
        return step(params, opt_state, tokens)  # the second step's loss and logits


def main(process_id: int, num_processes: int, port: int, workdir: str):
    import jax

    from jaxspec import parallel

    address = f"127.0.0.1:{port}"
    assert parallel.initialize_distributed(address, num_processes, process_id,
                                           bind_address=address, timeout_s=90)
    from jax.experimental import multihost_utils

    from jaxspec.checkpoint import CheckpointManager
    from jaxspec.models import load_hf

    assert jax.process_count() == num_processes and jax.local_device_count() == 4
    mesh = parallel.make_mesh(*MESH)
    hf_dir = os.path.join(workdir, "hf")
    policy = load_hf(hf_dir, shardings=parallel.hf_shardings(hf_dir, mesh))
    rows = parallel.local_batch_rows(mesh, BATCH)
    params, opt_state, loss, logits = sharded_train_step(policy, mesh, make_tokens()[rows])
    # host values placed on multi-process shardings: each process keeps its own shards
    same_shards = [
        all(np.array_equal(a.data, b.data) for a, b in zip(x.addressable_shards, y.addressable_shards))
        for x, y in [
            (parallel.shard_batch(make_tokens(), mesh),
             parallel.shard_batch(make_tokens()[rows], mesh, process_local=True)),
            *zip(jax.tree.leaves(parallel.shard_policy(jax.device_get(policy), mesh).params),
                 jax.tree.leaves(policy.params)),
        ]
    ]

    with CheckpointManager(os.path.join(workdir, "ckpt")) as manager:
        manager.save(1, {"params": params, "opt": opt_state, "step": 1}, {"processes": num_processes})
        other = parallel.make_mesh(*RESTORE_MESH)
        target = {"params": parallel.restore_target(params, parallel.param_shardings(params, other)),
                  "opt": parallel.restore_target(opt_state, parallel.param_shardings(opt_state, other)),
                  "step": 0}
        restored, _ = manager.restore(1, target)

    def gather(tree):
        return [np.asarray(x) for x in jax.tree.leaves(multihost_utils.process_allgather(tree, tiled=True))]

    out = {"loss": gather(loss)[0], "logits": gather(logits)[0], "rows": rows,
           "same_shards": np.asarray(gather(np.asarray(same_shards))[0]),
           "restored_step": np.asarray(restored["step"]),
           "restored_spec": np.asarray(str(restored["params"]["embed_tokens"][...].sharding.spec))}
    for name in ("params", "opt"):
        saved = gather(params if name == "params" else opt_state)
        for i, (x, y) in enumerate(zip(saved, gather(restored[name]), strict=True)):
            out[f"{name}_{i}"], out[f"restored_{name}_{i}"] = x, y
    if process_id == 0:
        np.savez(os.path.join(workdir, "multiprocess.npz"), **out)
    multihost_utils.sync_global_devices("results written")
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
