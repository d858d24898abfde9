"""Who may use a network front end, and who may raise a request's priority.

Two roles, each named by a bearer token (`Authorization: Bearer <token>`, HTTP header or gRPC
metadata): `token` admits a client; a `priority_token` admits it too and also lets it ask
for a priority class more important than the default (Request.priority < 0), which a
client without one is refused (gRPC PERMISSION_DENIED, HTTP 403). Without `token` the
server admits everyone, but raising priority still needs a priority token: otherwise any
client could put itself ahead of every other (vLLM and SGLang gate priority scheduling
behind a server flag the same way). The Python API (`Server.submit`) is the operator's own
code and is not gated.
"""

from __future__ import annotations

import dataclasses
import hmac
from collections.abc import Iterable


@dataclasses.dataclass(frozen=True)
class Access:
    token: str | None = None
    priority_tokens: tuple[str, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "priority_tokens", tuple(self.priority_tokens))
        for name, value in [("token", self.token)] + [
                (f"priority_tokens[{i}]", t) for i, t in enumerate(self.priority_tokens)]:
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")

    @classmethod
    def of(cls, token: str | None, priority_tokens: Iterable[str] | None = None) -> "Access":
        return cls(token, tuple(priority_tokens or ()))

    def admits(self, authorization: str) -> bool:
        """Whether a client sending this Authorization value may call at all."""
        if self.token is None:
            return True
        return _matches(authorization, (self.token,) + self.priority_tokens)

    def may_raise_priority(self, authorization: str) -> bool:
        return bool(self.priority_tokens) and _matches(authorization, self.priority_tokens)


def _matches(authorization: str, tokens: Iterable[str]) -> bool:
    given = authorization.encode()
    # Every token compared, in constant time each, so timing tells nothing about which.
    return any([hmac.compare_digest(given, f"Bearer {t}".encode()) for t in tokens])
