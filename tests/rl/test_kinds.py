"""The drafter-kind registry (`jaxspec.rl.kinds`): a kind registered in one place is
validated, given its cache headroom, built and trained with by the whole RL side.

The test-only kind `repeat` drafts the last committed token k times (model-free). Its GRPO
step is checked against plain decoding (speculation is lossless: the same tokens, rewards
and loss) and its acceptance counters against a brute-force replay of the drafts over the
generated tokens."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import draft_kinds
from jaxspec.config import ConfigError, load_config
from jaxspec.decoding.tree import Tree
from jaxspec.rl import kinds
from jaxspec.rl.build import build_policy
from jaxspec.rl.cluster import Cluster
from jaxspec.rl.plan import prepare_run
from jaxspec.rl.trainer import GRPOTrainer

TINY = "configs/tiny.yaml"
SHORT = ["rollout.prompts_per_step=4", "rollout.group_size=4", "warmup.steps=60",
         "warmup.batch_size=32", "run.compare_plain=0", "run.save_every=0", "run.steps=1",
         "rollout.max_new_tokens=8"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RepeatDrafter:
    """Drafts the root (the last committed token) repeated k times; no model, no state."""

    k: int = dataclasses.field(default=3, metadata=dict(static=True))
    capture_layers = ()
    forwards_per_propose = 0
    forwards_per_observe = 0
    supports_rejection = False
    num_nodes = property(lambda self: self.k)
    max_depth = property(lambda self: self.k)

    def check_compatible(self, policy) -> None:
        return None

    def init_state(self, policy, batch, max_len):
        return None

    def observe(self, state, policy, obs):
        return state

    def propose(self, state, policy, ctx):
        tokens = jnp.repeat(ctx.root[:, None], self.k, axis=1)  # [batch, k]
        return Tree.chain(tokens), None, state


# The whole of what adding the kind takes: one registration.
REPEAT = kinds.DraftKind(
    name="repeat", make_drafter=lambda d, tree, **_: RepeatDrafter(k=d.k),
    headroom=lambda d: d.k, deepest=lambda d: (d.k, "draft.k"))


@pytest.fixture
def repeat_kind(monkeypatch):  # kinds.register(REPEAT), undone after the test
    monkeypatch.setitem(kinds.KINDS, "repeat", REPEAT)
    monkeypatch.setitem(draft_kinds.RULES, "repeat", REPEAT)


def test_an_unregistered_kind_is_refused():  # the negative control
    with pytest.raises(ConfigError, match="draft.kind.*not a valid choice"):
        load_config(TINY, ["draft.kind=repeat"])


def test_the_registry_validates_and_sizes_a_new_kind(repeat_kind, tmp_path):
    cfg = load_config(TINY, [*SHORT, "draft.kind=repeat", f"run.dir={tmp_path}"])
    assert cfg.draft.kind == "repeat"
    with pytest.raises(ConfigError, match="draft kind 'repeat' does not take draft.tree"):
        load_config(TINY, ["draft.kind=repeat", "draft.tree={}"])
    with pytest.raises(ConfigError, match=r"draft.k \+ 1 = 4"):
        load_config(TINY, ["draft.kind=repeat", "draft.collapse_threshold=4.5"])
    # the cache check of the run plan uses the kind's headroom: k fed drafts + 1 slot
    room = 256 - 8 - (3 + 1)
    prepare_run(load_config(TINY, [*SHORT, "draft.kind=repeat", f"run.dir={tmp_path}",
                                   f"rollout.max_prompt_len={room}"]))
    with pytest.raises(ConfigError, match="draft headroom 4 does not fit"):
        prepare_run(load_config(TINY, [*SHORT, "draft.kind=repeat", f"run.dir={tmp_path}",
                                       f"rollout.max_prompt_len={room + 1}"]))


def _verifies(first, tokens, k: int) -> int:
    """Verify steps that generate `tokens` after the prompt's last token `first` (the
    prefill covers the prompt before it, so `first` is the first root) when every draft is
    the root repeated k times: each accepts the leading tokens equal to its root (at most k)
    and adds the policy's own next token."""
    seq = [first, *tokens]
    p = steps = 0
    while p < len(seq) - 1:
        a = 0
        while a < k and p + 1 + a < len(seq) and seq[p + 1 + a] == seq[p]:
            a += 1
        p += a + 1
        steps += 1
    return steps


def test_a_grpo_step_with_a_registered_kind(repeat_kind, tmp_path):
    base = load_config(TINY, [*SHORT, f"run.dir={tmp_path / 'base'}"])
    plan = prepare_run(base)
    policy = build_policy(base, plan, Cluster.from_plan(base, plan), resuming=False)
    spec = GRPOTrainer(load_config(TINY, [*SHORT, "draft.kind=repeat",
                                          f"run.dir={tmp_path / 'repeat'}"]), policy=policy)
    plain = GRPOTrainer(load_config(TINY, [*SHORT, "draft.kind=none",
                                           f"run.dir={tmp_path / 'plain'}"]), policy=policy)
    assert spec.head is None and not spec.trains_draft  # the kind has no head
    ms, mp = spec.step(), plain.step()
    a, b = spec.last_batch, plain.last_batch
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.lengths, b.lengths)
    for key in ("reward", "grpo/loss", "grpo/kl", "grpo/grad_norm"):
        assert ms[key] == mp[key], key
    # every row's verify count, replayed by brute force over its tokens; a static batch, so
    # each row's steps are its own
    tokens, lengths = np.asarray(a.tokens), np.asarray(a.lengths)
    prompts, prompt_lengths = np.asarray(a.prompts), np.asarray(a.prompt_lengths)
    want = [_verifies(int(p[m - 1]), t[:n].tolist(), 3)
            for p, m, t, n in zip(prompts, prompt_lengths, tokens, lengths)]
    np.testing.assert_array_equal(np.asarray(a.stats.row_steps), want)
    # each verify emits its accepted drafts and one token of the policy's own
    accepted = int(np.sum(a.stats.accepted_at))
    assert accepted == int(np.sum(lengths)) - int(np.sum(want))
    assert accepted > 0  # repeats were drafted and accepted: the check is not vacuous
