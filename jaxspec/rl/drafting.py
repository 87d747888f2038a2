"""Draft initialisation and training: the EAGLE-3 or MTP head built from a warmed-up policy
(in-domain offline initialisation, as the EAGLE-3 paper recommends), and the online update the
RL step runs. `scripts/train_draft.py` uses this part alone."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import jax

from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.metrics import Progress
from jaxspec.models.eagle3 import Eagle3Head, load_eagle3
from jaxspec.rl import faults
from jaxspec.rl.draft import DraftLossConfig
from jaxspec.rl.rollouts import encode_prompts
from jaxspec.models.mtp import MTPHead, load_mtp
from jaxspec.rl.kinds import KINDS
from jaxspec.rl.steps import make_optimizer
from jaxspec.rl.warmup import draft_corpus, init_eagle3_head

__all__ = ["DraftLearner"]


class DraftLearner:
    """Trains the draft kind's head (EAGLE-3 or MTP) on the policy's features with the TTT
    loss and its own optimizer (`draft_optim`): offline from the policy's own rollouts
    (`init_head`, `init_mtp_head`) and online on each RL step's logprob stage (`update`),
    one compiled update for both."""

    def __init__(self, cfg, plan, cluster, sampling: SamplingConfig, *, filtered: bool,
                 log: Callable[[str], None] | None = None):
        self.cfg, self.plan, self.cluster = cfg, plan, cluster
        self.sampling, self.filtered = sampling, filtered
        self.log = log or logging.getLogger("jaxspec.rl").info
        self.optimizer = make_optimizer(cfg.draft_optim)
        head_kind = KINDS[cfg.draft.kind].head
        if head_kind is not None and head_kind.loss_config is not None:
            self.loss_cfg = head_kind.loss_config(cfg)
        else:
            self.loss_cfg = DraftLossConfig(steps=cfg.draft.ttt_steps, decay=cfg.draft.ttt_decay,
                                            chunk=cfg.grpo.logprob_chunk,
                                            micro_batch=cfg.grpo.micro_batch)

    def init_state(self, head):
        """A fresh optimizer state for the head's params."""
        return self.optimizer.init(head.params)

    def update(self, head, opt_state, policy, scored: dict):
        """One update of the draft kind's head (`HeadKind.update`); run it inside
        `cluster.training()`.

        Args:
            head: the head being trained (EAGLE-3 or MTP, as the kind says).
            opt_state: its optimizer state.
            policy: the policy whose features it learns from.
            scored: `rl.steps.score_rollouts`' output, with the captured layers.

        Returns:
            (head, opt_state, metrics) after the update.
        """
        return KINDS[self.cfg.draft.kind].head.update(
            head, opt_state, policy, scored, optimizer=self.optimizer, loss_cfg=self.loss_cfg)

    def build_mtp_head(self, policy, *, resuming: bool):
        """The MTP head of draft.kind mtp: loaded from draft.hf_path (any of the layouts
        load_mtp reads, e.g. one train_draft.py wrote), or fresh; the shapes a checkpoint restores into when resuming. Trained online from the
        first step. Returns (head, optimizer state)."""
        key = jax.random.fold_in(jax.random.key(self.cfg.run.seed), 1)
        if resuming:
            return jax.eval_shape(lambda: MTPHead.init_for(policy, key)), None
        if self.cfg.draft.hf_path is not None:
            head = load_mtp(self.cfg.draft.hf_path, dtype=self.cfg.model.dtype,
                            attention_backend=self.cfg.model.attention_backend)
            head.check_compatible(policy)
        else:
            head = MTPHead.init_for(policy, key)
        return head, self.init_state(head)

    def build_head(self, policy, *, resuming: bool, ref_params=None, history=None):
        """The run's head: loaded from draft.hf_path, the shapes a checkpoint restores into
        (resuming), or a fresh head initialised in-domain on `policy`. Returns (head, the
        offline optimizer state to carry on with, or None)."""
        cfg = self.cfg
        d = cfg.draft
        if d.hf_path is not None:
            return load_eagle3(d.hf_path, dtype=cfg.model.dtype,
                               attention_backend=cfg.model.attention_backend,
                               target_num_layers=self.plan.model_config.num_layers), None
        size = d.draft_vocab_size or self.plan.model_config.vocab_size
        if resuming:
            return jax.eval_shape(lambda: Eagle3Head.init_for(
                policy, size, jax.random.key(0), capture_layers=d.layers)), None
        key = jax.random.fold_in(jax.random.key(cfg.run.seed), 1)
        return self.init_head(policy, size, key, ref_params=ref_params, history=history)

    def init_head(self, policy, draft_vocab_size: int, key: jax.Array, *, ref_params=None,
                  history: dict | None = None):
        """The in-domain initialisation: the policy's own rollouts on warm-up prompts (a
        stream separate from the RL prompts), the draft vocabulary from their token counts,
        then warmup.draft_steps offline steps of the online update. `ref_params` (the
        reference policy, or None) only makes the scoring program the RL step's own, so
        both compile once. Returns (head, optimizer state); `history` gets the per-step
        metrics ('draft') and the token counts ('draft_token_counts')."""
        start = time.perf_counter()
        corpus, train_step = self._offline(policy, key, ref_params)
        train_step, progress = self._with_progress(train_step, start)
        with progress:
            head, opt_state, steps = init_eagle3_head(
                policy, corpus, draft_vocab_size=draft_vocab_size, key=key,
                steps=self.cfg.warmup.draft_steps, opt_state_init=self.optimizer.init,
                train_step=train_step, capture_layers=self.cfg.draft.layers)
        self._report(history, corpus, steps, start)
        return head, opt_state

    def init_mtp_head(self, policy, key: jax.Array, *, history: dict | None = None):
        """The offline initialisation of an MTP head (scripts/train_draft.py, draft.kind
        mtp): a fresh head trained warmup.draft_steps steps of the online MTP update on the
        policy's own rollouts, as `init_head` does for EAGLE-3. Returns (head, opt_state)."""
        return self.train_fresh(policy, MTPHead.init_for(policy, key), key, history=history)

    def train_fresh(self, policy, head, key: jax.Array, *, ref_params=None,
                    history: dict | None = None):
        """`head` (new) trained warmup.draft_steps steps of the kind's online update on the
        policy's own rollouts (the in-domain initialisation of the MTP and block models).
        Returns (head, opt_state)."""
        start = time.perf_counter()
        corpus, train_step = self._offline(policy, key, ref_params)
        train_step, progress = self._with_progress(train_step, start)
        opt_state, steps = self.init_state(head), []
        with progress:
            for step in range(self.cfg.warmup.draft_steps):
                head, opt_state, metrics = train_step(head, opt_state,
                                                      corpus.batches[step % len(corpus.batches)])
                steps.append({k: float(v) for k, v in metrics.items()})
        self._report(history, corpus, steps, start)
        return head, opt_state

    def _offline(self, policy, key: jax.Array, ref_params):
        """(corpus of the policy's rollouts on warm-up prompts, train_step(head, opt_state,
        batch) -> (head, opt_state, metrics): scoring with capture + the online update)."""
        cfg, w, cluster = self.cfg, self.cfg.warmup, self.cluster
        r, tokenizer = cfg.rollout, self.plan.tokenizer
        pairs = self.plan.task.supervised_examples(w.draft_rollouts, cfg.run.seed + 2)
        prompts, lengths = encode_prompts(tokenizer, [p for p, _ in pairs], r.max_prompt_len)
        with Progress(self.log, "draft init", len(pairs), unit="rollouts") as progress:
            progress.line(f"{len(pairs)} rollouts of the warmed-up policy: compiling generation")
            corpus = draft_corpus(
                cluster.place_for_generation(policy), prompts, lengths,
                batch_size=r.prompts_per_step * r.group_size, max_new_tokens=r.max_new_tokens,
                sampling=self.sampling, stop_tokens=tuple(tokenizer.eos_ids),
                key=jax.random.fold_in(key, 1), pad_id=tokenizer.pad_id,
                generate_fn=lambda *a, **kw: cluster.generate(*a, method=r.method, **kw),
                progress=lambda done: (faults.check_setup_stop(), progress.update(done)))
        on_train = cluster.place_policy(policy)
        ref = None if ref_params is None else cluster.place_tree(ref_params)

        def train_step(head, opt_state, batch):
            scored = cluster.score(on_train, ref, batch, sampling=self.sampling,
                                   capture=head.capture_layers, filtered=self.filtered)
            head, opt_state = cluster.place_head(head), cluster.place_tree(opt_state)
            with cluster.training():
                return self.update(head, opt_state, on_train, scored)

        return corpus, train_step

    def _with_progress(self, train_step, start: float):
        """(train_step logging progress lines, its `metrics.Progress`: enter it around the
        steps for a line at least every ~10 s; the offline init is minutes on a CPU for
        mid-size policies)."""
        total = self.cfg.warmup.draft_steps
        progress, done = Progress(self.log, "draft init", total, start=start), [0]
        progress.line(f"rollouts generated ({progress.elapsed:.1f}s); {total} training "
                      f"steps: compiling the scoring and the update")

        def step(head, opt_state, batch):
            faults.check_setup_stop()  # a stop signal during the init: stop between its steps
            out = train_step(head, opt_state, batch)
            done[0] += 1
            if done[0] < total:  # the last: _report's line
                progress.update(done[0], lambda: f"draft loss {float(out[2]['draft_loss']):.3f}")
            return out

        return step, progress

    def _report(self, history, corpus, steps: list[dict], start: float) -> None:
        if history is not None:
            history.update(draft=steps, draft_token_counts=corpus.token_counts)
        if steps:
            acc = " ".join(f"{steps[-1][f'draft_acc_{s}']:.2f}" for s in range(len(steps[-1]))
                           if f"draft_acc_{s}" in steps[-1])
            self.log(f"draft init: {self.cfg.warmup.draft_rollouts} rollouts, {len(steps)} steps, "
                     f"loss {steps[0]['draft_loss']:.3f} -> {steps[-1]['draft_loss']:.3f}, "
                     f"acc/step [{acc}] ({time.perf_counter() - start:.1f}s)")
