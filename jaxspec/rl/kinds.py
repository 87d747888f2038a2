"""The drafter kinds of the RL side (`draft.kind`), registered by name in one place.

A `DraftKind` says everything the trainer needs about a kind: how its `draft:` section is
checked, the cache headroom a verify step needs, the longest chain it can have accepted,
how its drafter is built, and, through its `HeadKind`, whether it trains a head and how that
head is checked on disk, built, trained offline and exported. The config, the run plan, the
rollout worker, the trainer and scripts/train_draft.py look the kind up here, so a new kind
is one `register` call (see `tests/rl/test_kinds.py` for a test-only kind).

What the config checks (headroom, depth, tree, adaptive length, rejection, the kind's own
checks) is the kind's `jaxspec.draft_kinds.KindRules`, below both the config and `rl`; a
`DraftKind` extends it with the trainer's parts. Modules of the trainer (plan, drafting,
model savers) are imported inside the functions that use them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from jaxspec import draft_kinds
from jaxspec.decoding import drafters as drafters_lib
from jaxspec.decoding import history as history_lib
from jaxspec.draft_kinds import RULES, KindRules

__all__ = ["DraftKind", "HeadKind", "KINDS", "register"]


@dataclasses.dataclass(frozen=True)
class HeadKind:
    """A draft head trained with the policy: how it is checked, built, trained and saved.

    Attributes:
        name: the head's name, also its directory under run.dir ("eagle3", "mtp").
        draft_vocab: whether the head has its own draft vocabulary (draft.draft_vocab_size).
        inspect: `(draft_spec, model_config, dtype) -> draft vocabulary or None`: the head
            in draft.hf_path checked against the policy (no weights read); ConfigError
            on a mismatch.
        build: `(learner, policy, *, resuming, ref_params, history) -> (head, opt_state or
            None)`: the run's head (loaded, fresh, or abstract when resuming) through the
            `rl.drafting.DraftLearner`.
        update: `(head, opt_state, policy, scored, *, optimizer, loss_cfg) -> (head,
            opt_state, metrics)`: one training update from `rl.steps.score_rollouts`'
            output (online in each RL step, and offline).
        init_offline: `(learner, policy, seed) -> (head, opt_state)`: a new head trained
            offline on the policy's rollouts (scripts/train_draft.py), or None when the
            script does not train this head.
        save: `(head, out_dir, *, policy, layout) -> None`: the head in its serving layout
            (`layout` None: the default one).
        loss_config: `config -> loss settings` passed to `update` as `loss_cfg` (hashable);
            None: the EAGLE-3 / MTP `rl.draft.DraftLossConfig` of draft.ttt_*.
    """

    name: str
    draft_vocab: bool
    inspect: Callable[..., Optional[int]]
    build: Callable[..., tuple[Any, Any]]
    update: Callable[..., tuple[Any, Any, dict]]
    init_offline: Optional[Callable[..., tuple[Any, Any]]]
    save: Callable[..., None]
    loss_config: Optional[Callable[[Any], Any]] = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class DraftKind(KindRules):
    """One `draft.kind`: its config rules (`draft_kinds.KindRules`: name, headroom, deepest,
    takes_tree, adaptive, rejection, check, no_tree) and the trainer's parts.

    Attributes:
        make_drafter: `(draft_spec, tree, *, head, draft_model, history, groups,
            prompt_keys) -> Drafter`: the drafter for one generate call (see
            `rl.rollouts.make_drafter`).
        head: the head it drafts with and trains online, or None.
        draft_model: whether it drafts with a small model (draft.model or draft.hf_path).
        history: whether it keeps a `HistoryStore` of earlier rollouts (checkpointed).
    """

    make_drafter: Callable[..., Any]
    head: Optional[HeadKind] = None
    draft_model: bool = False
    history: bool = False

    @classmethod
    def of(cls, name: str, **parts) -> DraftKind:
        """The built-in kind `name`: its registered rules plus the trainer's `parts`."""
        rules = RULES[name]
        return cls(**{f.name: getattr(rules, f.name) for f in dataclasses.fields(rules)},
                   **parts)


KINDS: dict[str, DraftKind] = {}


def register(kind: DraftKind) -> DraftKind:
    """Add `kind` to KINDS and its rules to `draft_kinds.RULES` (which the config checks)
    under its name, replacing one of the same name.

    Returns:
        The kind, so `register` can wrap a definition.
    """
    KINDS[kind.name] = kind
    draft_kinds.register_rules(kind)
    return kind


# ----------------------------------------------------------------------------- shared parts

def _history_drafter(d, tree=None, *, history, groups, prompt_keys, **_):
    """Kind history's drafter (and the hybrid's history part); without groups a one-row
    drafter (for its static sizes)."""
    return history_lib.HistoryDrafter.for_batch(
        [0] if groups is None else groups, store=history,
        prompt_keys=None if groups is None else prompt_keys,
        **d.history.drafter_settings(d.k))


# ----------------------------------------------------------------------------- heads

def _inspect_eagle3(d, model_config, dtype: str) -> int:
    from jaxspec.rl.plan import inspect_head

    return inspect_head(d, model_config, dtype).draft_vocab_size


def _build_eagle3(learner, policy, *, resuming, ref_params, history):
    return learner.build_head(policy, resuming=resuming, ref_params=ref_params, history=history)


def _update_eagle3(*args, **kwargs):
    from jaxspec.rl.steps import draft_update

    return draft_update(*args, **kwargs)


def _save_eagle3(head, out_dir: str, *, policy, layout=None) -> None:
    from jaxspec.models.eagle3 import save_eagle3

    save_eagle3(head, out_dir)


EAGLE3_HEAD = HeadKind(
    name="eagle3", draft_vocab=True, inspect=_inspect_eagle3, build=_build_eagle3,
    update=_update_eagle3, init_offline=lambda learner, policy, seed: learner.build_head(policy, resuming=False),
    save=_save_eagle3)


def _inspect_mtp(d, model_config, dtype: str) -> None:
    from jaxspec.rl.plan import inspect_mtp

    inspect_mtp(d.hf_path, model_config)


def _update_mtp(*args, **kwargs):
    from jaxspec.rl.steps import mtp_update

    return mtp_update(*args, **kwargs)


def _init_mtp(learner, policy, seed: int):
    import jax

    key = jax.random.fold_in(jax.random.key(seed), 1)  # the trainer's head key
    return learner.init_mtp_head(policy, key)


def _save_mtp(head, out_dir: str, *, policy, layout=None) -> None:
    from jaxspec.models.mtp import save_mtp

    layout = layout or "deepseek_v3"  # DeepSeek-V3's layout keeps the policy's shared tensors
    save_mtp(head, out_dir, layout=layout, policy=policy if layout == "deepseek_v3" else None)


MTP_HEAD = HeadKind(
    name="mtp", draft_vocab=False, inspect=_inspect_mtp,
    build=lambda learner, policy, *, resuming, **_: learner.build_mtp_head(
        policy, resuming=resuming),
    update=_update_mtp, init_offline=_init_mtp, save=_save_mtp)


# block (DFlash / DSpark): jaxspec.models.block, jaxspec.rl.block_train

def _block_head(d, policy, key):
    """A fresh block model of the `draft.block` section's shape."""
    from jaxspec.models.block import BlockHead

    b = d.block
    return BlockHead.init_for(policy, key, block_size=b.size, num_layers=b.layers,
                              capture_layers=b.capture, mask_token_id=b.mask_token_id,
                              markov_rank=b.markov_rank, confidence=b.confidence)


def _build_block(learner, policy, *, resuming, ref_params=None, history=None):
    """Loaded from draft.hf_path (the DFlash layout), the shapes a checkpoint restores into
    (resuming), or fresh and trained offline (warmup.draft_steps) on the policy's rollouts."""
    import jax

    cfg = learner.cfg
    key = jax.random.fold_in(jax.random.key(cfg.run.seed), 1)  # the trainer's head key
    if cfg.draft.hf_path is not None:
        from jaxspec.models.block_formats import load_dflash

        head = load_dflash(cfg.draft.hf_path, dtype=cfg.model.dtype,
                           attention_backend=cfg.model.attention_backend)
        head.check_compatible(policy)
        return head, None
    if resuming:
        return jax.eval_shape(lambda: _block_head(cfg.draft, policy, key)), None
    return learner.train_fresh(policy, _block_head(cfg.draft, policy, key), key,
                               ref_params=ref_params, history=history)


def _update_block(*args, **kwargs):
    from jaxspec.rl.block_train import block_update

    return block_update(*args, **kwargs)


def _block_loss_config(cfg):
    from jaxspec.rl.block_train import BlockLossConfig

    b = cfg.draft.block
    return BlockLossConfig(anchors=b.anchors, gamma=b.gamma, tv=b.tv, confidence=b.confidence_weight)


def _save_block(head, out_dir: str, *, policy, layout=None) -> None:
    from jaxspec.models.block_formats import save_block

    save_block(head, out_dir, policy=policy)  # DFlash's layout, or DSpark's for its slots


def _inspect_block(d, model_config, dtype: str) -> None:
    from jaxspec.models.block_formats import inspect_dflash

    inspect_dflash(d.hf_path, model_config)


BLOCK_HEAD = HeadKind(
    name="block", draft_vocab=False, inspect=_inspect_block, build=_build_block,
    update=_update_block,
    init_offline=lambda learner, policy, seed: _build_block(learner, policy, resuming=False),
    save=_save_block, loss_config=_block_loss_config)


# ----------------------------------------------------------------------------- kinds
# The built-in kinds: their rules from jaxspec.draft_kinds, the trainer's parts here.

register(DraftKind.of("none", make_drafter=lambda d, tree, **_: drafters_lib.NoDrafter()))

register(DraftKind.of(
    "eagle3",
    make_drafter=lambda d, tree, *, head, **_: drafters_lib.Eagle3Drafter(
        head, k=d.k, tree=tree, coupled=d.coupled),
    head=EAGLE3_HEAD))

def _mtp_drafter(d, tree, *, head, **_):
    """MTPDrafter, or for a Qwen3.5 / Qwen3-Next head (jaxspec.models.hybrid_mtp) its own,
    which puts the captured last layer through the policy's final norm."""
    from jaxspec.models.hybrid_mtp import HybridMTPDrafter, HybridMTPHead

    make = HybridMTPDrafter if isinstance(head, HybridMTPHead) else drafters_lib.MTPDrafter
    return make(head, k=d.k, tree=tree, coupled=d.coupled)


register(DraftKind.of("mtp", make_drafter=_mtp_drafter, head=MTP_HEAD))

register(DraftKind.of(
    "draft_model",
    make_drafter=lambda d, tree, *, draft_model, **_: drafters_lib.DraftModelDrafter(
        draft_model, k=d.k, coupled=d.coupled),
    draft_model=True))

register(DraftKind.of(
    "ngram",
    make_drafter=lambda d, tree, **_: drafters_lib.NGramDrafter(
        k=d.k, min_n=d.ngram.min_n, max_n=d.ngram.max_n)))

register(DraftKind.of("history", make_drafter=_history_drafter, history=True))


def _hybrid_drafter(d, tree, *, head, history, groups, prompt_keys, **_):
    chain = drafters_lib.Eagle3Drafter(head, k=d.k, coupled=d.coupled)
    return history_lib.HybridDrafter(
        _history_drafter(d, history=history, groups=groups, prompt_keys=prompt_keys), chain,
        budget=d.history.budget, gate=d.history.gate_head)


register(DraftKind.of("hybrid", make_drafter=_hybrid_drafter, head=EAGLE3_HEAD, history=True))


def _block_drafter(d, tree, *, head, **_):
    from jaxspec.decoding.block import BlockDrafter

    return BlockDrafter(head, k=d.k, coupled=d.coupled,
                        confidence_length=d.block.confidence_length and d.adaptive_k)


register(DraftKind.of("block", make_drafter=_block_drafter, head=BLOCK_HEAD))


def _hybrid_block_drafter(d, tree, *, head, history, groups, prompt_keys, **_):
    return history_lib.HybridDrafter(
        _history_drafter(d, history=history, groups=groups, prompt_keys=prompt_keys),
        _block_drafter(d, None, head=head), budget=d.history.budget, gate=d.history.gate_head)


register(DraftKind.of("hybrid_block", make_drafter=_hybrid_block_drafter, head=BLOCK_HEAD,
                      history=True))
