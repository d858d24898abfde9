"""The tokenizer: built from GGUF metadata or a tokenizer.json, checked against transformers."""

import json

import pytest
from gguf import GGUFWriter
from hypothesis import given, settings
from hypothesis import strategies as st

from medha_jax.checkpoint import CheckpointError, Tokenizer, default_model_path

TEXTS = [
    "Hello, world! How are you today?",
    "héllo wörld — naïve café, 日本語のテキスト, emoji 🙂🚀 and a ZWJ family 👨‍👩‍👧",
    'def f(x):\n    return {"a": [1, 2, 3]}  # comment\n\tif x != 0:\n\t\tpass\n',
    "  leading and trailing   \n\n\n\t\t  mixed \r\n runs     ",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|endoftext|>",
    "abc<|im_end|>def <repo_name>x",
    "I'll pay $1,234.56 on 2024-12-31; don't you're we've THEY'LL",
    "",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye 👋"}],
]


@pytest.fixture(scope="module")
def ours():
    return Tokenizer.from_gguf(default_model_path())


@pytest.fixture(scope="module")
def theirs():
    from transformers import AutoTokenizer

    path = default_model_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.mark.hf
@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_match_transformers(ours, theirs, text):
    ids = ours.encode(text)
    assert ids == theirs.encode(text)
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
            ids, skip_special_tokens=skip)


@pytest.mark.hf
def test_special_tokens_match_transformers(ours, theirs):
    assert ours.vocab_size == len(theirs) == 49_152
    assert ours.bos_token_id == theirs.bos_token_id
    assert ours.eos_token_ids == (theirs.eos_token_id,)
    assert ours.add_bos_by_default is False   # SmolLM2 adds no BOS; its chat template marks turns
    assert ours.encode("hi", add_bos=True) == [theirs.bos_token_id] + theirs.encode("hi")


@pytest.mark.hf
@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours, theirs, messages, add_generation_prompt):
    assert ours.apply_chat_template(messages, add_generation_prompt) == theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt)


@pytest.mark.hf
def test_from_file_of_the_saved_transformers_tokenizer(ours, theirs, tmp_path):
    theirs.save_pretrained(tmp_path)
    loaded = Tokenizer.from_file(tmp_path / "tokenizer.json")
    assert (loaded.vocab_size, loaded.bos_token_id, loaded.eos_token_ids,
            loaded.add_bos_by_default) == (ours.vocab_size, 1, (2,), False)
    for text in TEXTS:
        assert loaded.encode(text) == theirs.encode(text)
    conversation = CONVERSATIONS[1]
    assert loaded.apply_chat_template(conversation) == ours.apply_chat_template(conversation)


@pytest.mark.hf
def test_from_file_adds_bos_when_the_post_processor_does(ours, tmp_path):
    from tokenizers import processors
    from transformers import AutoTokenizer

    backend = ours.backend
    backend_with_bos = type(backend).from_str(backend.to_str())
    backend_with_bos.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
    backend_with_bos.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": True,
         "tokenizer_class": "PreTrainedTokenizerFast"}))
    loaded = Tokenizer.from_file(tmp_path)
    reference = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.add_bos_by_default
    for text in TEXTS[:4]:
        assert loaded.encode(text) == reference.encode(text)
        assert loaded.encode(text, add_bos=False) == reference.encode(
            text, add_special_tokens=False)


# --- Without transformers -------------------------------------------------------------------

# SmolLM2's vocabulary lacks the byte tokens of a few ASCII control characters and of the
# UTF-8 lead bytes of code points >= U+40000; those are dropped (by transformers too).
_COVERED_TEXT = st.text(st.characters(max_codepoint=0x3FFFF, exclude_categories=("Cs", "Cc"),
                                      include_characters="\n\r\t"), max_size=40)


@settings(max_examples=60, deadline=None)
@given(_COVERED_TEXT)
def test_decode_inverts_encode(ours, text):
    # Byte-level BPE is lossless for text its byte alphabet covers.
    assert ours.decode(ours.encode(text)) == text


def test_special_tokens_in_text_are_single_ids(ours):
    ids = ours.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert ours.decode(ids) == "user\nhi"
    assert ours.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"
    assert ours.encode("2024") == [ours.encode(d)[0] for d in "2024"]   # digits split singly


def write_tokenizer_gguf(path, **fields):
    writer = GGUFWriter(str(path), "llama")
    writer.add_string("tokenizer.ggml.model", fields.get("model", "gpt2"))
    writer.add_string("tokenizer.ggml.pre", fields.get("pre", "smollm"))
    writer.add_array("tokenizer.ggml.tokens", ["a", "b", "ab", "<|end|>"])
    writer.add_array("tokenizer.ggml.merges", ["a b"])
    writer.add_array("tokenizer.ggml.token_type", [1, 1, 1, 3])
    writer.add_uint32("tokenizer.ggml.eos_token_id", 3)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


def test_tiny_gguf_tokenizer(tmp_path):
    tok = Tokenizer.from_gguf(write_tokenizer_gguf(tmp_path / "t.gguf"))
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_ids) == (4, None, (3,))
    assert tok.encode("abba<|end|>") == [2, 1, 0, 3]
    assert tok.decode([2, 1, 0, 3]) == "abba"
    with pytest.raises(ValueError, match="no BOS"):
        tok.encode("a", add_bos=True)
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "a"}])


@pytest.mark.parametrize("field, value, message", [
    ("model", "llama", "tokenizer.ggml.model='llama'"),
    ("pre", "qwen2", "tokenizer.ggml.pre='qwen2'"),
])
def test_unsupported_gguf_tokenizers_are_named(tmp_path, field, value, message):
    path = write_tokenizer_gguf(tmp_path / "t.gguf", **{field: value})
    with pytest.raises(CheckpointError, match=message.replace(".", r"\.")):
        Tokenizer.from_gguf(path)
