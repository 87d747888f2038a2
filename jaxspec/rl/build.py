"""The run's models before training: the policy (and a small draft model) loaded from a
HF directory, the shapes a checkpoint restores into, or a fresh tiny model turned into a
base policy by the supervised warm-up; and the export of the trained models."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import jax

from jaxspec import parallel
from jaxspec.metrics import Progress
from jaxspec.models import HybridPolicy, ModelConfig, Policy, load_hf
from jaxspec.rl import faults
from jaxspec.rl.warmup import encode_pairs, supervised_warmup

__all__ = ["build_draft_model", "build_policy", "export_models", "policy_class", "warm_up"]

_log = logging.getLogger("jaxspec.rl")


def warm_up(policy: Policy, plan, warmup_cfg, seed: int, what: str, *,
            log: Callable[[str], None] | None = None, history: dict | None = None) -> Policy:
    """`warmup.steps` supervised steps on the task's supervised pairs (stream `seed`); the
    per-step losses go to history[f'{what} loss']. A `batch_invariant` policy warms up with
    the default forward (the mode matters where generation and training log-probs meet, not
    in supervised steps, and its fixed-shape matmuls cost more) and keeps its mode."""
    w = warmup_cfg
    invariant = policy.config.batch_invariant
    if invariant:
        policy = policy.with_config(batch_invariant=False)
    start = time.perf_counter()
    pairs = plan.task.supervised_examples(w.steps * w.batch_size, seed)
    tokens, mask = encode_pairs(plan.tokenizer, pairs)
    with Progress(log or _log.info, f"warm-up ({what})", w.steps) as progress:
        progress.line(f"{w.steps} supervised steps of {w.batch_size} sequences: compiling")
        policy, losses = supervised_warmup(
            policy, tokens, mask, steps=w.steps, batch_size=w.batch_size, lr=w.lr,
            progress=lambda done, loss: (faults.check_setup_stop(),  # a stop signal: stop here
                                         progress.update(done, f"loss {loss.mean():.3f}")))
    if invariant:
        policy = policy.with_config(batch_invariant=True)
    if history is not None:
        history[f"{what} loss"] = losses
    (log or _log.info)(f"warm-up ({what}): {w.steps} steps, loss {losses[0]:.3f} -> "
        f"{losses[-max(w.steps // 10, 1):].mean():.3f} ({time.perf_counter() - start:.1f}s)")
    return policy


def policy_class(config: ModelConfig) -> type[Policy] | type[HybridPolicy]:
    """The policy class that builds `config`: HybridPolicy for the linear-attention families
    (qwen3_5, qwen3_next), Policy for the others."""
    return HybridPolicy if config.is_hybrid else Policy


def _trainer_rule(policy):
    """A hybrid policy runs the recurrent delta rule in its multi-token forwards on CPU: the
    warm-up gradient of the configs/hybrid.yaml policy took ~5 s a step recurrent against
    ~25 s chunked (32 rows x 152 tokens, 2 shared cores; docs/results/hybrid.json)."""
    from jaxspec.kernels import platform

    if isinstance(policy, HybridPolicy) and platform() == "cpu":
        return policy.replace(delta_rule="recurrent")
    return policy


def _load(path: str, cfg, cluster, config: ModelConfig | None = None) -> Policy:
    """A HF directory straight into its training shardings (those of `config`, the
    directory's checked config; None: read from its config.json, a dense or MoE model)."""
    if config is None:
        shardings = parallel.hf_shardings(path, cluster.train_mesh, cluster.rules)
    else:
        shardings = parallel.param_shardings(policy_class(config).abstract(config),
                                             cluster.train_mesh, cluster.rules)
    return load_hf(path, cfg.model.dtype, attention_backend=cfg.model.attention_backend,
                   shardings=shardings)


def build_policy(cfg, plan, cluster, *, resuming: bool,
                 log: Callable[[str], None] | None = None, history: dict | None = None) -> Policy:
    """model.hf_path loaded, or the tiny model: abstract when resuming (the checkpoint
    fills it), else initialised from the run's seed and warmed up."""
    cls = policy_class(plan.model_config)
    if cfg.model.hf_path is not None:
        policy = _load(cfg.model.hf_path, cfg, cluster, plan.model_config)
    elif resuming:
        return _trainer_rule(cls.abstract(plan.model_config))
    else:
        policy = cls.init(plan.model_config, jax.random.fold_in(jax.random.key(cfg.run.seed), 0))
    policy = _trainer_rule(policy)
    if not resuming and cfg.warmup.steps > 0:
        policy = warm_up(policy, plan, cfg.warmup, cfg.run.seed, "policy", log=log,
                         history=history)
    return policy


def build_draft_model(cfg, plan, cluster, *, resuming: bool,
                      log: Callable[[str], None] | None = None,
                      history: dict | None = None) -> Policy:
    """draft.hf_path loaded, or the tiny draft model of draft.model (abstract when
    resuming, else initialised and warmed up on its own stream)."""
    if cfg.draft.hf_path is not None:
        return _load(cfg.draft.hf_path, cfg, cluster)
    if resuming:
        return Policy.abstract(plan.draft_model_config)
    key = jax.random.fold_in(jax.random.key(cfg.run.seed), 4)
    model = Policy.init(plan.draft_model_config, key)
    if cfg.warmup.steps > 0:
        model = warm_up(model, plan, cfg.warmup, cfg.run.seed + 1, "draft model", log=log,
                        history=history)
    return model


def export_models(run_dir: str, policy: Policy, *, source: str | None = None,
                  tokenizer=None) -> None:
    """The policy to <run_dir>/policy (HF safetensors), servable as it is: its tokenizer
    encodes a prompt as the trainer does (`AutoTokenizer.from_pretrained(dir)(text)` is
    `tokenizer.encode_prompt(text)` for raw prompts; templated ones go through the copied
    chat template). A draft head is saved by its kind (`rl.kinds.HeadKind.save`).

    Args:
        run_dir: the run's directory.
        policy: the trained policy (host arrays).
        source: the run's model.hf_path, whose tokenizer files, generation_config.json and
            special ids are copied; None: the tiny model's.
        tokenizer: the run's tokenizer (`plan.tokenizer`): written when there is no source
            (the built-in character one); with a source, the copy's prompt encoding is
            checked against it (and given the BOS the trainer prepends) when it is the
            source's own (`HFTokenizer`). None: neither.
    """
    from jaxspec.models import save_hf
    from jaxspec.models.hf import SpecialTokens, save_char_tokenizer

    out = os.path.join(run_dir, "policy")
    special = None
    if source is None and tokenizer is not None:
        names = {tokenizer.pad_id: "<pad>", tokenizer.bos_id: "<s>", tokenizer.eos_id: "</s>"}
        tokens = [names.get(i) or tokenizer.decode([i]) for i in range(tokenizer.vocab_size)]
        save_char_tokenizer(out, tokens, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id,
                            pad_id=tokenizer.pad_id,
                            max_length=policy.config.max_position_embeddings)
        special = SpecialTokens(tokenizer.bos_id, (tokenizer.eos_id,), tokenizer.pad_id)
    save_hf(policy, out, source=source, special=special)
    from jaxspec.rl.tokenizer import HFTokenizer

    if special is not None or isinstance(tokenizer, HFTokenizer):  # the tokenizer written
        _encode_prompts_as_trained(out, tokenizer)


PROBE = "12+(3*4)= 15.5"  # a prompt in the character tokenizer's alphabet too


def _encode_prompts_as_trained(out: str, tokenizer) -> None:
    """policy/'s tokenizer.json given a post-processor that prepends the BOS when the
    trainer's raw prompts have one and the tokenizer's own encoding does not (a server
    encodes with special tokens, and a policy trained on BOS + text answers otherwise
    without it).

    Raises:
        ValueError: the exported tokenizer still encodes a prompt otherwise than the trainer.
    """
    from tokenizers import Tokenizer, processors
    from transformers import AutoTokenizer

    if getattr(tokenizer, "chat_template", False):  # the template carries its own specials
        return
    want = tokenizer.encode_prompt(PROBE)
    served = AutoTokenizer.from_pretrained(out, local_files_only=True)
    path = os.path.join(out, "tokenizer.json")
    bos = tokenizer.bos_id
    if served.encode(PROBE) != want and bos is not None and os.path.isfile(path):
        tok = Tokenizer.from_file(path)
        text = served.convert_ids_to_tokens(bos)
        add_bos = processors.TemplateProcessing(single=f"{text} $A", pair=f"{text} $A $B:1",
                                                special_tokens=[(text, bos)])
        tok.post_processor = add_bos if tok.post_processor is None else processors.Sequence(
            [tok.post_processor, add_bos])
        tok.save(path)
        served = AutoTokenizer.from_pretrained(out, local_files_only=True)
    got = served.encode(PROBE)
    if got != want:
        raise ValueError(f"the exported tokenizer in {out} encodes {PROBE!r} as {got}; the "
                         f"trainer's prompts are {want}: a server would prompt the policy "
                         f"otherwise than it was trained")
