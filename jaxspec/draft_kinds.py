"""What the config checks about a drafter kind (`draft.kind`), below both the config and `rl`.

A `KindRules` says how a kind's `draft:` section is validated and sized: its own checks, the
cache headroom a verify step needs, the longest chain it can have accepted, whether it takes
`draft.tree`, adaptive length, or rejection sampling. `jaxspec.config` validates with it;
`jaxspec.rl.kinds.DraftKind` extends it with how the trainer builds, trains and saves the
kind, and `rl.kinds.register` files a kind in both registries. Imports nothing above the
decoding library, so `import jaxspec.config` does not import `jaxspec.rl`.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Callable, Optional

from jaxspec.decoding.block import BlockDrafter
from jaxspec.decoding.drafters import DraftModelDrafter, NGramDrafter, NoDrafter
from jaxspec.decoding.history import HistoryDrafter, HybridDrafter
from jaxspec.errors import ConfigError

__all__ = ["KindRules", "RULES", "check_draft", "check_rejection", "headroom", "register_rules"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class KindRules:
    """How one `draft.kind`'s section is checked and sized (the config's part of a kind).

    Attributes:
        name: the config's `draft.kind`.
        headroom: `draft_spec -> int`: the draft nodes fed to one verify step (the cache
            needs these + 1 slots past the committed tokens).
        deepest: `draft_spec -> (depth, how the config names it)`: the longest draft
            chain, so a verify accepts at most depth + 1 tokens; None: the kind never
            drafts.
        takes_tree: whether draft.tree applies.
        adaptive: whether draft.adaptive_k may choose the chain length (chain drafts).
        rejection: whether its chain drafts come with their probabilities, as
            rollout.method=rejection needs (the drafter's `supports_rejection`).
        check: `draft_spec -> None`: the kind's own checks of the `draft:` section
            (ConfigError with keys relative to it), or None.
        no_tree: why draft.tree does not apply, for the error message.
    """

    name: str
    headroom: Callable[[Any], int]
    deepest: Optional[Callable[[Any], tuple[int, str]]]
    takes_tree: bool = False
    adaptive: bool = False
    rejection: bool = False
    check: Optional[Callable[[Any], None]] = None
    no_tree: str = ""


RULES: dict[str, KindRules] = {}


def register_rules(rules: KindRules) -> KindRules:
    """Add `rules` to RULES under its name (replacing one of the same name)."""
    RULES[rules.name] = rules
    return rules


def check_draft(d) -> None:
    """The checks of a `draft:` section (config.DraftSpec) that depend on its kind.

    Raises:
        ConfigError: the first problem, its key relative to the `draft:` section.
    """
    kind = RULES.get(d.kind)
    if kind is None:
        close = difflib.get_close_matches(str(d.kind), list(RULES), n=1)
        raise ConfigError("kind", d.kind, "not a valid choice" + (
            f" (did you mean '{close[0]}'?)" if close else ""),
            "one of " + ", ".join(repr(n) for n in RULES))
    if d.tree is not None and not kind.takes_tree:
        raise ConfigError("tree", dataclasses.asdict(d.tree),
                          f"draft kind '{d.kind}' does not take draft.tree" + kind.no_tree,
                          "null, or kind " + " / ".join(n for n, k in RULES.items()
                                                        if k.takes_tree))
    if kind.check is not None:
        kind.check(d)
    if d.adaptive_k and (not kind.adaptive or d.tree is not None):
        raise ConfigError("adaptive_k", True,
                          f"adaptive draft length needs chain drafts; draft kind "
                          f"'{d.kind}'" + (" with draft.tree" if d.tree is not None else "")
                          + " has none", "false, or kind " + " / ".join(
                              n for n, k in RULES.items() if k.adaptive) + " without draft.tree")
    if kind.deepest is not None:  # a verify step accepts at most depth + 1 tokens
        depth, what = kind.deepest(d)
        most = depth + 1
        if d.collapse_threshold > most:
            raise ConfigError("collapse_threshold", d.collapse_threshold,
                              f"above the longest possible acceptance ({what} + 1 = {most}),"
                              f" so the alarm would never clear", f"a number in [1, {most}]")


def check_rejection(d) -> None:
    """rollout.method=rejection against the `draft:` section: chains drawn with their
    probabilities (no tree, a kind whose drafter provides them).

    Raises:
        ConfigError: on rollout.method, naming the draft setting that rules it out.
    """
    if d.tree is not None:
        raise ConfigError("rollout.method", "rejection",
                          "the rejection rule verifies sampled chains, not trees",
                          "'replay' or 'greedy', or draft.tree=null")
    if not RULES[d.kind].rejection:
        raise ConfigError("rollout.method", "rejection",
                          f"draft kind '{d.kind}' does not draw its drafts with their "
                          f"probabilities, which the rejection rule needs",
                          "'replay' (lossless for any draft), or draft.kind " + " / ".join(
                              n for n, k in RULES.items() if k.rejection))


def headroom(d) -> int:
    """Cache slots a verify step needs beyond the committed tokens: the fed draft nodes + 1."""
    return RULES[d.kind].headroom(d) + 1


# ----------------------------------------------------------------------------- shared parts

def _chain_nodes(d) -> int:
    """A chain of draft.k, or the tree's verified nodes."""
    return d.tree.budget if d.tree is not None else d.k


def _chain_depth(d) -> tuple[int, str]:
    return (d.tree.depth, "draft.tree.depth") if d.tree is not None else (d.k, "draft.k")


def _check_history(d, depth: int) -> None:
    try:
        d.history.check(depth)
    except ConfigError as e:
        raise e.under("history") from None


def _history_depth(d) -> tuple[int, str]:
    return d.history.depth or d.k, "draft.history.depth (or draft.k)"


def _hybrid_depth(d) -> tuple[int, str]:
    return max(d.k, d.history.depth or d.k), "the deeper of draft.k and draft.history.depth"


def _check_block(d) -> None:
    most = d.block.size - 1
    if d.k > most:
        raise ConfigError("k", d.k, f"a block of draft.block.size={d.block.size} drafts "
                          f"{most} tokens", f"an int in [1, {most}] (or a larger draft.block.size)")


def _check_hybrid_block(d) -> None:
    _check_block(d)
    _check_history(d, _hybrid_depth(d)[0])


def _check_draft_model(d) -> None:
    if d.model is None and d.hf_path is None:
        raise ConfigError("model", None, "kind 'draft_model' needs a model",
                          "a model spec (draft.model.*) or draft.hf_path")


# ----------------------------------------------------------------------------- the built-in kinds
# rejection: the drafter's own `supports_rejection` (for EAGLE-3 and MTP heads: chains, which
# check_rejection requires anyway).

_HISTORY_TREE = " (its tree is draft.history.budget nodes)"
_CHAIN = dict(headroom=_chain_nodes, deepest=_chain_depth, takes_tree=True, adaptive=True,
              rejection=True)

for _rules in [
    KindRules(name="none", headroom=lambda d: 0, deepest=None,
              rejection=NoDrafter.supports_rejection),
    KindRules(name="eagle3", **_CHAIN),
    KindRules(name="mtp", **_CHAIN),
    KindRules(name="draft_model", **dict(_CHAIN, rejection=DraftModelDrafter.supports_rejection),
              check=_check_draft_model),
    KindRules(name="ngram", headroom=lambda d: d.k, deepest=lambda d: (d.k, "draft.k"),
              adaptive=True, rejection=NGramDrafter.supports_rejection),
    KindRules(name="history", headroom=lambda d: d.history.budget, deepest=_history_depth,
              rejection=HistoryDrafter.supports_rejection,
              check=lambda d: _check_history(d, d.history.depth or d.k), no_tree=_HISTORY_TREE),
    KindRules(name="hybrid", headroom=lambda d: d.history.budget, deepest=_hybrid_depth,
              rejection=HybridDrafter.supports_rejection,
              check=lambda d: _check_history(d, _hybrid_depth(d)[0]), no_tree=_HISTORY_TREE),
    KindRules(name="block", headroom=lambda d: d.k, deepest=lambda d: (d.k, "draft.k"),
              adaptive=True, rejection=BlockDrafter.supports_rejection, check=_check_block,
              no_tree=" (a block drafts one chain)"),
    KindRules(name="hybrid_block", headroom=lambda d: d.history.budget, deepest=_hybrid_depth,
              rejection=HybridDrafter.supports_rejection, check=_check_hybrid_block,
              no_tree=_HISTORY_TREE),
]:
    register_rules(_rules)
