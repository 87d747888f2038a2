"""Drafters against independent references: the dynamic tree against a brute-force NumPy
construction of the EAGLE-2/3 rule, the n-gram lookup against a plain-Python search."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.decoding import (
    DraftContext,
    DraftModelDrafter,
    Drafter,
    Eagle3Drafter,
    MTPDrafter,
    NGramDrafter,
    NoDrafter,
    Observation,
    SamplingConfig,
    TreeSpec,
)
from jaxspec.models import ModelConfig, Policy
from jaxspec.models.eagle3 import Eagle3Head
from jaxspec.models.mtp import MTPHead

PROMPTS = np.array([[5, 9, 13, 5, 9, 13], [77, 3, 8, 1, 2, 90]], np.int32)


@pytest.fixture(scope="module")
def policy():
    return Policy.init(ModelConfig.tiny("qwen3", num_layers=2), jax.random.key(0))


@pytest.fixture(scope="module")
def head(policy):
    """A head whose draft distributions are far from uniform (scaled LM head), so the tree's
    choices are decided by clear score gaps, not by rounding."""
    head = Eagle3Head.init_for(policy, 96, jax.random.key(1)).with_vocab(np.arange(96) + 20)
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: x * 150.0 if "lm_head" in jax.tree_util.keystr(p) else x, head.params
    )
    return Eagle3Head(head.config, head.graphdef, params, head.buffers)


def _observed_state(drafter, policy):
    """The drafter's state after the prompt prefill, as the engine builds it."""
    batch, width = PROMPTS.shape
    positions = np.where(np.arange(width) < width - 1, np.arange(width), -1)[None].repeat(batch, 0)
    _, captured, _ = policy.forward(PROMPTS, positions, policy.init_cache(batch, 32),
                                    capture=drafter.capture_layers)
    state = drafter.init_state(policy, batch, 32)
    obs = Observation(jnp.asarray(PROMPTS), jnp.roll(PROMPTS, -1, axis=1), jnp.asarray(positions), captured)
    return drafter.observe(state, policy, obs)


@functools.partial(jax.jit, static_argnames="row")
def _path_logprobs(head, policy, state, path, root_pos, *, row):
    """Log-probs (over target ids) of the child of `path` [d] in row `row`, by feeding the
    path one token at a time through the head's cache, as chain drafting does."""
    cache = jax.tree.map(lambda x: x[row : row + 1] if x.ndim == 1 else x[:, row : row + 1], state.cache)
    hidden = state.last_hidden[row : row + 1]
    for i in range(path.shape[0]):
        out, cache = head.forward(policy.embed(path[None, i : i + 1]), hidden[:, None],
                                  jnp.full((1, 1), root_pos + i, jnp.int32), cache, fuse=False)
        hidden = out[:, 0].astype(jnp.float32)
    logits, ids = head.draft_logits(hidden, policy)
    return jax.nn.log_softmax(logits[0]), ids


def _reference_tree(child_logprobs, spec: TreeSpec) -> set[tuple[int, ...]]:
    """The rule by enumeration, in float64: expand top_k children of every frontier node, keep
    the top_k expansions by cumulative log-prob as the next frontier, return the best
    `budget` of all expanded nodes as token paths."""

    def top_children(path, score):
        logp, ids = child_logprobs(path)
        best = np.argsort(-logp, kind="stable")[: spec.top_k]
        return [(path + (int(ids[i]),), score + float(logp[i])) for i in best]

    frontier = top_children((), 0.0)
    pool = list(frontier)
    for _ in range(1, spec.depth):
        expansions = [child for path, score in frontier for child in top_children(path, score)]
        pool += expansions
        frontier = sorted(expansions, key=lambda c: -c[1])[: spec.top_k]
    chosen = sorted(pool, key=lambda c: (-c[1], len(c[0])))[: spec.budget]
    paths = {path for path, _ in chosen}
    assert all(path[:-1] in paths for path in paths if len(path) > 1)  # ancestors included
    return paths


def _tree_paths(tokens, parents) -> set[tuple[int, ...]]:
    paths = []
    for i, parent in enumerate(parents):
        assert parent < i  # topological order
        paths.append((paths[parent] if parent >= 0 else ()) + (int(tokens[i]),))
    return set(paths)


@pytest.mark.parametrize("spec", [TreeSpec(top_k=3, depth=3, budget=7), TreeSpec(top_k=2, depth=4, budget=8)])
def test_dynamic_tree_is_the_brute_force_choice(policy, head, spec):
    drafter = Eagle3Drafter(head, tree=spec)
    state = _observed_state(drafter, policy)
    lengths = jnp.full((PROMPTS.shape[0],), PROMPTS.shape[1], jnp.int32)
    propose = jax.jit(lambda state, policy, buffer, lengths: drafter.propose(
        state, policy, DraftContext(buffer, lengths, jax.random.key(0), SamplingConfig(), False)))
    tree, draft_probs, _ = propose(state, policy, jnp.asarray(PROMPTS), lengths)
    assert draft_probs is None and tree.tokens.shape == (2, spec.budget)
    for row in range(PROMPTS.shape[0]):
        root_pos = PROMPTS.shape[1] - 1

        def child_logprobs(path, row=row):
            logp, ids = _path_logprobs(head, policy, state, jnp.asarray(path, jnp.int32), root_pos, row=row)
            return np.asarray(logp, np.float64), np.asarray(ids)

        want = _reference_tree(child_logprobs, spec)
        got = _tree_paths(np.asarray(tree.tokens[row]), np.asarray(tree.parents[row]))
        assert got == want, row
        parents, depths = np.asarray(tree.parents[row]), np.asarray(tree.depths[row])
        np.testing.assert_array_equal(depths, [1 if q < 0 else depths[q] + 1 for q in parents])


def _ngram_python(history, k, min_n, max_n):
    """Plain-Python prompt lookup: latest earlier match of the longest suffix n-gram."""
    L = len(history)
    for n in range(max_n, min_n - 1, -1):
        if L < n + 1:
            continue
        suffix = history[L - n :]
        for j in range(L - n - 1, -1, -1):
            if history[j : j + n] == suffix:
                cont = history[j + n : j + n + k]
                return cont + [history[-1]] * (k - len(cont))
    return [history[-1]] * k


@pytest.mark.parametrize("k, min_n, max_n", [(4, 1, 3), (2, 2, 2)])
def test_ngram_lookup_matches_python_search(k, min_n, max_n):
    rng = np.random.default_rng(k)
    width, batch = 24, 32
    buf = rng.integers(0, 4, size=(batch, width)).astype(np.int32)
    lengths = rng.integers(1, width + 1, size=batch).astype(np.int32)
    drafter = NGramDrafter(k=k, min_n=min_n, max_n=max_n)
    ctx = DraftContext(jnp.asarray(buf), jnp.asarray(lengths), jax.random.key(0), SamplingConfig(), False)
    tree, _, _ = drafter.propose(None, None, ctx)
    for b in range(batch):
        want = _ngram_python(buf[b, : lengths[b]].tolist(), k, min_n, max_n)
        assert np.asarray(tree.tokens[b]).tolist() == want, b


def test_every_drafter_satisfies_the_protocol(policy, head):
    drafters = [NoDrafter(), NGramDrafter(), DraftModelDrafter(policy, k=2), Eagle3Drafter(head, k=2),
                MTPDrafter(MTPHead.init_for(policy, jax.random.key(3)), k=2)]
    for d in drafters:
        assert isinstance(d, Drafter), type(d).__name__
        assert d.num_nodes >= d.max_depth  # a tree of depth D has at least D nodes
    assert not isinstance(object(), Drafter)


@pytest.mark.parametrize("spec", [TreeSpec(top_k=3, depth=3, budget=7), TreeSpec(top_k=2, depth=5, budget=9)])
@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
def test_tree_carrying_head_kv_equals_refeeding_every_depth(policy, head, spec, kind):
    """The linear-in-depth tree (each depth feeds only its frontier, ancestors' keys carried)
    proposes the quadratic re-feed's tree node for node."""
    if kind == "mtp":
        drafter = MTPDrafter(MTPHead.init_for(policy, jax.random.key(2)), tree=spec)
    else:
        drafter = Eagle3Drafter(head, tree=spec)
    state = _observed_state(drafter, policy)
    lengths = jnp.full((PROMPTS.shape[0],), PROMPTS.shape[1], jnp.int32)

    def run(method):
        ctx = DraftContext(jnp.asarray(PROMPTS), lengths, jax.random.key(0), SamplingConfig(), False)
        return jax.jit(lambda s: getattr(drafter, method)(s, policy, ctx)[0])(state)

    carried, refed = run("_propose_tree"), run("_propose_tree_refeed")
    for field in ("tokens", "parents", "depths"):
        np.testing.assert_array_equal(getattr(carried, field), getattr(refed, field), err_msg=field)
