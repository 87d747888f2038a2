"""MTP training (draft.kind mtp): the DeepSeek-V3-style loss and its gradient against an
independent PyTorch MTP module (jaxspec.testing.torch_mtp), no gradient into the policy, and
GRPO runs whose policy is untouched by the draft while acceptance rises."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxspec.config import ConfigError
from jaxspec.models import ModelConfig
from jaxspec.models.hf import save_hf
from jaxspec.models.transformer import param_path, random_policy
from jaxspec.rl.chunked import lm_head
from jaxspec.rl.draft import TargetHead, mtp_hidden, mtp_loss
from jaxspec.rl.plan import prepare_run
from jaxspec.rl.trainer import GRPOTrainer
from jaxspec.testing.rl import make_config, warmed_base
from jaxspec.testing.torch_mtp import TorchMTP, random_head, torch_layout


def _batch(policy, b=3, t=10, seed=0):
    """Random packed rows: right-padded (positions -1), a prompt then response tokens."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, policy.config.vocab_size, (b, t)).astype(np.int32)
    valid = np.array([t, t - 2, t - 4])[:b]
    prompt = np.array([2, 3, 1])[:b]
    idx = np.arange(t)[None, :]
    positions = np.where(idx < valid[:, None], idx, -1).astype(np.int32)
    response = (idx >= prompt[:, None]) & (idx < valid[:, None])
    tokens = np.where(positions >= 0, tokens, 0).astype(np.int32)
    features = rng.standard_normal((b, t, policy.config.hidden_size)).astype(np.float32)
    return tokens, positions, response, features


@pytest.mark.parametrize("chunk", [0, 7])
def test_mtp_loss_and_gradient_match_a_torch_reference(chunk):
    policy = random_policy(ModelConfig.tiny("qwen3"), seed=3)  # tied embeddings, QK-norm
    head = random_head(policy, seed=4)
    tokens, positions, response, features = _batch(policy)
    weight, axis = lm_head(policy)
    target = TargetHead(jnp.zeros(features.shape), weight, vocab_axis=axis)

    def loss(params):
        return mtp_loss(head, params, policy.embed, jnp.asarray(features), jnp.asarray(tokens),
                        jnp.asarray(positions), jnp.asarray(response), target, chunk=chunk)
    (got, metrics), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(head.params)

    # torch: CE of token t+2 from (h_t, embedding of t+1), where t+2 is a response token
    w = torch_layout(head)
    torch_mtp = TorchMTP(w, head.config.layer)
    torch_mtp.w["eh_proj"].requires_grad_(True)
    embeds = np.array(policy.embed(np.roll(tokens, -1, axis=1)))
    logits = torch_mtp(torch.from_numpy(embeds), torch.from_numpy(features),
                       torch.tensor(np.array(weight)))
    logp = torch.log_softmax(logits.double(), -1)
    b, t = tokens.shape
    terms, hits = [], 0
    for i in range(b):
        for j in range(t - 2):
            if response[i, j + 2]:
                terms.append(-logp[i, j, int(tokens[i, j + 2])])
                hits += int(torch.argmax(logits[i, j]) == int(tokens[i, j + 2]))
    want = torch.stack(terms).mean()
    want.backward()
    assert len(terms) == 8 + 5 + 4
    assert float(got) == pytest.approx(float(want.detach()), rel=1e-5)
    assert float(metrics["mtp_acc_0"]) == pytest.approx(hits / len(terms))
    g = {param_path(p)[-1]: np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(grads)[0]}
    want_g = torch_mtp.w["eh_proj"].grad.numpy().T
    np.testing.assert_allclose(g["eh_proj"], want_g, atol=1e-5 * np.abs(want_g).max(), rtol=0)


def test_unrolled_steps_are_what_the_drafter_computes():
    """Step s of the unrolled loss at position t equals the head run the way MTPDrafter
    drafts: a cache of step-0 entries up to t, then s entries fed one at a time, each with
    the previous output and the next token, at positions t+1 .. t+s."""
    policy = random_policy(ModelConfig.tiny("qwen3"), seed=3)
    head = random_head(policy, seed=4)
    tokens, positions, _, features = _batch(policy)
    steps = 3
    unrolled = jax.jit(lambda f, t, p: mtp_hidden(head, head.params, policy.embed, f, t, p, steps))(
        jnp.asarray(features), jnp.asarray(tokens), jnp.asarray(positions))
    # each call compiled on its own (jit only spares eager op-by-op dispatch; same ops)
    forward = jax.jit(lambda tok, h, pos, cache, fuse: head.forward(policy.embed(tok), h, pos, cache,
                                                                   fuse=fuse),
                      static_argnames="fuse")
    for row, t in ((0, 0), (0, 4), (1, 3), (2, 2)):
        prefix = slice(0, t + 1)
        cache = head.init_cache(1, 16)
        out, cache = forward(tokens[row:row + 1, 1:t + 2], features[row:row + 1, prefix],
                             positions[row:row + 1, prefix], cache, fuse=True)
        hidden = out[:, -1:]
        np.testing.assert_allclose(hidden[0, 0], unrolled[0][row, t], atol=1e-5)
        for s in range(1, steps):
            hidden, cache = forward(tokens[row:row + 1, t + 1 + s:t + 2 + s], hidden,
                                    jnp.array([[t + s]], jnp.int32), cache, fuse=False)
            np.testing.assert_allclose(hidden[0, 0], unrolled[s][row, t], atol=1e-5)


def test_no_gradient_reaches_the_policy():
    """The loss as a function of the policy's params (features, embeddings and LM head all
    come from them) has gradient exactly 0; the head's own gradient is not."""
    policy = random_policy(ModelConfig.tiny("qwen3"), seed=3)
    head = random_head(policy, seed=4)
    tokens, positions, response, _ = _batch(policy)
    last = policy.config.num_layers - 1

    def loss(policy_params, head_params):
        p = policy.replace(params=policy_params)
        hidden, captured, _ = p.forward(jnp.asarray(tokens), jnp.asarray(positions),
                                        capture=(last,), head=False)
        weight, axis = lm_head(p)
        return mtp_loss(head, head_params, p.embed, captured[last], jnp.asarray(tokens),
                        jnp.asarray(positions), jnp.asarray(response),
                        TargetHead(hidden, weight, vocab_axis=axis), steps=2)[0]
    to_policy, to_head = jax.jit(jax.grad(loss, argnums=(0, 1)))(policy.params, head.params)
    assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(to_policy))
    assert sum(float(jnp.abs(x).sum()) for x in jax.tree.leaves(to_head)) > 1e-3


@pytest.fixture(scope="module")
def base():
    return warmed_base()[0]  # shared with test_trainer.py (built once per session)


def test_an_hf_path_without_an_mtp_layer_is_refused_before_compiling(base, tmp_path):
    save_hf(base, tmp_path / "policy")
    cfg = make_config(tmp_path / "run", "draft.kind=mtp", f"draft.hf_path={tmp_path / 'policy'}")
    with pytest.raises(ConfigError, match="draft.hf_path.*num_nextn_predict_layers = 0"):
        prepare_run(cfg)


def test_mtp_in_the_loop_leaves_the_policy_alone_and_learns(base, tmp_path):
    """draft.kind mtp from a fresh head: replay rollouts equal plain decoding's, so the policy
    (trained on them) stays bitwise the plain run's; the head's loss falls and its acceptance
    rises over 10 steps."""
    steps = 10
    mtp = GRPOTrainer(make_config(tmp_path / "mtp", f"run.steps={steps}", "draft.kind=mtp"),
                      policy=base)
    plain = GRPOTrainer(make_config(tmp_path / "plain", "run.steps=2", "draft.kind=none"),
                        policy=base)
    rows = []
    for s in range(steps):
        rows.append(mtp.step())
        if s < 2:
            mp = plain.step()
            np.testing.assert_array_equal(mtp.last_batch.tokens, plain.last_batch.tokens)
            assert rows[-1]["grpo/loss"] == mp["grpo/loss"]
            for a, b in zip(jax.tree.leaves(mtp.policy.params),
                            jax.tree.leaves(plain.policy.params), strict=True):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    loss = [m["draft/loss"] for m in rows]
    acc = [m["acceptance_length"] for m in rows]
    assert np.mean(loss[-3:]) < 0.6 * loss[0]
    assert np.mean(acc[-4:]) > acc[0] + 0.1
    assert rows[-1]["draft/acc_0"] > 0.4
    # exported in the DeepSeek-V3 layout, and read back by draft.hf_path
    mtp.export()
    again = GRPOTrainer(make_config(tmp_path / "again", "run.steps=1", "draft.kind=mtp",
                                    f"draft.hf_path={tmp_path / 'mtp' / 'mtp'}"), policy=base)
    for a, b in zip(jax.tree.leaves(again.head.params), jax.tree.leaves(mtp.head.params),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_resumed_mtp_run_restores_the_head_and_its_optimizer(base, tmp_path):
    first = GRPOTrainer(make_config(tmp_path, "run.steps=2", "draft.kind=mtp"), policy=base)
    first.run()
    resumed = GRPOTrainer(make_config(tmp_path, "run.steps=3", "draft.kind=mtp",
                                      "run.resume=true"), policy=base)
    assert resumed.completed == 2
    for a, b in zip(jax.tree.leaves((first.head.params, first.draft_opt_state)),
                    jax.tree.leaves((resumed.head.params, resumed.draft_opt_state)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
