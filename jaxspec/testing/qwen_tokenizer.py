"""A real-format Qwen-style tokenizer directory, built for tests: byte-level BPE trained on a
few math prompts, Qwen's special tokens and a one-turn chat template (tests/rl/test_real_config.py,
test_tasks.py). Needs the `tokenizers` library (a dependency of transformers)."""

import json
import pathlib

SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen's chat template, reduced to what a one-turn prompt uses.
TEMPLATE = ("{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + "
            "message['content'] + '<|im_end|>\\n' }}{%- endfor %}"
            "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
PROMPTS = [("What is 12 + 30?", "42"), ("Compute 7 * 6.", "42"), ("What is 100 - 1?", "99"),
           ("Simplify \\frac{6}{8}.", "\\frac{3}{4}"), ("What is 2^5?", "32"),
           ("How many sides has a hexagon?", "6")]  # (prompt, answer)


def write_tokenizer_files(path: pathlib.Path) -> dict:
    """Writes tokenizer.json and tokenizer_config.json (320 tokens, trained on PROMPTS) to
    `path`.

    Returns:
        {special token: its id}.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=list(SPECIAL), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([p for p, _ in PROMPTS] * 4 + ["The answer is \\boxed{42}."], trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "bos_token": None, "chat_template": TEMPLATE}))
    return {name: tok.token_to_id(name) for name in SPECIAL}
