"""OpenAI's logprobs objects, from the TokenLogprobs the engine returns.

    /v1/completions        {"tokens": [str], "token_logprobs": [float | null],
                            "top_logprobs": [{token: logprob} | null], "text_offset": [int]}
    /v1/chat/completions   {"content": [{"token", "logprob", "bytes",
                                         "top_logprobs": [{"token", "logprob", "bytes"}]}]}

A token's text is its bytes (`Tokenizer.token_bytes`) decoded as UTF-8, a partial character
becoming U+FFFD as in vLLM; chat's `bytes` carries the exact bytes. Without a tokenizer a
token is named "token_id:<id>" (vLLM's return_tokens_as_token_ids).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from medha_jax.request import TokenLogprobs

# What OpenAI reports for a token of probability 0; JSON has no -Infinity.
MIN_LOGPROB = -9999.0


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


class TokenText:
    """Token id -> its text and bytes, remembered (the same ids recur in every top list)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._bytes: dict[int, bytes] = {}

    def bytes(self, token_id: int) -> bytes:
        raw = self._bytes.get(token_id)
        if raw is None:
            raw = (f"token_id:{token_id}".encode() if self._tokenizer is None
                   else self._tokenizer.token_bytes(token_id))
            self._bytes[token_id] = raw
        return raw

    def text(self, token_id: int) -> str:
        return self.bytes(token_id).decode("utf-8", errors="replace")


def completion_logprobs(token_ids: Sequence[int], entries: Sequence[TokenLogprobs | None],
                        texts: TokenText, text_offset: int = 0) -> dict:
    """The completions object of a run of tokens (the echoed prompt first, when echoed).

    entries: one per token; None (the first prompt token, which nothing predicts) gives
    null logprob and top. Each top dict holds the token itself besides its alternatives, so
    up to logprobs + 1 entries, as OpenAI's. text_offset: where the run starts in the
    choice's text (a stream's earlier chunks)."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries, strict=True):
        text = texts.text(token_id)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(_finite(entry.logprob))
        top = {texts.text(t): _finite(lp) for t, lp in entry.top}
        top.setdefault(text, _finite(entry.logprob))
        top_logprobs.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def chat_logprobs(entries: Sequence[TokenLogprobs], texts: TokenText) -> dict:
    """The chat object of generated tokens: each with its top_logprobs alternatives (as many
    as the request's top_logprobs)."""
    def item(token_id: int, logprob: float) -> dict:
        return {"token": texts.text(token_id), "logprob": _finite(logprob),
                "bytes": list(texts.bytes(token_id))}

    return {"content": [{**item(e.token_id, e.logprob),
                         "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]}
