"""A run's exported policy/ answers through transformers as the trainer generates: the
exported tokenizer encodes a prompt as the trainer does (BOS + the text), and greedy
generation by `AutoModelForCausalLM` from the directory gives jaxspec's greedy rollout.

The reference is transformers itself (its tokenizer, its model, its `generate`), on the
files a server would load; the negative control shows the same model answers otherwise
without the BOS, so the comparison sees the prompt encoding."""

import jax
import numpy as np
import pytest
import torch
import transformers

from jaxspec.decoding import SamplingConfig, generate
from jaxspec.models import ModelConfig
from jaxspec.models.transformer import random_policy
from jaxspec.rl.build import export_models
from jaxspec.rl.tasks import CharTokenizer

PROMPTS = ["3+4=", "12*(5-3)=", "7-9="]
NEW = 8


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    tok = CharTokenizer()
    config = ModelConfig.tiny("qwen3", vocab_size=tok.vocab_size, num_layers=2)
    policy = random_policy(config, seed=5)  # its answers vary with the prompt
    run = tmp_path_factory.mktemp("run")
    export_models(str(run), policy, tokenizer=tok)  # what the trainer writes at the end
    return tok, policy, run / "policy"


def _until_eos(ids, eos: int) -> list[int]:
    ids = [int(i) for i in ids]
    return ids[:ids.index(eos) + 1] if eos in ids else ids


def test_the_exported_tokenizer_encodes_prompts_as_the_trainer_does(exported):
    tok, _, out = exported
    served = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    for prompt in PROMPTS:
        assert served(prompt)["input_ids"] == tok.encode_prompt(prompt), prompt
        assert served.encode(prompt) == tok.encode_prompt(prompt), prompt
        assert served.decode(tok.encode_prompt(prompt), skip_special_tokens=True) == prompt


def _greedy(model, ids):  # ids [1, P] -> (new tokens [NEW], their log-probs [NEW])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=NEW, output_scores=True, return_dict_in_generate=True)
    new = out.sequences[0, ids.shape[1]:]
    logp = [torch.log_softmax(s[0].double(), -1)[t].item() for s, t in zip(out.scores, new)]
    return new.tolist(), np.array(logp)


def test_transformers_greedy_from_the_export_equals_jaxspec_greedy(exported):
    """Tokens equal (up to the first EOS) and their log-probs within float32 noise; without
    the BOS (the old export's encoding) the answer or its log-probs differ (control)."""
    tok, policy, out = exported
    served = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True,
                                                              dtype=torch.float32)
    ours = generate(policy, [tok.encode_prompt(p) for p in PROMPTS], max_new_tokens=NEW,
                    sampling=SamplingConfig(temperature=0.0), key=jax.random.key(0),
                    stop_tokens=tok.eos_ids)
    tokens, lengths = np.asarray(ours.tokens), np.asarray(ours.lengths)
    logprobs = np.asarray(ours.logprobs)
    answers_differ = 0
    for i, prompt in enumerate(PROMPTS):
        mine = _until_eos(tokens[i, :lengths[i]], tok.eos_id)
        theirs, theirs_logp = _greedy(model, served(prompt, return_tensors="pt")["input_ids"])
        assert _until_eos(theirs, tok.eos_id) == mine, prompt
        np.testing.assert_allclose(logprobs[i, :len(mine)], theirs_logp[:len(mine)], atol=2e-4)
        bare = served(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        no_bos, no_bos_logp = _greedy(model, bare)
        answers_differ += _until_eos(no_bos, tok.eos_id) != mine
        assert np.abs(no_bos_logp[:len(mine)] - logprobs[i, :len(mine)]).max() > 1e-2, prompt
    assert answers_differ >= 1  # control: the BOS changes an answer


def test_an_hf_tokenizer_that_adds_no_bos_is_given_the_trainers(tmp_path):
    """model.hf_path's tokenizer names a BOS but does not add it (byte-level BPE, no
    post-processor): the trainer's raw prompts are BOS + text (`HFTokenizer.encode_prompt`),
    so the exported copy prepends it; the source itself does not (control)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from jaxspec.models import save_hf
    from jaxspec.rl.tokenizer import HFTokenizer

    src = tmp_path / "src"
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(["the answer is 42", "x + y = 7"] * 8, trainers.BpeTrainer(
        vocab_size=100, special_tokens=["<|endoftext|>", "<|im_end|>", "<s>"]))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>",
                                                pad_token="<|endoftext|>", bos_token="<s>")
    fast.save_pretrained(src)
    policy = random_policy(ModelConfig.tiny("qwen3", vocab_size=len(fast), num_layers=1))
    save_hf(policy, src)
    trainer_tok = HFTokenizer(str(src), chat_template=False)
    text = "the answer is 42"
    assert fast(text)["input_ids"] != trainer_tok.encode_prompt(text)  # control: no BOS
    export_models(str(tmp_path / "run"), policy, source=str(src), tokenizer=trainer_tok)
    served = transformers.AutoTokenizer.from_pretrained(tmp_path / "run" / "policy",
                                                        local_files_only=True)
    ids = served(text)["input_ids"]
    assert ids == trainer_tok.encode_prompt(text) and ids[0] == fast.bos_token_id
    assert served.decode(ids, skip_special_tokens=True) == text
