"""One redaction step for everything that leaves tracerl: spans, trajectories, errors, logs.

Why one step: a key reaches an exported trace or a written file through many doors (a
header an instrumentor records in ``llm.invocation_parameters``, an error body that echoes
the ``Authorization`` header into an exception event, a tool result, a log line), and each
door patched on its own is a door forgotten.  So every outbound path calls :func:`redact`
(nested data) or :func:`redact_text` (one string), and they all apply the same rules:

- **sensitive names**: a dict key, header or ``key=value`` / ``"key": "value"`` pair named
  ``authorization``, ``api_key`` / ``api-key`` / ``x-api-key``, ``access_token``, ``password``,
  ``client_secret``... (:func:`is_sensitive_key`) has its value replaced;
- **known key shapes** anywhere in text: ``sk-…`` (OpenAI, ``sk-proj-``, Anthropic ``sk-ant-``),
  Langfuse ``pk-lf-…`` / ``sk-lf-…``, ``Bearer …`` / ``Basic …`` credentials, AWS access key ids,
  Google API keys and OAuth tokens, Hugging Face, GitHub, Slack, Groq tokens;
- **registered secrets**: exact values given to :func:`register_secret` (tracerl registers its
  serve token and internal server keys), the values of environment variables whose names say
  they hold one (``*_API_KEY``, ``*_TOKEN``, ``*_SECRET``, ``*_PASSWORD``...), and extra
  patterns given to :func:`register_pattern`.

Redaction runs where data leaves (the exporter thread, the end of a rollout, an exception
becoming an :class:`~tracerl.ExceptionRecord`, a log record), not on the agent's call path.
This module imports only the standard library.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import threading
from collections import OrderedDict
from typing import Any, Iterable

__all__ = [
    "REDACTED",
    "RedactingLogFilter",
    "install_log_filter",
    "is_sensitive_key",
    "redact",
    "redact_message",
    "redact_text",
    "register_pattern",
    "register_secret",
    "scan_environment",
]

REDACTED = "[REDACTED]"
MIN_SECRET_LENGTH = 8
"""Shorter registered values are ignored: redacting ``"x"`` or ``"tracerl"`` everywhere would wreck text."""
MAX_REGISTERED = 10_000
"""Registered secrets and patterns are bounded (oldest secrets are forgotten first)."""

# Names whose value is a credential, compared lower-cased with '-' and ' ' read as '_'.
_SENSITIVE_NAMES = frozenset(
    {
        "authorization", "proxy_authorization", "api_key", "apikey", "x_api_key", "api_token", "access_token",
        "auth_token", "bearer_token", "refresh_token", "id_token", "session_token", "secret", "secret_key",
        "client_secret", "password", "passwd", "private_key", "x_goog_api_key", "cookie", "set_cookie",
        "x_amz_security_token", "aws_secret_access_key", "aws_session_token",
    }
)  # fmt: skip
_SENSITIVE_SUFFIXES = ("_api_key", "_apikey", "_secret", "_secret_key", "_password", "_access_token", "_auth_token")

_NAME = (
    r"(?:(?:x[-_])?api[-_ ]?key|(?:proxy[-_])?authorization|x[-_]goog[-_]api[-_]key|(?:api|access|auth|bearer|refresh|"
    r"session|id)[-_]token|client[-_]secret|secret[-_]key|password|passwd|private[-_]key|aws[-_]secret[-_]access[-_]key)"
)
# (literal triggers, lower-cased; pattern).  A rule runs only on text that holds one of its
# triggers (``in`` on the lower-cased text is far faster than any regex alternation), and the
# "not right after a letter or digit" boundary is checked on each match, not in the regex, so
# every pattern starts with a literal and the regex engine can skip ahead.
_RULES: tuple[tuple[tuple[str, ...], str], ...] = (
    (("sk-lf-", "pk-lf-"), r"[sp]k-lf-[A-Za-z0-9-]{8,}"),  # Langfuse public / secret keys
    (("sk-",), r"sk-(?:proj-|ant-|svcacct-|admin-)?[A-Za-z0-9_-]{16,}"),  # OpenAI, Anthropic, DeepSeek...
    (("bearer",), r"(?P<prefix>[Bb]earer\s+)(?=[A-Za-z0-9._~+/=-]*[0-9._~+/=-])[A-Za-z0-9._~+/-]{8,}=*"),
    (("basic",), r"(?P<prefix>Basic\s+)(?=[A-Za-z0-9+/]*[0-9+/])[A-Za-z0-9+/]{8,}={0,2}"),
    (("akia", "asia", "abia", "acca"), r"(?:AKIA|ASIA|ABIA|ACCA)[0-9A-Z]{16}(?![A-Za-z0-9])"),  # AWS access key ids
    (("aiza",), r"AIza[0-9A-Za-z_-]{35}"),  # Google API keys
    (("ya29.",), r"ya29\.[0-9A-Za-z_-]{20,}"),  # Google OAuth access tokens
    (("hf_",), r"hf_[A-Za-z0-9]{30,}"),  # Hugging Face
    (("ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_"), r"(?:gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,})"),
    (("xox",), r"xox[abprs]-[A-Za-z0-9-]{10,}"),  # Slack
    (("gsk_",), r"gsk_[A-Za-z0-9]{20,}"),  # Groq
)
_COMPILED_RULES = tuple((triggers, re.compile(pattern)) for triggers, pattern in _RULES)

# key = value, "key": "value", 'key': 'value', key: value (headers), ?key=value (query strings).
# Found on the lower-cased text by the name's last word and the separator (a short alternation
# the regex engine scans fast), then the whole name is checked just before the separator.
_NAMED_TRIGGERS = ("key", "authoriz", "token", "secret", "passw")
_NAMED_VALUE = (
    r"(?:key|authorization|token|secret|passw(?:or)?d)(?P<sep>\\*[\"']?\s*[:=]\s*\\*[\"']?)"
    r"(?:(?:bearer|basic|token)\s+)?(?P<value>[^\s\"'\\,;}&)\]]{4,})"
)
_NAMED_LOWER = re.compile(_NAMED_VALUE)
_NAMED_ANY_CASE = re.compile(_NAMED_VALUE, re.IGNORECASE)
_NAME_AT_END = re.compile(rf"(?i:{_NAME})$")
_ALL_TRIGGERS = tuple(sorted({*_NAMED_TRIGGERS, *(t for ts, _ in _RULES for t in ts)}))
"""Every rule's trigger: text containing none of them (lower-cased) needs no rule run."""


_ANY_TRIGGER = re.compile("|".join(map(re.escape, _ALL_TRIGGERS)))
_SHORT_TEXT = 48
"""Up to this length one regex search beats a loop of substring searches (an id: 0.4 against 1.0 µs)."""


def _has_trigger(lower: str) -> bool:
    """Whether the lower-cased text contains any trigger.  One substring search per trigger:
    measured 1.1 µs on an 84-character message and 25 µs on 2,000 characters, where a regex
    alternation of the same literals took 2.3 and 142 µs (Python's ``re`` tries every branch at
    every position); on short texts (ids, names) the regex's one call wins."""
    if len(lower) <= _SHORT_TEXT:
        return _ANY_TRIGGER.search(lower) is not None
    for trigger in _ALL_TRIGGERS:
        if trigger in lower:
            return True
    return False
_ENV_NAME = re.compile(r"(?:^|_)(?:API_?KEY|KEY|TOKEN|SECRET|SECRET_KEY|PASSWORD|PASSWD|ACCESS_KEY|PRIVATE_KEY)$")
_NOT_SECRETS = frozenset({"true", "false", "none", "null", "1", "0", "yes", "no"})

_lock = threading.Lock()
_secrets: dict[str, None] = {}  # insertion-ordered set
_secrets_by_length: tuple[str, ...] = ()
_patterns: list[re.Pattern[str]] = []
_environment_scanned = False
_recent: OrderedDict[str, str | None] = OrderedDict()
"""Recently redacted texts -> their redacted form (None: clean).  An agent's texts recur (the system
prompt, tool descriptions, a task's prompt in every rollout of its group), and each costs a scan
for every secret and trigger; emptied whenever a secret or pattern is registered.  An
``OrderedDict``: dropping the oldest of a full plain dict (``del d[next(iter(d))]``) walks past
every slot deleted before it, 2.2 µs per new text once full (measured), where ``popitem`` is O(1)."""
RECENT_TEXTS = 4096
RECENT_TEXT_LENGTH = 4096
"""Only texts up to this length are remembered (at most ~16 MB held)."""


@functools.lru_cache(maxsize=4096)
def _sensitive_name(name: str) -> bool:
    key = name.rsplit(".", 1)[-1].strip().lower().replace("-", "_").replace(" ", "_")
    return key in _SENSITIVE_NAMES or key.endswith(_SENSITIVE_SUFFIXES)


def is_sensitive_key(name: Any) -> bool:
    """Whether a dict key, header or attribute name holds a credential (its value is redacted).

    The last dotted segment is what counts, so ``http.request.header.authorization`` is
    sensitive as well as ``Authorization``, ``x-api-key`` and ``openai_api_key``.
    """
    return isinstance(name, str) and _sensitive_name(name)


def register_secret(*values: str | None) -> None:
    """Redact these exact values wherever they appear (serve tokens, keys of unknown shape).

    Values shorter than :data:`MIN_SECRET_LENGTH` characters or ``None`` are ignored.
    """
    global _secrets_by_length
    fresh = [v for v in values if isinstance(v, str) and len(v.strip()) >= MIN_SECRET_LENGTH and v not in _secrets]
    if not fresh:
        return
    with _lock:
        for value in fresh:
            _secrets[value] = None
        while len(_secrets) > MAX_REGISTERED:
            del _secrets[next(iter(_secrets))]
        _secrets_by_length = tuple(sorted(_secrets, key=len, reverse=True))  # longest first: no partial leftovers
        _recent.clear()


def register_pattern(pattern: str | re.Pattern[str]) -> None:
    """Redact every match of a regular expression too (e.g. an in-house token format)."""
    compiled = pattern if isinstance(pattern, re.Pattern) else re.compile(pattern)  # a bad one fails here
    if compiled.groupindex:
        raise ValueError(f"register_pattern({compiled.pattern!r}): use unnamed groups, (?:...) or (...)")
    with _lock:
        if compiled not in _patterns and len(_patterns) < MAX_REGISTERED:
            _patterns.append(compiled)
            _recent.clear()


def scan_environment(environ: Any = None) -> None:
    """Register the values of environment variables named like secrets (``OPENAI_API_KEY``,
    ``HF_TOKEN``, ``LANGFUSE_SECRET_KEY``, ``TRACERL_SERVE_TOKEN``...).  Runs once by itself on
    first use; call again after setting such variables later in the process."""
    global _environment_scanned
    environ = os.environ if environ is None else environ
    _environment_scanned = True
    register_secret(
        *(v for k, v in environ.items() if _ENV_NAME.search(k.upper()) and v.strip().lower() not in _NOT_SECRETS)
    )


def _replace(match: re.Match[str]) -> str:
    start = match.start()
    if start and match.string[start - 1].isalnum():  # inside a longer word ("desk-…"): not a key
        return match.group(0)
    return f"{match.groupdict().get('prefix') or ''}{REDACTED}"


def _redact_named(text: str, lower: str) -> str:
    """Values after sensitive names (``api_key=…``, ``"Authorization": "Bearer …"``)."""
    aligned = len(lower) == len(text)  # lower() keeps indices for all but a few non-ASCII letters
    source, pattern = (lower, _NAMED_LOWER) if aligned else (text, _NAMED_ANY_CASE)
    pieces: list[str] = []
    last = 0
    for match in pattern.finditer(source):
        name_end = match.start("sep")
        window = source[max(0, name_end - 48) : name_end]
        name = _NAME_AT_END.search(window)
        if name is None:
            continue
        name_start = name_end - len(window) + name.start()
        if name_start and source[name_start - 1].isalnum():
            continue
        start, end = match.span("value")
        pieces += (text[last:start], REDACTED)
        last = end
    if not pieces:
        return text
    pieces.append(text[last:])
    return "".join(pieces)


def redact_text(text: str) -> str:
    """``text`` with every credential replaced by :data:`REDACTED` (the same object when clean)."""
    if not isinstance(text, str) or (len(text) < MIN_SECRET_LENGTH and not _patterns):
        return text  # nothing that short is a key (ids, roles, numbers: most strings of a trajectory)
    if not _environment_scanned:
        scan_environment()
    known = _recent.get(text, text)
    if known is not text:
        return text if known is None else known
    original = text
    for secret in _secrets_by_length:
        if secret in text:
            text = text.replace(secret, REDACTED)
    lower = text.lower()
    if _has_trigger(lower):
        text = _redact_rules(text, lower)
    for pattern in _patterns:
        text = pattern.sub(REDACTED, text)
    if len(original) <= RECENT_TEXT_LENGTH:
        if len(_recent) >= RECENT_TEXTS:
            try:
                _recent.popitem(last=False)  # the oldest
            except KeyError:  # another thread emptied it meanwhile
                pass
        _recent[original] = None if text == original else text
    return original if text == original else text


def _redact_rules(text: str, lower: str) -> str:
    if any(trigger in lower for trigger in _NAMED_TRIGGERS):
        text = _redact_named(text, lower)
        lower = text.lower()
    for triggers, pattern in _COMPILED_RULES:
        if any(trigger in lower for trigger in triggers):
            clean = pattern.sub(_replace, text)
            text = text if clean == text else clean  # unchanged text stays the same object
    return text


_PLAIN = frozenset({int, float, bool, type(None)})
_PLAIN_KEYS = frozenset(
    {
        "role", "content", "name", "type", "text", "id", "index", "tool_calls", "tool_call_id", "function",
        "arguments", "description", "parameters", "properties", "required", "items", "enum", "title", "default",
        "finish_reason", "refusal", "image_url", "url", "detail", "strict", "additionalProperties", "format",
    }
)  # fmt: skip
"""Keys of chat messages and tool schemas: none is a credential's name (checked below), so the walk
skips :func:`is_sensitive_key` for them (most keys of a trajectory)."""
assert not any(_sensitive_name(key) for key in _PLAIN_KEYS)


def _clean_text(text: str) -> str:
    """:func:`redact_text` for a string met in :func:`redact`, answering a remembered text inline."""
    if len(text) < MIN_SECRET_LENGTH and not _patterns:
        return text
    known = _recent.get(text, text)
    if known is text:
        return redact_text(text)
    return text if known is None else known


def redact(value: Any, _depth: int = 0) -> Any:
    """A copy of ``value`` (dicts, lists, tuples, strings; other values as they are) with credentials
    redacted: values under sensitive keys, and matches in every string.  Unchanged parts are shared,
    and an unchanged value is returned as the same object (copied only where something changed:
    a trajectory is redacted at every rollout end and is nearly always clean)."""
    kind = value.__class__
    if kind is str:
        return redact_text(value)
    if _depth > 64 or kind in _PLAIN:
        return value
    if isinstance(value, dict):
        out: dict[Any, Any] | None = None
        for key, item in value.items():
            item_kind = item.__class__
            if key not in _PLAIN_KEYS and is_sensitive_key(key) and item not in (None, ""):
                new = REDACTED
            elif item_kind is str:
                if len(item) < MIN_SECRET_LENGTH and not _patterns:
                    continue  # roles, short names: nothing that short is a key
                new = _clean_text(item)
            elif item_kind in _PLAIN:
                continue
            else:
                new = redact(item, _depth + 1)
            if new is not item:
                if out is None:
                    out = dict(value)
                out[key] = new
        return value if out is None else out
    if isinstance(value, (list, tuple)):
        copy: list[Any] | None = None
        for index, item in enumerate(value):
            item_kind = item.__class__
            if item_kind is str:
                new = _clean_text(item)
            elif item_kind in _PLAIN:
                continue
            else:
                new = redact(item, _depth + 1)
            if new is not item:
                if copy is None:
                    copy = list(value)
                copy[index] = new
        if copy is None:
            return value
        return copy if isinstance(value, list) else tuple(copy)
    if isinstance(value, str):  # a str subclass
        return redact_text(value)
    return value


_MESSAGE_TEXT_KEYS = frozenset({"role", "content", "name", "tool_call_id", "refusal"})
_CALL_KEYS = frozenset({"id", "type"})
_FUNCTION_KEYS = frozenset({"name", "arguments"})


def _text_clean(text: str) -> bool:
    """Whether :func:`redact_text` leaves ``text`` as it is (a remembered answer costs one lookup)."""
    if len(text) < MIN_SECRET_LENGTH:
        return True  # callers check ``_patterns`` first
    known = _recent.get(text, text)
    if known is None:
        return True
    return known is text and redact_text(text) is text


def redact_message(message: Any) -> Any:
    """:func:`redact` for one chat message, the same answer; the usual shape is checked in one frame.

    Why: a trajectory is redacted at every rollout end and its messages are nearly always
    clean, but the generic walk makes a call per dict, list and string (an assistant turn with
    one tool call: seven), which was most of the redaction's cost.  Here a text message and an
    assistant turn's tool calls (``{"id", "type", "function": {"name", "arguments"}}``) are
    read inline; the answer "unchanged" is given only when every string is clean, and anything
    else (another key or shape, a string that needs redacting, registered patterns) goes to
    :func:`redact` itself.
    """
    if message.__class__ is not dict or _patterns:
        return redact(message)
    texts: list[str] = []  # every string of the message, checked in one loop below
    for key, item in message.items():
        kind = item.__class__
        if kind is str:
            if key not in _MESSAGE_TEXT_KEYS:
                return redact(message)
            texts.append(item)
        elif key == "tool_calls" and kind is list:
            for call in item:
                if call.__class__ is not dict:
                    return redact(message)
                for call_key, value in call.items():
                    if value.__class__ is str:
                        if call_key not in _CALL_KEYS:
                            return redact(message)
                        texts.append(value)
                    elif call_key == "function" and value.__class__ is dict:
                        for function_key, text in value.items():
                            if function_key not in _FUNCTION_KEYS or (text.__class__ is not str and text is not None):
                                return redact(message)
                            if text is not None:
                                texts.append(text)
                    elif value is not None:
                        return redact(message)
        elif item is not None or key not in _PLAIN_KEYS:
            return redact(message)
    recent = _recent
    for text in texts:  # :func:`_text_clean` inline for the usual answers: short, or remembered clean
        if len(text) >= MIN_SECRET_LENGTH and recent.get(text, text) is not None and not _text_clean(text):
            return redact(message)
    return message


class RedactingLogFilter(logging.Filter):
    """Redacts a record's message, arguments and traceback text (attached to tracerl's loggers)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
            clean = redact_text(message)
            if clean is not message or record.args:
                record.msg, record.args = clean, None
            if record.exc_info and not record.exc_text:
                record.exc_text = redact_text(logging.Formatter().formatException(record.exc_info))
            if record.stack_info:
                record.stack_info = redact_text(record.stack_info)
        except Exception:  # noqa: BLE001 - a log call must never fail because of redaction
            pass
        return True


LOGGERS = (
    "tracerl", "tracerl.integrations", "tracerl.serve", "tracerl.train", "tracerl.router", "tracerl.ruler", "tracerl.mcp_rl", "tracerl.inference.engine", "tracerl.pipeline", "tracerl.tinker", "tracerl.tinker.usage"
)  # fmt: skip
"""The loggers tracerl writes to (a logger filter sees only records logged on that logger)."""
_filter = RedactingLogFilter()


def install_log_filter(names: Iterable[str] = LOGGERS) -> None:
    """Attach the redacting filter to tracerl's loggers and any other ``tracerl.*`` logger (idempotent)."""
    existing = [n for n in logging.root.manager.loggerDict if n.startswith("tracerl")]
    for name in {*names, *existing}:
        logger = logging.getLogger(name)
        if _filter not in logger.filters:
            logger.addFilter(_filter)
