"""Canonical JSON and SHA-256: the one way every file the tool writes is serialized and digested.

Two spellings, each used for one kind of file:
- `canonical_bytes`: documents (policy, certificate, manifest, inventory): sorted keys, indent 1, a trailing
  newline, so they diff well and the same content always gives the same bytes;
- `compact_json`: one corpus record or shard header per line: sorted keys, no spaces.
A document that carries its own "digest" (policy, certificate) is read back only when its bytes are exactly
the canonical bytes of its content, so a hand edit, even of white space, is refused by every reader alike.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from ...kernels.errors import InputError


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def canonical_bytes(obj: Any) -> bytes:
    """The serialization of a document: sorted keys, indent 1, trailing newline."""
    return (json.dumps(obj, sort_keys=True, indent=1) + "\n").encode()


def compact_json(obj: Any) -> str:
    """The serialization of a corpus line: sorted keys, no white space."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def content_digest(obj: Mapping[str, Any]) -> str:
    """SHA-256 of the canonical bytes of `obj` without its "digest" key."""
    return sha256(canonical_bytes({k: v for k, v in obj.items() if k != "digest"}))


def with_digest(obj: Mapping[str, Any]) -> dict[str, Any]:
    """`obj` plus "digest": the SHA-256 of its content (detects hand edits)."""
    return {**{k: v for k, v in obj.items() if k != "digest"}, "digest": content_digest(obj)}


def read_digested(data: bytes, where: str, fmt: str, what: str, writer: str) -> dict[str, Any]:
    """A document of format `fmt` that carries its own digest; InputError, one line naming `where`, unless it
    parses, has that format, its digest matches its content and its bytes are that content's canonical bytes."""
    try:
        obj = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InputError(f"{where}: not a JSON {what} file ({err})") from None
    if not isinstance(obj, dict) or obj.get("format") != fmt:
        raise InputError(f"{where}: not a {fmt} file")
    if obj.get("digest") != content_digest(obj):
        raise InputError(f"{where}: digest mismatch: the {what} was edited after `{writer}` wrote it")
    if canonical_bytes(obj) != data:
        raise InputError(f"{where}: not in canonical form: the {what} was edited after `{writer}` wrote it")
    return obj
