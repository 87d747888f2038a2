"""The policy's own tokenizer for real (HF) models: its chat template for prompts, and every
EOS id the model directory names (tokenizer and generation_config.json) as stop tokens."""

from __future__ import annotations

import os

__all__ = ["HFTokenizer"]


class HFTokenizer:
    """The `CharTokenizer` interface over a local `transformers` tokenizer (no downloads).

    chat_template: "auto" formats prompts with the tokenizer's chat template when it has one
    (an instruct model is trained on what it is served), True requires one, False never
    applies it (a base model on raw text). `eos_ids` is every id that ends a completion:
    the tokenizer's EOS plus generation_config.json's list (Qwen3: <|im_end|> and
    <|endoftext|>), as transformers, vLLM and SGLang stop on them."""

    # The files one of which a transformers tokenizer is built from (fast, BPE, sentencepiece).
    FILES = ("tokenizer.json", "vocab.json", "tokenizer.model", "vocab.txt")

    def __init__(self, path: str, *, chat_template: bool | str = "auto"):
        from transformers import AutoTokenizer

        from jaxspec.models import special_tokens

        if chat_template not in ("auto", True, False):
            raise ValueError(f"chat_template={chat_template!r}; valid: 'auto', true or false")
        if not any(os.path.isfile(os.path.join(path, f)) for f in self.FILES):
            raise ValueError(f"{path} has no tokenizer files (one of {', '.join(self.FILES)}); "
                             "copy them beside config.json")
        self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        if len(self._tok) == 0:
            raise ValueError(f"the tokenizer in {path} is empty")
        ids = special_tokens(path)
        own = self._tok.eos_token_id
        self.eos_ids: tuple[int, ...] = tuple(dict.fromkeys(
            ((own,) if own is not None else ()) + ids.eos))
        if not self.eos_ids:
            raise ValueError(f"neither the tokenizer nor generation_config.json in {path} names "
                             "an EOS token (rollouts need one to stop)")
        self._pad = self._tok.pad_token_id if self._tok.pad_token_id is not None else ids.pad
        has_template = bool(getattr(self._tok, "chat_template", None))
        if chat_template is True and not has_template:
            raise ValueError(f"task.chat_template is true but the tokenizer in {path} has no "
                             "chat template (tokenizer_config.json 'chat_template' or "
                             "chat_template.jinja); set task.chat_template=false for raw prompts")
        self.chat_template: bool = has_template if chat_template == "auto" else chat_template

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def pad_id(self) -> int:
        return self.eos_id if self._pad is None else self._pad

    @property
    def bos_id(self) -> int | None:
        return self._tok.bos_token_id

    @property
    def eos_id(self) -> int:
        """The main EOS (the tokenizer's own, else generation_config.json's first)."""
        return self.eos_ids[0]

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False)
        if bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids + ([self.eos_id] if eos else [])

    def format_prompt(self, text: str) -> str:
        """The prompt text the policy sees: one user turn and the assistant's header under
        the chat template, or `text` itself without one."""
        if not self.chat_template:
            return text
        return self._tok.apply_chat_template([{"role": "user", "content": text}],
                                             tokenize=False, add_generation_prompt=True)

    def encode_prompt(self, text: str) -> list[int]:
        """A prompt's ids: the templated turn (whose text carries its own BOS, if any), else
        BOS + the raw text."""
        if not self.chat_template:
            return self.encode(text, bos=True)
        return self._tok.encode(self.format_prompt(text), add_special_tokens=False)

    def decode(self, ids) -> str:
        """The completion's text up to (not including) its first EOS of any kind."""
        ids = [int(i) for i in ids]
        cut = next((n for n, i in enumerate(ids) if i in self.eos_ids), len(ids))
        return self._tok.decode(ids[:cut], skip_special_tokens=True)
