"""Warm-up sequences of the long worked-addition task: what the loss trains on decodes back
to the worked targets, whose answers are the true sums (clean) or one column off (noisy)."""

import numpy as np

from jaxspec.rl.tasks import WorkedAdditionTask
from jaxspec.rl.warmup import encode_pairs


def test_worked_addition_warmup_sequences_decode_to_their_answers():
    task = WorkedAdditionTask(seed=0, max_digits=8, warmup_noise=0.3)
    tok = task.tokenizer
    pairs = task.supervised_examples(200, seed=4)
    tokens, mask = encode_pairs(tok, pairs)
    assert tokens.shape[1] == max(len(p) + len(t) for p, t in pairs) + 2  # BOS + EOS
    right = 0
    for (prompt, target), row, m in zip(pairs, tokens, mask, strict=True):
        # the masked positions predict exactly the target's characters, then EOS
        predicted = row[1:][m[:-1]]
        assert predicted[-1] == tok.eos_id
        assert tok.decode(predicted) == target
        a, b = prompt[:-1].split("+")
        truth = str(int(a) + int(b)).zfill(len(a) + 1)  # Python's integer sum, not the task's
        right += target.rsplit(";", 1)[1] == truth
    # 30% noisy targets, each with one column wrong: 70% +- 4 sigma have the true answer
    assert abs(right / 200 - 0.7) < 4 * np.sqrt(0.21 / 200)


def test_packed_warmup_loss_equals_the_padded_one():
    """Long-tailed warm-up batches are packed several sequences per row; the loss (and so
    the gradient) is the padded batch's, each sequence alone in its row as the reference."""
    import jax
    import jax.numpy as jnp

    from jaxspec.models import Policy
    from jaxspec.models.config import ModelConfig
    from jaxspec.rl.tasks import CountingTask
    from jaxspec.rl.warmup import _token_nll, pack_sequences

    task = CountingTask(seed=0)
    tokens, mask = encode_pairs(task.tokenizer, task.supervised_examples(48, seed=2))
    packed = pack_sequences(tokens.reshape(2, 24, -1), mask.reshape(2, 24, -1))
    rows = packed[0].shape[1]
    assert rows < 24  # long-tailed lengths: fewer rows than sequences
    for step in range(2):  # every masked token kept exactly once, in its own segment
        seg, m = packed[2][step], packed[1][step]
        assert m.sum() == mask[24 * step:24 * (step + 1)].sum()
        assert np.all(seg[m] >= 0)
    cfg = ModelConfig.tiny("qwen3", vocab_size=task.tokenizer.vocab_size, hidden_size=32,
                           intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                           head_dim=16, max_position_embeddings=tokens.shape[1] + 1)
    policy = Policy.init(cfg, jax.random.key(0))
    for step in range(2):
        want = _token_nll(policy, jnp.asarray(tokens[24 * step:24 * (step + 1)]),
                          jnp.asarray(mask[24 * step:24 * (step + 1)]))
        got = _token_nll(policy, *(jnp.asarray(x[step]) for x in packed))
        np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
