"""The drafter kinds of the RL side (`draft.kind`), registered by name in one place.

A `DraftKind` says everything the trainer needs about a kind: how its `draft:` section is
checked, the cache headroom a verify step needs, the longest chain it can have accepted,
how its drafter is built, and, through its `HeadKind`, whether it trains a head and how that
head is checked on disk, built, trained offline and exported. The config, the run plan, the
rollout worker, the trainer and scripts/train_draft.py look the kind up here, so a new kind
is one `register` call (see `tests/rl/test_kinds.py` for a test-only kind).

Modules of the trainer (plan, drafting, model savers) are imported inside the functions
that use them: the config imports this module while it loads.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Callable, Optional

from jaxspec.decoding import drafters as drafters_lib
from jaxspec.decoding import history as history_lib
from jaxspec.errors import ConfigError

__all__ = ["DraftKind", "HeadKind", "KINDS", "check_draft", "register"]


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


@dataclasses.dataclass(frozen=True)
class DraftKind:
    """One `draft.kind`.

    Attributes:
        name: the config's `draft.kind`.
        make_drafter: `(draft_spec, tree, *, head, draft_model, history, groups,
            prompt_keys) -> Drafter`: the drafter for one generate call (see
            `rl.rollouts.make_drafter`).
        headroom: `draft_spec -> int`: the draft nodes fed to one verify step (the cache
            needs these + 1 slots past the committed tokens).
        deepest: `draft_spec -> (depth, how the config names it)`: the longest draft
            chain, so a verify accepts at most depth + 1 tokens; None: the kind never
            drafts.
        takes_tree: whether draft.tree applies.
        adaptive: whether draft.adaptive_k may choose the chain length (chain drafts).
        check: `draft_spec -> None`: the kind's own checks of the `draft:` section
            (ConfigError with keys relative to it), or None.
        head: the head it drafts with and trains online, or None.
        draft_model: whether it drafts with a small model (draft.model or draft.hf_path).
        history: whether it keeps a `HistoryStore` of earlier rollouts (checkpointed).
        no_tree: why draft.tree does not apply, for the error message.
    """

    name: str
    make_drafter: Callable[..., Any]
    headroom: Callable[[Any], int]
    deepest: Optional[Callable[[Any], tuple[int, str]]]
    takes_tree: bool = False
    adaptive: bool = False
    check: Optional[Callable[[Any], None]] = None
    head: Optional[HeadKind] = None
    draft_model: bool = False
    history: bool = False
    no_tree: str = ""


KINDS: dict[str, DraftKind] = {}


def register(kind: DraftKind) -> DraftKind:
    """Add `kind` to KINDS under its name (replacing one of the same name).

    Returns:
        The kind, so `register` can wrap a definition.
    """
    KINDS[kind.name] = kind
    return kind


def check_draft(d) -> None:
    """The checks of a `draft:` section (config.DraftSpec) that depend on its kind.

    Raises:
        ConfigError: the first problem, its key relative to the `draft:` section.
    """
    kind = KINDS.get(d.kind)
    if kind is None:
        close = difflib.get_close_matches(str(d.kind), list(KINDS), n=1)
        raise ConfigError("kind", d.kind, "not a valid choice" + (
            f" (did you mean '{close[0]}'?)" if close else ""),
            "one of " + ", ".join(repr(n) for n in KINDS))
    if d.tree is not None and not kind.takes_tree:
        raise ConfigError("tree", dataclasses.asdict(d.tree),
                          f"draft kind '{d.kind}' does not take draft.tree" + kind.no_tree,
                          "null, or kind " + " / ".join(n for n, k in KINDS.items()
                                                        if k.takes_tree))
    if kind.check is not None:
        kind.check(d)
    if d.adaptive_k and (not kind.adaptive or d.tree is not None):
        raise ConfigError("adaptive_k", True,
                          f"adaptive draft length needs chain drafts; draft kind "
                          f"'{d.kind}'" + (" with draft.tree" if d.tree is not None else "")
                          + " has none", "false, or kind " + " / ".join(
                              n for n, k in KINDS.items() if k.adaptive) + " without draft.tree")
    if kind.deepest is not None:  # a verify step accepts at most depth + 1 tokens
        depth, what = kind.deepest(d)
        most = depth + 1
        if d.collapse_threshold > most:
            raise ConfigError("collapse_threshold", d.collapse_threshold,
                              f"above the longest possible acceptance ({what} + 1 = {most}),"
                              f" so the alarm would never clear", f"a number in [1, {most}]")


# ----------------------------------------------------------------------------- shared parts

def _chain_nodes(d) -> int:  # a chain of k, or the tree's verified nodes
    return d.tree.budget if d.tree is not None else d.k


def _chain_depth(d) -> tuple[int, str]:
    return (d.tree.depth, "draft.tree.depth") if d.tree is not None else (d.k, "draft.k")


def _history_drafter(d, tree=None, *, history, groups, prompt_keys, **_):
    """Kind history's drafter (and the hybrid's history part); without groups a one-row
    drafter (for its static sizes)."""
    return history_lib.HistoryDrafter.for_batch(
        [0] if groups is None else groups, store=history,
        prompt_keys=None if groups is None else prompt_keys,
        **d.history.drafter_settings(d.k))


def _check_history(d, depth: int) -> None:
    try:
        d.history.check(depth)
    except ConfigError as e:
        raise e.under("history") from None


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
    from jaxspec.models.block_formats import save_dflash

    save_dflash(head, out_dir, num_target_layers=policy.config.num_layers)


def _inspect_block(d, model_config, dtype: str) -> None:
    from jaxspec.models.block_formats import inspect_dflash

    inspect_dflash(d.hf_path, model_config)


BLOCK_HEAD = HeadKind(
    name="block", draft_vocab=False, inspect=_inspect_block, build=_build_block,
    update=_update_block,
    init_offline=lambda learner, policy, seed: _build_block(learner, policy, resuming=False),
    save=_save_block, loss_config=_block_loss_config)


def _check_block(d) -> None:
    most = d.block.size - 1
    if d.k > most:
        raise ConfigError("k", d.k, f"a block of draft.block.size={d.block.size} drafts "
                          f"{most} tokens", f"an int in [1, {most}] (or a larger draft.block.size)")


# ----------------------------------------------------------------------------- kinds

register(DraftKind(
    name="none", make_drafter=lambda d, tree, **_: drafters_lib.NoDrafter(),
    headroom=lambda d: 0, deepest=None))

register(DraftKind(
    name="eagle3",
    make_drafter=lambda d, tree, *, head, **_: drafters_lib.Eagle3Drafter(
        head, k=d.k, tree=tree, coupled=d.coupled),
    headroom=_chain_nodes, deepest=_chain_depth, takes_tree=True, adaptive=True,
    head=EAGLE3_HEAD))

register(DraftKind(
    name="mtp",
    make_drafter=lambda d, tree, *, head, **_: drafters_lib.MTPDrafter(
        head, k=d.k, tree=tree, coupled=d.coupled),
    headroom=_chain_nodes, deepest=_chain_depth, takes_tree=True, adaptive=True,
    head=MTP_HEAD))


def _check_draft_model(d) -> None:
    if d.model is None and d.hf_path is None:
        raise ConfigError("model", None, "kind 'draft_model' needs a model",
                          "a model spec (draft.model.*) or draft.hf_path")


register(DraftKind(
    name="draft_model",
    make_drafter=lambda d, tree, *, draft_model, **_: drafters_lib.DraftModelDrafter(
        draft_model, k=d.k, coupled=d.coupled),
    headroom=_chain_nodes, deepest=_chain_depth, takes_tree=True, adaptive=True,
    check=_check_draft_model, draft_model=True))

register(DraftKind(
    name="ngram",
    make_drafter=lambda d, tree, **_: drafters_lib.NGramDrafter(
        k=d.k, min_n=d.ngram.min_n, max_n=d.ngram.max_n),
    headroom=lambda d: d.k, deepest=lambda d: (d.k, "draft.k"), adaptive=True))


def _history_depth(d) -> tuple[int, str]:
    return d.history.depth or d.k, "draft.history.depth (or draft.k)"


register(DraftKind(
    name="history",
    make_drafter=_history_drafter,
    headroom=lambda d: d.history.budget, deepest=_history_depth,
    check=lambda d: _check_history(d, d.history.depth or d.k), history=True,
    no_tree=" (its tree is draft.history.budget nodes)"))


def _hybrid_depth(d) -> tuple[int, str]:
    return max(d.k, d.history.depth or d.k), "the deeper of draft.k and draft.history.depth"


def _hybrid_drafter(d, tree, *, head, history, groups, prompt_keys, **_):
    chain = drafters_lib.Eagle3Drafter(head, k=d.k, coupled=d.coupled)
    return history_lib.HybridDrafter(
        _history_drafter(d, history=history, groups=groups, prompt_keys=prompt_keys), chain,
        budget=d.history.budget, gate=d.history.gate_head)


register(DraftKind(
    name="hybrid", make_drafter=_hybrid_drafter,
    headroom=lambda d: d.history.budget, deepest=_hybrid_depth,
    check=lambda d: _check_history(d, _hybrid_depth(d)[0]), head=EAGLE3_HEAD, history=True,
    no_tree=" (its tree is draft.history.budget nodes)"))


def _block_drafter(d, tree, *, head, **_):
    from jaxspec.decoding.block import BlockDrafter

    return BlockDrafter(head, k=d.k, coupled=d.coupled,
                        confidence_length=d.block.confidence_length and d.adaptive_k)


register(DraftKind(
    name="block", make_drafter=_block_drafter,
    headroom=lambda d: d.k, deepest=lambda d: (d.k, "draft.k"), adaptive=True,
    check=_check_block, head=BLOCK_HEAD,
    no_tree=" (a block drafts one chain)"))


def _hybrid_block_drafter(d, tree, *, head, history, groups, prompt_keys, **_):
    return history_lib.HybridDrafter(
        _history_drafter(d, history=history, groups=groups, prompt_keys=prompt_keys),
        _block_drafter(d, None, head=head), budget=d.history.budget, gate=d.history.gate_head)


def _check_hybrid_block(d) -> None:
    _check_block(d)
    _check_history(d, _hybrid_depth(d)[0])


register(DraftKind(
    name="hybrid_block", make_drafter=_hybrid_block_drafter,
    headroom=lambda d: d.history.budget, deepest=_hybrid_depth,
    check=_check_hybrid_block, head=BLOCK_HEAD, history=True,
    no_tree=" (its tree is draft.history.budget nodes)"))
