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
