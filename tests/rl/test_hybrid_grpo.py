"""GRPO with a hybrid policy (family qwen3_5: Gated DeltaNet + gated full attention): the
logprob stage, the GRPO update's gradient and the supervised warm-up's loss against
transformers' Qwen3_5ForCausalLM on the same weights (its own forward and autograd), and the
trainer building, checkpointing and resuming one."""

import numpy as np
import optax
import pytest

import jax
import jax.numpy as jnp

from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.models import HybridPolicy, ModelConfig, save_hf
from jaxspec.models.hybrid import random_hybrid_policy
from jaxspec.rl.grpo import GRPOConfig
from jaxspec.rl.steps import POLICY_INPUTS, policy_update, score_rollouts
from jaxspec.rl.warmup import supervised_warmup

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 64
CONFIG = ModelConfig.tiny(
    "qwen3_5", vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_layers=3,
    layer_types=("linear_attention", "full_attention", "linear_attention"),
    linear_key_head_dim=8, linear_value_head_dim=8, partial_rotary_factor=0.5)
SGD = optax.sgd(1.0)  # the update is minus the gradient itself


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(transformers' Qwen3_5ForCausalLM, our policy) on the same O(1) random weights, moved
    over by our export."""
    path = tmp_path_factory.mktemp("qwen3_5")
    policy = random_hybrid_policy(CONFIG, seed=0)
    save_hf(policy, path)
    model = transformers.Qwen3_5ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, policy


def _batch(seed=0):
    """Ragged prompts and rollouts, right-padded, as the generator hands them over."""
    rng = np.random.default_rng(seed)
    prompt_lengths = np.array([3, 5, 2, 4], np.int32)
    lengths = np.array([9, 4, 11, 1], np.int32)
    prompts = np.where(np.arange(5) < prompt_lengths[:, None], rng.integers(1, VOCAB, (4, 5)), 0)
    tokens = np.where(np.arange(11) < lengths[:, None], rng.integers(1, VOCAB, (4, 11)), 0)
    return (jnp.asarray(prompts, jnp.int32), jnp.asarray(prompt_lengths),
            jnp.asarray(tokens, jnp.int32), jnp.asarray(lengths), jnp.zeros((4, 11), jnp.float32))


def _hf_rows(batch):
    """Each row's prompt + rollout as one unpadded sequence (transformers sees no padding)."""
    prompts, plens, tokens, lengths, _ = (np.asarray(a) for a in batch)
    return [np.concatenate([prompts[i, :plens[i]], tokens[i, :lengths[i]]])
            for i in range(len(plens))], plens


def _hf_logprobs(model, seq, plen):  # -> log p of the rollout tokens [n] (torch, with grad)
    logits = model(torch.tensor(seq)[None]).logits[0].float()
    lp = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(seq[1:])[:, None])[:, 0]
    return lp[plen - 1:]


def test_scored_logprobs_equal_transformers(pair):
    model, policy = pair
    batch = _batch()
    scored = score_rollouts(policy, None, *batch, SamplingConfig(1.0), chunk=16)
    rows, plens = _hf_rows(batch)
    errs = []
    for i, seq in enumerate(rows):
        with torch.no_grad():
            want = _hf_logprobs(model, seq, plens[i]).numpy()
        got = np.asarray(scored["logprobs"][i])[np.asarray(scored["mask"][i])]
        assert got.shape == want.shape
        errs.append(np.abs(got - want).max())
    assert max(errs) <= 1e-5, errs
    assert np.abs(np.asarray(scored["logprobs"])[~np.asarray(scored["mask"])]).max() == 0


def _update_delta(policy, scored, adv, grpo):
    new, _, metrics = policy_update(policy, SGD.init(policy.params), scored, adv,
                                    SamplingConfig(1.0), optimizer=SGD, grpo_cfg=grpo,
                                    minibatches=1, filtered=False)
    return jax.tree.map(lambda a, b: a - b, new.params, policy.params), metrics


def _hf_grpo_grads(model, batch, adv, drop_last=False):
    """transformers' autograd of the GRPO loss at ratio 1 (old = current log-probs):
    -sum over rollout tokens of A * exp(lp - stop_grad(lp)) / number of tokens."""
    rows, plens = _hf_rows(batch)
    model.zero_grad()
    total, count = 0.0, 0
    for i, seq in enumerate(rows):
        lp = _hf_logprobs(model, seq, plens[i])
        if drop_last:
            lp = lp[:-1]
        total = total - adv[i] * torch.exp(lp - lp.detach()).sum()
        count += lp.shape[0]
    (total / count).backward()
    return {name: p.grad.numpy().copy() for name, p in model.named_parameters()}


def test_grpo_update_gradient_equals_transformers_autograd(pair, tmp_path):
    """The update of plain SGD (lr 1) is minus the GRPO gradient; exported under HF's tensor
    names it equals transformers' autograd of the same loss, leaf by leaf. Negative control:
    the gradient with one rollout token left out is outside the tolerance."""
    from safetensors.numpy import load_file

    model, policy = pair
    batch = _batch(1)
    adv = np.array([1.0, -0.5, 0.3, -0.8], np.float32)
    scored = score_rollouts(policy, None, *batch, SamplingConfig(1.0), chunk=16)
    scored = {k: scored[k] for k in POLICY_INPUTS if k in scored}
    grpo = GRPOConfig(kl_coef=0.0, logprob_chunk=16)
    delta, metrics = _update_delta(policy, scored, jnp.asarray(adv), grpo)
    save_hf(policy.replace(params=jax.tree.map(lambda d: -d, delta)), tmp_path)
    ours = {k: v for f in sorted(tmp_path.glob("*.safetensors")) for k, v in load_file(f).items()}
    want = _hf_grpo_grads(model, batch, adv)
    control = _hf_grpo_grads(model, batch, adv, drop_last=True)
    assert set(ours) == set(want)

    def rel_err(ref):
        return max(np.abs(ours[k] - ref[k]).max() / np.abs(ref[k]).max() for k in ref)

    assert float(metrics["clip_fraction"]) == 0.0
    print(f"GRPO gradient vs transformers: {rel_err(want):.2e} of each leaf's largest; "
          f"one token left out: {rel_err(control):.2e}")
    assert rel_err(want) <= 1e-4, rel_err(want)
    assert rel_err(control) > 1e-2  # the tolerance tells one token apart


def test_warmup_loss_is_transformers_cross_entropy_one_sequence_per_row(pair):
    """The first warm-up step's loss (before any update) is transformers' mean NLL of the
    target tokens, the sequences unpacked: short sequences packed into one row would carry
    a recurrent state from one into the next."""
    model, policy = pair
    rng = np.random.default_rng(3)
    lens = np.array([20, 3, 4, 5])  # the three short ones would pack into one row
    tokens = np.where(np.arange(20) < lens[:, None], rng.integers(1, VOCAB, (4, 20)), 0)
    mask = (np.arange(20) >= 1) & (np.arange(20) < lens[:, None] - 1)  # targets t + 1
    _, losses = supervised_warmup(policy, tokens, mask, steps=1, batch_size=4, lr=1e-3)
    nll, count = 0.0, 0
    with torch.no_grad():
        for i, n in enumerate(lens):
            seq = tokens[i, :n]
            lp = torch.log_softmax(model(torch.tensor(seq)[None]).logits[0].float(), -1)
            picked = lp[:-1].gather(1, torch.tensor(seq[1:])[:, None])[:, 0].numpy()
            nll -= picked[mask[i, :n - 1]].sum()
            count += mask[i].sum()
    np.testing.assert_allclose(losses[0], nll / count, rtol=1e-5)



# A tiny Qwen3.5-layout policy in the trainer's config (configs/tiny.yaml, jaxspec.testing.rl)
HYBRID = ["model.family=qwen3_5", "model.num_layers=4",
          "model.layer_types=[linear_attention, linear_attention, linear_attention, "
          "full_attention]", "model.linear_num_key_heads=2", "model.linear_num_value_heads=4",
          "model.linear_key_head_dim=16", "model.linear_value_head_dim=16",
          "model.linear_conv_kernel_dim=4", "model.partial_rotary_factor=0.25"]


@pytest.mark.parametrize("extra,message", [
    (["draft.kind=history"], r"draft.history.chain.*False.*drafts trees.*qwen3_5.*"
     r"draft.history.chain=true"),
    (["draft.kind=hybrid"], r"draft.kind.*hybrid.*drafts trees.*qwen3_5.*chains"),
    (["draft.tree={top_k: 2, depth: 2, budget: 4}"], r"draft.tree.*drafts trees"),
    (["model.fused_kernels=pallas"], r"model.fused_kernels.*no fused decoder-layer kernels"),
    (["model.family=qwen3_next", "model.num_experts=4", "model.num_experts_per_tok=2",
      "model.moe_intermediate_size=16"], r"model.num_experts.*4.*routing"),
    (["draft.kind=draft_model", "draft.model={family: qwen3_5, num_layers: 2, layer_types: "
      "[linear_attention, full_attention], linear_num_key_heads: 1, linear_num_value_heads: 1, "
      "linear_key_head_dim: 8, linear_value_head_dim: 8, linear_conv_kernel_dim: 2}"],
     r"draft.model.family.*qwen3_5.*roll back"),
], ids=["history", "history+head", "tree", "fused_kernels", "next-experts", "hybrid-draft-model"])
def test_what_the_trainer_cannot_do_with_a_hybrid_is_one_error_before_compiling(
        tmp_path, extra, message):
    from jaxspec.config import ConfigError
    from jaxspec.rl.plan import prepare_run
    from jaxspec.testing.rl import make_config

    with pytest.raises(ConfigError, match=message):
        prepare_run(make_config(tmp_path, *HYBRID, *extra))


def test_trainer_trains_checkpoints_and_resumes_a_hybrid_policy_bitwise(tmp_path):
    """4 GRPO steps straight equal 2 steps, a stop right after step 2's checkpoint and a
    resumed run of 2 more (params, optimizer state, metrics); every 2nd step's speculative
    (history chains: the best-matched path of the group's and the stored rollouts) rollouts
    are checked equal to plain ones by the trainer itself."""
    from jaxspec.rl.trainer import GRPOTrainer
    from jaxspec.testing.rl import Killed, assert_same_tree, make_config, rows

    extra = [*HYBRID, "draft.kind=history", "draft.history.chain=true", "draft.k=3",
             "warmup.steps=0", "run.steps=4"]
    straight = GRPOTrainer(make_config(tmp_path / "straight", *extra))
    assert isinstance(straight.policy, HybridPolicy)
    straight.run()
    first = GRPOTrainer(make_config(tmp_path / "killed", *extra))

    def kill(step, row):
        if step == 2:
            raise Killed

    with pytest.raises(Killed):
        first.run(on_step=kill)
    resumed = GRPOTrainer(make_config(tmp_path / "killed", *extra, "run.resume=true"))
    assert resumed.completed == 2 and isinstance(resumed.policy, HybridPolicy)
    resumed.run()
    assert resumed.completed == straight.completed == 4
    assert_same_tree(resumed.policy.params, straight.policy.params)
    assert_same_tree(resumed.opt_state, straight.opt_state)
    got = rows(tmp_path / "killed")
    assert got == rows(tmp_path / "straight")
    assert [r["step"] for r in got if "replay_identical" in r] == [1, 3]
    assert all(r["replay_identical"] for r in got if "replay_identical" in r)
    assert max(r["grpo/logprob_mismatch_max"] for r in got) < 1e-4  # generator vs trainer


def test_the_recurrent_rule_policy_scores_as_the_chunked_one(pair):
    """The trainer's CPU choice (delta_rule="recurrent") scores within rounding of the
    chunked form (transformers' own), which test_scored_logprobs_equal_transformers holds
    to transformers."""
    _, policy = pair
    batch = _batch(2)
    a = score_rollouts(policy, None, *batch, SamplingConfig(1.0), chunk=16)["logprobs"]
    b = score_rollouts(policy.replace(delta_rule="recurrent"), None, *batch,
                       SamplingConfig(1.0), chunk=16)["logprobs"]
    assert np.abs(np.asarray(a) - np.asarray(b)).max() <= 1e-5
    with pytest.raises(ValueError, match="delta_rule='scan'.*chunked"):
        policy.replace(delta_rule="scan")


# Qwen3.5-9B's config.json as released (multimodal: the language model's keys in text_config;
# transformers' Qwen3_5TextConfig defaults are this model's), the vision tower left out
QWEN3_5_9B = {
    "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
    "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 4096,
        "intermediate_size": 12288, "num_hidden_layers": 32, "num_attention_heads": 16,
        "num_key_value_heads": 4, "head_dim": 256, "hidden_act": "silu",
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                        for i in range(32)],
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "mtp_num_hidden_layers": 1,
        "attn_output_gate": True, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000,
                            "partial_rotary_factor": 0.25, "mrope_interleaved": True,
                            "mrope_section": [11, 11, 10]}},
}


def test_the_shipped_hybrid_configs(tmp_path):
    """configs/qwen3_5_9b_mtp.yaml's model section is Qwen3.5-9B's config.json (8.95B
    parameters in the language model); configs/hybrid.yaml passes every check made before
    compiling on one CPU device."""
    from jaxspec.config import load_config
    from jaxspec.models.hf import config_from_hf
    from jaxspec.rl.plan import prepare_run
    from jaxspec.testing import ROOT

    cfg = load_config(ROOT / "configs" / "qwen3_5_9b_mtp.yaml", check_paths=False)
    ours = cfg.model.model_config(248320)
    assert ours == config_from_hf(QWEN3_5_9B, dtype="bfloat16",
                                  attention_backend=ours.attention_backend)
    assert round(HybridPolicy.abstract(ours).num_params / 1e9, 2) == 8.95
    assert cfg.draft.kind == "mtp" and cfg.draft.tree is None
    tiny = load_config(ROOT / "configs" / "hybrid.yaml", [f"run.dir={tmp_path}"])
    plan = prepare_run(tiny, devices=jax.devices()[:1])
    assert plan.model_config.is_hybrid and tiny.run.compare_plain > 0
    assert tiny.draft.kind == "history" and tiny.draft.history.chain
    # the header's alternative: Qwen3.5's MTP head drafting
    mtp = load_config(ROOT / "configs" / "hybrid.yaml", [f"run.dir={tmp_path}",
                                                        "draft.kind=mtp", "draft.k=3"])
    prepare_run(mtp, devices=jax.devices()[:1])
