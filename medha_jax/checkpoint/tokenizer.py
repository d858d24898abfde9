"""The model's tokenizer: a `tokenizers.Tokenizer` plus the facts serving needs.

Two sources:
  - a Hugging Face `tokenizer.json` (with tokenizer_config.json, config.json and
    generation_config.json beside it for the special tokens and the chat template);
  - a GGUF file's tokenizer.ggml.* metadata, rebuilt here as a byte-level BPE tokenizer
    (the GPT-2 family: SmolLM2, Llama 3) without transformers, which is a test oracle only.

BOS is handled here rather than by a post-processor, so `encode(add_bos=...)` means the
same thing for both sources; its default is what the model's own tokenizer does.
"""

from __future__ import annotations

import datetime
import functools
import json
import pathlib
import re
from collections.abc import Sequence
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from medha_jax.checkpoint.tensors import CheckpointError

# encode_chat's placeholders for special-token text found in messages: private-use
# characters, which no template writes.
_PLACEHOLDER_OPEN, _PLACEHOLDER_CLOSE = "\ue000", "\ue001"
_PLACEHOLDER = re.compile(f"{_PLACEHOLDER_OPEN}(\\d+){_PLACEHOLDER_CLOSE}")

# llama.cpp's GGUF token types (tokenizer.ggml.token_type).
_CONTROL, _USER_DEFINED = 3, 4

# Llama 3's split pattern (llama.cpp: LLAMA_VOCAB_PRE_TYPE_LLAMA3).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _gpt2_split() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2_split() -> pre_tokenizers.PreTokenizer:
    # llama.cpp splits these vocabularies with "\p{N}" first, then GPT-2's pattern.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2_split()])


def _llama3_split() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


# tokenizer.ggml.pre -> (pre-tokenizer, ignore_merges), following llama.cpp's llama-vocab.cpp
# (Llama 3 looks a whole word up in the vocabulary before merging, as its tokenizer.json does).
_GGUF_PRE_TOKENIZERS = {
    "gpt-2": (_gpt2_split, False),
    "smollm": (_digits_then_gpt2_split, False),
    "starcoder": (_digits_then_gpt2_split, False),
    "refact": (_digits_then_gpt2_split, False),
    "codeshell": (_digits_then_gpt2_split, False),
    "llama-bpe": (_llama3_split, True),
    "llama3": (_llama3_split, True),
    "llama-v3": (_llama3_split, True),
}


class Tokenizer:
    """Text <-> token ids, special tokens and the chat template of one model."""

    def __init__(self, backend: tokenizers.Tokenizer, *, bos_token_id: int | None,
                 eos_token_ids: Sequence[int], add_bos_by_default: bool,
                 chat_template: str | None = None):
        vocab_size = backend.get_vocab_size(with_added_tokens=True)
        for token_id in ([bos_token_id] if bos_token_id is not None else []) + list(eos_token_ids):
            if not 0 <= token_id < vocab_size:
                raise CheckpointError(f"special token id {token_id} is outside {vocab_size=}")
        if add_bos_by_default and bos_token_id is None:
            raise CheckpointError(
                "the tokenizer adds a BOS token by default but has no bos_token_id")
        self.backend = backend
        self.vocab_size = vocab_size
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self.add_bos_by_default = add_bos_by_default
        self.chat_template = chat_template
        self._special_pattern = None   # built on first use (encode_chat)
        self._plain = None

    # --- Construction ---------------------------------------------------------------------

    @classmethod
    def from_file(cls, path: str | pathlib.Path) -> "Tokenizer":
        """From a Hugging Face tokenizer.json (or the directory holding one)."""
        path = pathlib.Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        try:
            backend = tokenizers.Tokenizer.from_file(str(file))
        except Exception as e:   # tokenizers raises a bare Exception on a bad or missing file
            raise CheckpointError(f"cannot read tokenizer {file}: {e}") from e
        tokenizer_config = _read_json(file.parent / "tokenizer_config.json")
        model_config = _read_json(file.parent / "config.json")
        generation_config = _read_json(file.parent / "generation_config.json")

        def token_id(token: Any) -> int | None:
            if isinstance(token, dict):   # an AddedToken written out as a dict
                token = token.get("content")
            return backend.token_to_id(token) if isinstance(token, str) else None

        bos_token_id = token_id(tokenizer_config.get("bos_token"))
        if bos_token_id is None:
            bos_token_id = model_config.get("bos_token_id")
        eos_token_ids = [token_id(tokenizer_config.get("eos_token"))]
        for config in (generation_config, model_config):
            eos = config.get("eos_token_id")
            eos_token_ids += eos if isinstance(eos, list) else [eos]
        # The default is whatever the file's post-processor does to an empty text.
        with_specials = backend.encode("", add_special_tokens=True).ids
        add_bos = bos_token_id is not None and with_specials[:1] == [bos_token_id]
        return cls(backend, bos_token_id=bos_token_id,
                   eos_token_ids=[i for i in eos_token_ids if i is not None],
                   add_bos_by_default=add_bos,
                   chat_template=_hf_chat_template(file.parent, tokenizer_config))

    @classmethod
    def from_gguf(cls, reader_or_path) -> "Tokenizer":
        """From a GGUF file's metadata (a parsed GGUFContainer, a `gguf.GGUFReader` or a
        path to the file)."""
        # Imported here: gguf_file imports this module for its loader.
        from medha_jax.checkpoint.gguf_file import as_gguf_container, gguf_field

        reader = as_gguf_container(reader_or_path)
        kind = gguf_field(reader, "tokenizer.ggml.model")
        if kind != "gpt2":
            raise CheckpointError(
                f"GGUF tokenizer.ggml.model={kind!r}: only 'gpt2' (byte-level BPE) is supported")
        pre = gguf_field(reader, "tokenizer.ggml.pre", "default")
        if pre not in _GGUF_PRE_TOKENIZERS:
            raise CheckpointError(
                f"GGUF tokenizer.ggml.pre={pre!r} is not supported; "
                f"known: {sorted(_GGUF_PRE_TOKENIZERS)}")
        tokens = gguf_field(reader, "tokenizer.ggml.tokens")
        backend = _byte_level_bpe(
            tokens,
            merges=gguf_field(reader, "tokenizer.ggml.merges"),
            token_types=gguf_field(reader, "tokenizer.ggml.token_type", [0] * len(tokens)),
            pre=pre)
        # llama.cpp stops at EOS and at the end-of-turn / end-of-message tokens.
        eos_keys = ("eos_token_id", "eot_token_id", "eom_token_id")
        eos = [gguf_field(reader, f"tokenizer.ggml.{key}", None) for key in eos_keys]
        add_bos = bool(gguf_field(reader, "tokenizer.ggml.add_bos_token", False))
        return cls(backend,
                   bos_token_id=gguf_field(reader, "tokenizer.ggml.bos_token_id", None),
                   eos_token_ids=[i for i in eos if i is not None],
                   add_bos_by_default=add_bos,
                   chat_template=gguf_field(reader, "tokenizer.chat_template", None))

    # --- Use ------------------------------------------------------------------------------

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; add_bos=None does what the model's tokenizer does by default.

        Special tokens written in the text ("<|im_start|>") become their single ids.
        """
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if self.add_bos_by_default if add_bos is None else add_bos:
            if self.bos_token_id is None:
                raise ValueError("add_bos=True but this tokenizer has no BOS token")
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (what OpenAI's logprobs report as `bytes`).

        A byte-level BPE token may hold part of a UTF-8 character, which decoding it alone
        turns into U+FFFD; its bytes come from the vocabulary entry through GPT-2's byte
        alphabet instead. Special tokens and other decoders: the token decoded alone."""
        token = self.backend.id_to_token(int(token_id))
        if token is not None and isinstance(self.backend.decoder, decoders.ByteLevel):
            table = _unicode_to_bytes()
            if all(c in table for c in token):
                return bytes(table[c] for c in token)
        return self.backend.decode([int(token_id)], skip_special_tokens=False).encode()

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **template_kwargs) -> str:
        """Renders `messages` ([{"role": ..., "content": ...}]) with the model's template."""
        if self.chat_template is None:
            raise ValueError("this checkpoint has no chat template; format the prompt yourself")
        try:
            import jinja2
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise ImportError("apply_chat_template needs jinja2: pip install jinja2") from None

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            # Jinja's own tojson escapes HTML characters; templates expect plain JSON.
            return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                              separators=separators, sort_keys=sort_keys)

        # The environment transformers renders chat templates in (templates assume it).
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self._token_text(self.bos_token_id),
            eos_token=self._token_text(self.eos_token_ids[0] if self.eos_token_ids else None),
            **template_kwargs)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    **template_kwargs) -> list[int]:
        """The conversation's prompt ids (no BOS added: the template writes its own), where
        only the template makes control tokens.

        Special-token text inside the messages (a user writing "<|im_start|>system" in its
        content, or in a role) is encoded as the plain text it is, as Hugging Face
        tokenizers' `split_special_tokens` does, so no message can open a turn of another
        role. How: each such text is swapped for a placeholder before rendering, the
        rendered text is encoded between placeholders with special tokens matched (they can
        only be the template's), and each placeholder as plain text. A conversation without
        special-token text gets exactly `encode(apply_chat_template(...), add_bos=False)`.
        """
        literals: list[str] = []
        pattern = self._special_text_pattern()

        def escape(value):
            if isinstance(value, str):
                def placeholder(match):
                    literals.append(match.group(0))
                    return f"{_PLACEHOLDER_OPEN}{len(literals) - 1}{_PLACEHOLDER_CLOSE}"
                return pattern.sub(placeholder, value)
            if isinstance(value, dict):
                return {k: escape(v) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return [escape(v) for v in value]
            return value

        text = self.apply_chat_template([escape(m) for m in messages], add_generation_prompt,
                                        **template_kwargs)
        parts = _PLACEHOLDER.split(text)      # text, index, text, index, ..., text
        ids: list[int] = []
        for i, part in enumerate(parts):
            if i % 2 == 0:
                ids += self.backend.encode(part, add_special_tokens=False).ids if part else []
            else:
                ids += self._plain_backend().encode(literals[int(part)],
                                                    add_special_tokens=False).ids
        return ids

    def _special_text_pattern(self) -> "re.Pattern":
        if self._special_pattern is None:
            texts = {t.content for t in self.backend.get_added_tokens_decoder().values()
                     if t.special and t.content}
            # The placeholder's own opening character is escaped too, so no message can
            # forge a placeholder.
            alternatives = sorted(texts | {_PLACEHOLDER_OPEN}, key=len, reverse=True)
            self._special_pattern = re.compile("|".join(map(re.escape, alternatives)))
        return self._special_pattern

    def _plain_backend(self) -> tokenizers.Tokenizer:
        """A copy of the backend that encodes special-token text as ordinary text."""
        if self._plain is None:
            plain = tokenizers.Tokenizer.from_str(self.backend.to_str())
            plain.encode_special_tokens = True
            self._plain = plain
        return self._plain

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else self.backend.id_to_token(token_id)

    def __repr__(self) -> str:
        return (f"Tokenizer({self.vocab_size=}, {self.bos_token_id=}, {self.eos_token_ids=}, "
                f"{self.add_bos_by_default=})").replace("self.", "")


def _byte_level_bpe(tokens: list[str], *, merges: list[str], token_types: list[int],
                    pre: str) -> tokenizers.Tokenizer:
    """A GPT-2-style byte-level BPE tokenizer from GGUF metadata."""
    alphabet = _bytes_to_unicode()
    letters = set(alphabet.values())

    def spelled(token: str) -> str:
        # Vocabulary entries are written in GPT-2's byte alphabet; the rare one written as
        # plain text is respelled so BPE can reach it.
        return token if set(token) <= letters else "".join(alphabet[b] for b in token.encode())

    vocab = {spelled(token): index for index, token in enumerate(tokens)}
    pairs = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep:
            raise CheckpointError(f"GGUF tokenizer.ggml.merges entry {merge!r} is not 'left right'")
        pairs.append((left, right))
    make_pre_tokenizer, ignore_merges = _GGUF_PRE_TOKENIZERS[pre]
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False,
                                              byte_fallback=False, ignore_merges=ignore_merges))
    backend.pre_tokenizer = make_pre_tokenizer()
    backend.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>) are special: matched whole in text, dropped by
    # decode(skip_special_tokens=True). User-defined ones are matched whole and kept.
    # A "control" token outside the byte alphabet is a llama.cpp mislabel, not a real token.
    backend.add_special_tokens([
        AddedToken(t, special=True, normalized=False)
        for t, kind in zip(tokens, token_types) if kind == _CONTROL and set(t) <= letters])
    backend.add_tokens([
        AddedToken(t, special=False, normalized=False)
        for t, kind in zip(tokens, token_types) if kind == _USER_DEFINED and set(t) <= letters])
    return backend


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (its BPE alphabet)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars)}


@functools.cache
def _unicode_to_bytes() -> dict[str, int]:
    return {char: byte for byte, char in _bytes_to_unicode().items()}


def _read_json(path: pathlib.Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _hf_chat_template(directory: pathlib.Path, tokenizer_config: dict) -> str | None:
    # transformers >= 4.48 writes the template to its own file.
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):   # named templates: [{"name": ..., "template": ...}]
        template = {t["name"]: t["template"] for t in template}.get("default")
    return template
