"""Keep secrets out of run directories and logs.

Two complementary rules:

* **By key** (:func:`redact_config`): in a config mapping, the value of a key
  that names a secret (:func:`is_secret_key`: ``api_key``, ``hf_token``,
  ``password``, ``client_secret``, ``WANDB_API_KEY``, ...) is replaced by
  :data:`REDACTED`, at any depth; other strings lose passwords in URLs and
  well-known token formats. What is written as ``config.yaml`` or sent to W&B
  as the run's config goes through it.
* **By value** (:class:`Redactor`): every occurrence of a known secret value in
  free text (metrics, trace lane names, log lines, error messages) is replaced.
  Known secrets are the values found under secret keys of the run's config,
  the values of environment variables with secret names, well-known token
  formats (``hf_...``, ``sk-...``, ``ghp_...``, AWS key ids) and passwords in
  URLs (``scheme://user:PASSWORD@host``).

The key rule is deliberately narrower than "contains ``key`` or ``token``":
``max_new_tokens``, ``answer_key``, ``pad_token_id`` or ``token_env`` (the
*name* of the variable holding a token) are ordinary settings, and redacting
them would make ``config.yaml`` unusable for ``--resume``.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Iterable, Mapping
from typing import Any

#: what a redacted value is replaced with
REDACTED = "<redacted>"

#: values shorter than this are redacted by key but not searched for in free text (too likely to collide)
MIN_SECRET_CHARS = 8

# a key whose words include one of these names a secret wherever the word appears
_SECRET_WORDS = frozenset({
    "password", "passwd", "passphrase", "secret", "secrets", "credential", "credentials",
    "apikey", "accesskey", "secretkey", "privatekey", "authtoken", "accesstoken", "refreshtoken",
    "authorization", "cookie",
})
# ``..._token`` is a secret unless the token is a vocabulary entry (``pad_token``, ``eos_token``)
_VOCAB_TOKENS = frozenset({"pad", "bos", "eos", "unk", "sep", "cls", "mask", "start", "end", "stop", "special",
                           "image", "audio", "video", "placeholder"})
# ``..._key`` is a secret only when owned by one of these (``answer_key``, ``sort_key`` are not)
_KEY_OWNERS = frozenset({"api", "access", "secret", "private", "auth", "client", "signing", "encryption",
                         "license", "account", "session", "ssh", "master", "service", "wandb", "hf", "openai",
                         "anthropic", "aws", "azure", "gcp", "comet", "neptune", "mlflow"})
# a key ending in one of these says *where* a secret is, not what it is (``token_env``, ``api_key_file``)
_LOCATOR_WORDS = frozenset({"env", "var", "variable", "file", "path", "dir", "name", "id", "ids", "len",
                            "length", "count", "size", "limit", "type", "kind", "mode", "ttl", "expiry",
                            "expires"})

_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")

# well-known token formats, redacted wherever they appear
_TOKEN_PATTERNS = (
    r"(?<![A-Za-z0-9])hf_[A-Za-z0-9]{30,}",
    r"(?<![A-Za-z0-9])sk-[A-Za-z0-9_-]{20,}",
    r"(?<![A-Za-z0-9])gh[pousr]_[A-Za-z0-9]{30,}",
    r"(?<![A-Za-z0-9])github_pat_[A-Za-z0-9_]{30,}",
    r"(?<![A-Za-z0-9])xox[abprs]-[A-Za-z0-9-]{10,}",
    r"(?<![A-Z0-9])AKIA[0-9A-Z]{16}(?![A-Z0-9])",
)
_URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]+:)[^/\s@]+(?=@)")


def _words(key: str) -> list[str]:
    return [w.lower() for w in _WORD.findall(key)]


def is_secret_key(key: str) -> bool:
    """Whether a config key or environment variable name names a secret (see the module docstring)."""
    words = _words(str(key))
    if not words:
        return False
    last = words[-1]
    if last in _LOCATOR_WORDS:
        return False
    if any(w in _SECRET_WORDS for w in words):
        return True
    if last in ("token", "auth"):
        return len(words) == 1 or words[-2] not in _VOCAB_TOKENS
    if last == "key":
        return len(words) >= 2 and words[-2] in _KEY_OWNERS
    return False


def _redact_leaves(value: Any) -> Any:
    """A secret key's value: every leaf that holds something becomes :data:`REDACTED`."""
    if isinstance(value, Mapping):
        return {k: _redact_leaves(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_redact_leaves(v) for v in value]
    if value is None or isinstance(value, bool) or value == "":
        return value  # "unset" / a switch tells nothing
    return REDACTED


def redact_config(config: Any) -> Any:
    """A copy of ``config`` (mappings and lists, e.g. ``model_dump(mode="json")``) with its secrets redacted.

    Values under secret keys become :data:`REDACTED`; other strings keep all
    but URL passwords and well-known token formats.
    """
    if isinstance(config, Mapping):
        return {k: _redact_leaves(v) if is_secret_key(str(k)) else redact_config(v) for k, v in config.items()}
    if isinstance(config, (list, tuple)):
        return [redact_config(v) for v in config]
    if isinstance(config, str):
        return _FORMATS.text(config)
    return config


def redacted_paths(config: Any, prefix: str = "") -> list[str]:
    """Dotted paths of the values in ``config`` that are :data:`REDACTED` (e.g. in a run's saved ``config.yaml``)."""
    out: list[str] = []
    if isinstance(config, Mapping):
        for k, v in config.items():
            out += redacted_paths(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(config, (list, tuple)):
        for i, v in enumerate(config):
            out += redacted_paths(v, f"{prefix}[{i}]")
    elif isinstance(config, str) and REDACTED in config:
        out.append(prefix)
    return out


def secret_values(config: Any) -> set[str]:
    """The string forms of every value under a secret key of ``config`` (at any depth)."""
    found: set[str] = set()

    def leaves(value: Any) -> None:
        if isinstance(value, Mapping):
            for v in value.values():
                leaves(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                leaves(v)
        elif value is not None and not isinstance(value, bool) and value != "":
            found.add(str(value))

    def walk(value: Any) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                leaves(v) if is_secret_key(str(k)) else walk(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)

    walk(config)
    return found


def environ_secrets(environ: Mapping[str, str] | None = None) -> set[str]:
    """Values of the environment variables whose names name a secret (``WANDB_API_KEY``, ``HF_TOKEN``, ...)."""
    env = os.environ if environ is None else environ
    return {v for k, v in env.items() if v and is_secret_key(k)}


class Redactor:
    """Replaces known secret values (and well-known token formats) in text and nested values.

    Thread-safe; :meth:`learn` adds secrets while others redact.
    """

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        self._lock = threading.Lock()
        self._secrets: set[str] = set()
        self._pattern: re.Pattern[str] | None = None
        self.add(secrets)

    @classmethod
    def from_config(cls, config: Any = None, environ: Mapping[str, str] | None = None) -> Redactor:
        """Secrets under secret keys of ``config`` plus those of the environment."""
        return cls(secret_values(config) | environ_secrets(environ))

    def add(self, secrets: Iterable[str]) -> None:
        """Also redact these values (those shorter than :data:`MIN_SECRET_CHARS` are ignored in free text)."""
        new = {s for s in secrets if len(s) >= MIN_SECRET_CHARS and s not in REDACTED}
        with self._lock:
            if new - self._secrets:
                self._secrets |= new
                self._pattern = None

    def learn(self, config: Any) -> None:
        """Add the values under secret keys of ``config`` and of the current environment."""
        self.add(secret_values(config) | environ_secrets())

    def _compiled(self) -> re.Pattern[str]:
        with self._lock:
            if self._pattern is None:
                literal = [re.escape(s) for s in sorted(self._secrets, key=len, reverse=True)]
                self._pattern = re.compile("|".join([*literal, *_TOKEN_PATTERNS]))
            return self._pattern

    def text(self, text: str) -> str:
        """``text`` with every known secret (and URL password) replaced by :data:`REDACTED`."""
        if not text:
            return text
        text = self._compiled().sub(REDACTED, text)
        if "://" in text:
            text = _URL_PASSWORD.sub(lambda m: m.group("head") + REDACTED, text)
        return text

    def value(self, value: Any) -> Any:
        """A copy of a nested value: strings (keys included) through :meth:`text`, secret keys redacted."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, Mapping):
            return {self.text(k) if isinstance(k, str) else k:
                    _redact_leaves(v) if isinstance(k, str) and is_secret_key(k) else self.value(v)
                    for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.value(v) for v in value]
        return value


_FORMATS = Redactor()  # well-known token formats and URL passwords only
_DEFAULT: Redactor | None = None
_DEFAULT_LOCK = threading.Lock()


def default_redactor() -> Redactor:
    """The process's redactor: the environment's secrets, plus whatever runs have :meth:`~Redactor.learn`-ed."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = Redactor(environ_secrets())
        return _DEFAULT


_FACTORY_INSTALLED = False


def install_log_redaction(redactor: Redactor | None = None) -> None:
    """Redact every log record of this process when it is created, whatever handler writes it. Idempotent.

    The message (with its arguments) and any exception text are formatted
    once, through ``redactor`` (default: :func:`default_redactor`).
    """
    global _FACTORY_INSTALLED
    with _DEFAULT_LOCK:
        if _FACTORY_INSTALLED:
            return
        _FACTORY_INSTALLED = True
    previous = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        r = redactor or default_redactor()
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format string is logging's own error to report
            return record
        record.msg, record.args = r.text(message), None
        if record.exc_info and not record.exc_text:
            record.exc_text = r.text(logging.Formatter().formatException(record.exc_info))
        return record

    logging.setLogRecordFactory(factory)


__all__ = [
    "MIN_SECRET_CHARS", "REDACTED", "Redactor", "default_redactor", "environ_secrets", "install_log_redaction",
    "is_secret_key", "redact_config", "redacted_paths", "secret_values",
]
