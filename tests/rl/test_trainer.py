"""The GRPO trainer (sync): replay verification of whole training steps, the first step
against an independent GRPO computation, and the acceptance-collapse alarm.

All trainers in tests/rl share one warmed-up base (`jaxspec.testing.rl.warmed_base`: tiny
policy + in-domain EAGLE-3 head) and the same shapes, so compiled programs and the warm-up
are reused.
"""

import dataclasses
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxspec.rl.tasks import CharTokenizer
from jaxspec.rl.trainer import GRPOTrainer
from jaxspec.testing import ROOT
from jaxspec.testing.rl import make_config, packed, rollout_logprobs, warmed_base


@pytest.fixture(scope="module")
def base():
    return warmed_base()[:2]


def test_warmup_makes_a_base_policy_and_an_in_domain_draft():
    policy, head, history = warmed_base()
    losses = history["policy loss"]
    assert losses.shape == (100,)
    assert losses[0] == pytest.approx(np.log(25), abs=0.1)  # a random 25-token model
    assert losses[-10:].mean() < 0.45 * losses[0]
    # the draft learnt on the policy's own rollouts: top-1 agreement far above chance (1/25)
    first, last = history["draft"][0], history["draft"][-1]
    assert len(history["draft"]) == 30
    assert last["draft_loss"] < 0.5 * first["draft_loss"] and last["draft_acc_0"] > 0.5
    # its vocabulary was chosen from the completion-token counts (64 rollouts of at most 8
    # tokens, nearly all digits and EOS)
    counts = history["draft_token_counts"]
    tok = CharTokenizer()
    used = [tok.EOS] + [tok.encode(d)[0] for d in "0123456789"]
    assert 64 <= counts.sum() <= 64 * 8 and counts[used].sum() > 0.9 * counts.sum()
    assert set(np.asarray(head.draft_to_target()).tolist()) == set(range(25))


def one_device(tree):
    return jax.device_put(tree, jax.devices()[0])


def test_replay_training_equals_plain_training(base, tmp_path):
    """Speculative rollouts (EAGLE-3, replay, 5 refilled slots for the 16 rollouts of a step)
    and plain rollouts (a static batch) with the same key give the same tokens, losses and
    parameters, step for step."""
    policy, head = base
    spec = GRPOTrainer(make_config(tmp_path / "spec", "run.steps=3", "rollout.slots=5"),
                       policy=policy, head=head)
    plain = GRPOTrainer(make_config(tmp_path / "plain", "run.steps=3", "draft.kind=none"),
                        policy=policy)
    accepted = 0
    for _ in range(3):
        ms, mp = spec.step(), plain.step()
        np.testing.assert_array_equal(spec.last_batch.tokens, plain.last_batch.tokens)
        np.testing.assert_array_equal(spec.last_batch.lengths, plain.last_batch.lengths)
        np.testing.assert_allclose(spec.last_batch.gen_logprobs, plain.last_batch.gen_logprobs,
                                   atol=1e-5)
        for key in ("reward", "grpo/loss", "grpo/kl", "grpo/grad_norm", "grpo/entropy"):
            assert ms[key] == mp[key], key
        assert mp["acceptance_length"] == 1.0
        accepted += int(np.sum(spec.last_batch.stats.accepted_at))
        for a, b in zip(jax.tree.leaves(spec.policy.params), jax.tree.leaves(plain.policy.params),
                        strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert accepted > 0  # the drafts were really accepted, so the check is not vacuous
    assert ms["acceptance_length"] > 1.0 and "draft/loss" in ms
    assert int(spec.last_batch.stats.prefill_forwards) == 16 - 5  # the slots were refilled
    assert 0.0 <= ms["wasted_row_steps"] < 1.0 and ms["tokens_per_slot_step"] > 0


def test_first_step_matches_an_independent_grpo_computation(base, tmp_path):
    policy, head = base
    cfg = make_config(tmp_path, "run.steps=1")
    trainer = GRPOTrainer(cfg, policy=policy, head=head)
    m = trainer.step()
    batch = trainer.last_batch
    g = cfg.rollout.group_size

    # rewards: the task's reward of each decoded completion
    examples = trainer.task.batch(0, cfg.rollout.prompts_per_step)
    tok = trainer.tokenizer
    rewards = np.array([trainer.task.reward(examples[i // g], tok.decode(batch.tokens[i, :n]))
                        for i, n in enumerate(batch.lengths)])
    np.testing.assert_allclose(batch.rewards, rewards)
    assert m["reward"] == pytest.approx(rewards.mean())
    # acceptance length = tokens per policy forward
    assert m["acceptance_length"] == pytest.approx(
        batch.stats.tokens_generated.sum() / batch.stats.row_steps.sum())

    # GRPO by hand: advantages (r - mean) / (std + eps) per group; at the first step the
    # ratio is 1 and the reference is the policy, so loss = -sum_b A_b n_b / sum_b n_b.
    r = rewards.reshape(-1, g)
    adv = ((r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-6)).ravel()
    n = batch.lengths.astype(np.float64)
    assert m["grpo/loss"] == pytest.approx(-(adv * n).sum() / n.sum(), abs=1e-6)
    assert m["grpo/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert m["grpo/clip_fraction"] == 0.0
    assert m["grpo/kl"] == pytest.approx(0.0, abs=1e-6)
    assert m["grpo/logprob_mismatch_max"] < 1e-4  # generator and trainer: the same model code

    # the gradient of the same objective written independently
    params0 = one_device(policy.params)
    pol = one_device(policy)
    mask = jnp.arange(batch.tokens.shape[1])[None, :] < jnp.asarray(batch.lengths)[:, None]
    lp_old = rollout_logprobs(pol, params0, batch)
    np.testing.assert_allclose(np.asarray(lp_old), batch.gen_logprobs, atol=1e-5)

    def objective(params):
        lp = rollout_logprobs(pol, params, batch)
        ratio = jnp.exp(lp - jax.lax.stop_gradient(lp))
        d = lp_old - lp
        kl = jnp.exp(d) - d - 1.0
        per_token = -jnp.asarray(adv, jnp.float32)[:, None] * ratio + cfg.grpo.kl_coef * kl
        return jnp.sum(jnp.where(mask, per_token, 0.0)) / jnp.sum(mask)

    grad_norm = float(optax.tree.norm(jax.grad(objective)(params0)))
    assert m["grpo/grad_norm"] == pytest.approx(grad_norm, rel=1e-3)
    # the update raised the advantage-weighted log-likelihood of the batch
    lp_new = rollout_logprobs(pol, one_device(trainer.policy.params), batch)
    gain = float(jnp.sum(jnp.asarray(adv)[:, None] * jnp.where(mask, lp_new - lp_old, 0.0)))
    assert gain > 0
    # the entropy the trainer logs is the policy's at the rollout positions
    seq, pos = packed(batch)
    logits = pol.forward(jnp.asarray(seq), jnp.asarray(pos))[0]
    logp = jax.nn.log_softmax(logits, -1)
    ent = -jnp.sum(jnp.exp(logp) * logp, -1)  # [B, T]
    pl = batch.prompt_lengths[:, None]
    t = np.arange(seq.shape[1])[None, :]
    ent_mask = (t >= pl - 1) & (t < pl - 1 + batch.lengths[:, None])
    assert m["grpo/entropy"] == pytest.approx(float(ent[ent_mask].mean()), rel=1e-4)


def test_acceptance_collapse_raises_the_alarm(base, tmp_path):
    """A draft whose weights were dropped (zeroed) at sync proposes nothing acceptable: the
    acceptance length is logged every step and the alarm fires after `patience` steps."""
    policy, head = base
    dropped = dataclasses.replace(head, params=jax.tree.map(jnp.zeros_like, head.params))
    lines = []
    # argmax drafts: a zeroed head's are all token 0, never accepted (coupled draws from its
    # uniform q would match the policy's token 1 / V of the time, ~1.05 at this vocabulary)
    cfg = make_config(tmp_path, "run.steps=3", "draft.online=false", "draft.collapse_patience=2",
                      "draft.coupled=false")
    trainer = GRPOTrainer(cfg, policy=policy, head=dropped, log=lines.append)
    alarms, lengths = [], []
    for _ in range(3):
        m = trainer.step()
        alarms.append(m["alarm/acceptance_collapse"])
        lengths.append(m["acceptance_length"])
    assert lengths == [1.0, 1.0, 1.0]
    assert alarms == [0, 1, 1]
    warnings = [line for line in lines if line.startswith("WARNING: acceptance length")]
    assert len(warnings) == 2 and "1.000 < 1.05 for 2 steps" in warnings[0]
    # the healthy head does not alarm
    healthy = GRPOTrainer(make_config(tmp_path / "ok", "run.steps=1"), policy=policy, head=head)
    m = healthy.step()
    assert m["acceptance_length"] > cfg.draft.collapse_threshold
    assert m["alarm/acceptance_collapse"] == 0


def test_training_logprobs_are_those_of_the_sampling_distribution(base, tmp_path):
    """With temperature 0.7 and top-k 3 the generator samples from the processed
    distribution; the trainer's log-probs (the ratio's denominator) are of that same
    distribution, so generation and training agree to rounding."""
    policy, head = base
    cfg = make_config(tmp_path, "run.steps=1", "sampling.temperature=0.7", "sampling.top_k=3")
    trainer = GRPOTrainer(cfg, policy=policy, head=head)
    m = trainer.step()
    batch = trainer.last_batch
    assert m["grpo/logprob_mismatch_max"] < 1e-4
    # independently: log_softmax over the top 3 of logits / 0.7
    seq, pos = packed(batch)
    logits = np.asarray(one_device(policy).forward(jnp.asarray(seq), jnp.asarray(pos))[0]) / 0.7
    kth = np.sort(logits, axis=-1)[..., -3][..., None]
    z = np.where(logits >= kth, logits, -np.inf)
    logp = z - np.log(np.sum(np.exp(z - z.max(-1, keepdims=True)), -1, keepdims=True)) \
        - z.max(-1, keepdims=True)
    for i in range(seq.shape[0]):
        pl = int(batch.prompt_lengths[i])
        for j in range(int(batch.lengths[i])):
            assert logp[i, pl + j - 1, batch.tokens[i, j]] == pytest.approx(
                batch.gen_logprobs[i, j], abs=1e-5)


def test_tasks_and_grpo_import_without_the_trainer():
    """jaxspec.rl resolves its names lazily: the tasks and the GRPO loss need neither the
    trainer nor orbax nor optax."""
    heavy = ("optax", "orbax", "jaxspec.rl.trainer", "jaxspec.checkpoint")
    code = ("import sys, jaxspec.rl, jaxspec.rl.tasks, jaxspec.rl.grpo; "
            f"print(sorted(m for m in sys.modules if m.startswith({heavy})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout.strip()
    assert out == "[]"
    import jaxspec.rl

    assert jaxspec.rl.GRPOTrainer is GRPOTrainer and "draft_optimizer" not in jaxspec.rl.__all__
    with pytest.raises(AttributeError, match="no attribute 'draft_optimizer'"):
        jaxspec.rl.draft_optimizer
