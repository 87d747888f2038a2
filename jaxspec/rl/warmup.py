"""Supervised warm-up: the tiny 'base' policy, and the in-domain initialisation of a draft.

The embedded default starts from a random tiny transformer. A short cross-entropy
training on the task's supervised pairs (`Task.supervised_examples`, a stream separate
from the RL prompts) turns it into an imperfect base policy that GRPO can improve. The
EAGLE-3 head is then initialised in-domain, as the paper recommends: the warmed-up policy
samples rollouts, the draft vocabulary is chosen from their token counts, and the head is
trained offline on the policy's own features and distributions with the same TTT update
the RL step uses online.

Nothing is written to disk here; the trainer checkpoints the results under run.dir.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxspec.config import OptimSpec
from jaxspec.decoding.engine import generate
from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.models import Policy
from jaxspec.models.eagle3 import Eagle3Head, choose_draft_vocab
from jaxspec.rl.steps import make_optimizer

__all__ = [
    "DraftCorpus",
    "draft_corpus",
    "encode_pairs",
    "init_eagle3_head",
    "pack_sequences",
    "supervised_warmup",
]


def encode_pairs(
    tokenizer,
    pairs: Sequence[tuple[str, str]],
    seq_len: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:  # (tokens [N, T] int32, loss_mask [N, T] bool)
    """Prompt (`encode_prompt`: BOS + text, or the chat template) + completion + EOS per
    pair, right-padded with PAD to `seq_len` (default: the longest). loss_mask[n, t] is true
    where position t predicts a completion token or the EOS (the next-token convention of
    `Policy.forward`'s logits)."""
    rows, starts = [], []
    for prompt, completion in pairs:
        head = tokenizer.encode_prompt(prompt)  # as rollouts see it (chat template)
        rows.append(head + tokenizer.encode(completion, eos=True))
        starts.append(len(head))
    width = max(len(r) for r in rows) if seq_len is None else seq_len
    if rows and max(len(r) for r in rows) > width:
        raise ValueError(f"a supervised pair needs {max(len(r) for r in rows)} tokens; "
                         f"seq_len is {width}")
    tokens = np.full((len(rows), width), tokenizer.pad_id, np.int32)
    mask = np.zeros((len(rows), width), bool)
    for i, (r, s) in enumerate(zip(rows, starts, strict=True)):
        tokens[i, :len(r)] = r
        mask[i, s - 1:len(r) - 1] = True
    return tokens, mask


def _token_nll(policy, tokens, mask, segments=None):
    """Mean NLL of the masked tokens of tokens [B, T] (mask [B, T]). segments [B, T] int32:
    packed rows, several sequences per row (-1 = padding); each token sees only the earlier
    tokens of its own segment, at positions counted from the segment's start."""
    if segments is None:
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        logits, _, _ = policy.forward(tokens, positions)
    else:
        t = tokens.shape[1]
        same = segments[:, :, None] == segments[:, None, :]  # [B, T, T]
        attend = same & jnp.tril(jnp.ones((t, t), bool))[None]
        positions = jnp.sum(attend, axis=-1).astype(jnp.int32) - 1  # index in the segment
        logits, _, _ = policy.forward(tokens, positions, mask=attend)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, jnp.roll(tokens, -1, axis=1)[..., None], axis=-1)[..., 0]
    return jnp.sum(jnp.where(mask, nll, 0.0)) / jnp.maximum(jnp.sum(mask), 1)


@functools.partial(jax.jit, static_argnames=("optimizer",))
def _warmup_scan(policy, opt_state, tokens, mask, segments, optimizer):
    """Warm-up steps in one program: tokens/mask/segments [steps, rows, T] (segments None:
    one sequence per row). Returns (policy, opt_state, losses [steps])."""

    def body(carry, batch):
        params, opt_state = carry
        loss, grads = jax.value_and_grad(
            lambda p: _token_nll(policy.replace(params=p), *batch))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    xs = (tokens, mask) if segments is None else (tokens, mask, segments)
    (params, opt_state), losses = jax.lax.scan(body, (policy.params, opt_state), xs)
    return policy.replace(params=params), opt_state, losses


def _chunk_steps(steps: int, most: int) -> int:
    """The largest divisor of `steps` that is at most `most`: every chunk of the warm-up
    has the same length, so one program compiles for all of them."""
    return max(d for d in range(1, min(steps, most) + 1) if steps % d == 0)


def pack_sequences(
    tokens,  # [steps, batch, T] int32 right-padded sequences
    loss_mask,  # [steps, batch, T] bool (encode_pairs' convention)
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # tokens, loss_mask, segments [steps, R, T]
    """Each step's sequences packed first-fit (longest first) into R rows of width T, R the
    most rows any step needs; segments numbers the sequences of a row (-1 = padding). The
    loss over the packed rows equals the padded one: the same tokens, each seeing only its
    own sequence (`_token_nll`)."""
    steps, batch, width = tokens.shape
    # a sequence ends one past the EOS, the token after the last masked position
    ends = np.where(loss_mask.any(-1), width - np.argmax(loss_mask[..., ::-1], axis=-1) + 1, 0)
    plans = []
    for s in range(steps):
        rows: list[list[int]] = []  # sequences per row
        room: list[int] = []
        for i in sorted(range(batch), key=lambda i: -ends[s, i]):
            r = next((r for r, free in enumerate(room) if free >= ends[s, i]), None)
            if r is None:
                rows.append([])
                room.append(width)
                r = len(rows) - 1
            rows[r].append(i)
            room[r] -= ends[s, i]
        plans.append(rows)
    n_rows = max(len(rows) for rows in plans)
    out_t = np.zeros((steps, n_rows, width), np.int32)
    out_m = np.zeros((steps, n_rows, width), bool)
    out_s = np.full((steps, n_rows, width), -1, np.int32)
    for s, rows in enumerate(plans):
        for r, members in enumerate(rows):
            at = 0
            for seg, i in enumerate(members):
                n = ends[s, i]
                out_t[s, r, at:at + n] = tokens[s, i, :n]
                out_m[s, r, at:at + n] = loss_mask[s, i, :n]
                out_s[s, r, at:at + n] = seg
                at += n
    return out_t, out_m, out_s


def supervised_warmup(
    policy: Policy,
    tokens,  # [steps * batch_size, T] int32 supervised sequences (from encode_pairs)
    loss_mask,  # [steps * batch_size, T] bool
    *,
    steps: int,
    batch_size: int,
    lr: float,
    chunk: int = 5,
    progress: Callable[[int, np.ndarray], None] | None = None,
) -> tuple[Policy, np.ndarray]:  # (warmed-up policy, per-step loss [steps])
    """Cross-entropy training with AdamW (constant lr, global-norm clip 1), one batch per
    step in the given order. The steps run as a jitted scan over chunks of at most `chunk`
    steps (the same program each time); `progress(steps done, the chunk's losses)` is called
    after each chunk: the first call includes the compile. Where a step's sequences fit in
    fewer rows packed (long-tailed lengths), they are packed (`pack_sequences`), except for
    a hybrid policy (one sequence per row)."""
    tokens = np.asarray(tokens, np.int32)
    loss_mask = np.asarray(loss_mask, bool)
    if steps == 0:
        return policy, np.zeros((0,), np.float32)
    if tokens.shape[0] != steps * batch_size or loss_mask.shape != tokens.shape:
        raise ValueError(f"supervised_warmup needs {steps} x {batch_size} sequences; got tokens "
                         f"{tokens.shape} and loss_mask {loss_mask.shape}")
    optimizer = make_optimizer(OptimSpec(lr=lr, weight_decay=1e-4, b1=0.9, b2=0.999, eps=1e-8,
                                         clip_norm=1.0, warmup_steps=0))
    opt_state = optimizer.init(policy.params)
    shape = (steps, batch_size, tokens.shape[1])
    tokens, loss_mask, segments = tokens.reshape(shape), loss_mask.reshape(shape), None
    packed = pack_sequences(tokens, loss_mask)
    # short sequences share rows: fewer rows to run; not for a hybrid policy, whose linear
    # layers would carry one sequence's recurrent state into the next (it takes no mask)
    if packed[0].shape[1] < batch_size and not policy.config.is_hybrid:
        tokens, loss_mask, segments = packed
    n, losses = _chunk_steps(steps, chunk), []
    for start in range(0, steps, n):
        part = slice(start, start + n)
        policy, opt_state, loss = _warmup_scan(
            policy, opt_state, jnp.asarray(tokens[part]), jnp.asarray(loss_mask[part]),
            None if segments is None else jnp.asarray(segments[part]), optimizer)
        losses.append(np.asarray(loss))  # waits for the chunk
        if progress is not None:
            progress(start + n, losses[-1])
    return policy, np.concatenate(losses)


@dataclasses.dataclass(frozen=True)
class DraftCorpus:
    """The warmed-up policy's own rollouts, batch by batch, and their token counts."""

    batches: list  # of (prompts [B,P], prompt_lengths [B], tokens [B,N], lengths [B], logprobs [B,N])
    token_counts: np.ndarray  # [V] completion-token counts (the draft vocabulary's choice)


def draft_corpus(
    policy: Policy,
    prompts,  # [N, P] int32 right-padded prompt tokens
    prompt_lengths,  # [N] int32
    *,
    batch_size: int,
    max_new_tokens: int,
    sampling: SamplingConfig,
    stop_tokens: Sequence[int],
    key: jax.Array,
    pad_id: int = 0,
    generate_fn: Callable = generate,
    progress: Callable[[int], None] | None = None,
) -> DraftCorpus:
    """The policy's rollouts of `prompts` in batches of `batch_size` rows (the last one
    filled up by repeating rows, so every call has the RL step's compiled shapes), with the
    completion-token counts per target id. `generate_fn` is `generate` or a wrapper with its
    signature (the trainer's places the call on the generation devices); `progress(rollouts
    done)` is called after each batch."""
    prompts = np.asarray(prompts, np.int32)
    prompt_lengths = np.asarray(prompt_lengths, np.int32)
    n = prompts.shape[0]
    if n == 0:
        raise ValueError("draft_corpus needs at least one prompt")
    counts = np.zeros((policy.config.vocab_size,), np.int64)
    batches = []
    for start in range(0, n, batch_size):
        idx = np.arange(start, start + batch_size) % n
        out = generate_fn(policy, (prompts[idx], prompt_lengths[idx]), sampling=sampling,
                          max_new_tokens=max_new_tokens, key=jax.random.fold_in(key, start),
                          stop_tokens=tuple(stop_tokens), rows=np.asarray(idx, np.int32),
                          pad_id=pad_id)
        tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
        for j in range(min(batch_size, n - start)):
            np.add.at(counts, tokens[j, :lengths[j]], 1)
        batches.append((prompts[idx], prompt_lengths[idx], tokens, lengths,
                        np.asarray(out.logprobs)))
        if progress is not None:
            progress(min(start + batch_size, n))
    return DraftCorpus(batches, counts)


def init_eagle3_head(
    policy: Policy,
    corpus: DraftCorpus,
    *,
    draft_vocab_size: int,
    key: jax.Array,
    steps: int,
    opt_state_init: Callable,
    train_step: Callable,
    capture_layers: Sequence[int] | None = None,
) -> tuple[Eagle3Head, Any, list[dict]]:
    """A fresh EAGLE-3 head over the `draft_vocab_size` most frequent completion tokens of
    the corpus, trained `steps` offline steps on it, cycling through its batches.

    `train_step(head, opt_state, batch) -> (head, opt_state, metrics)` is the draft update
    (the trainer passes its online update, so offline and online training share one
    compiled program); `opt_state_init(params)` makes its optimizer state.
    Returns (head, optimizer state, per-step metrics)."""
    head = jax.jit(functools.partial(Eagle3Head.init_for, policy, draft_vocab_size,
                                     capture_layers=capture_layers))(key)
    head = head.with_vocab(choose_draft_vocab(corpus.token_counts, draft_vocab_size))
    opt_state = opt_state_init(head.params)
    history = []
    for step in range(steps):
        head, opt_state, metrics = train_step(head, opt_state,
                                              corpus.batches[step % len(corpus.batches)])
        history.append({k: float(v) for k, v in metrics.items()})
    return head, opt_state, history
