"""Credentials never leave in an output: environment values, command lines and messages are redacted here.

One denylist for every output (meta files, findings.json, report.html, alerts, logs):

* a variable or option **named** like a credential (:data:`SECRET_NAME_RE`: tokens, secrets,
  passwords, keys, JWTs, OIDC, cookies, sessions, signatures, webhooks) loses its value;
* **values** that carry a credential whatever their name (:func:`redact_text`): a URL keeps only
  its scheme and host (user:password@, paths of webhook receivers and query tokens go), a JWT,
  an ``Authorization: Bearer/Basic`` value and tokens with a well-known prefix (Slack ``xox?-``,
  GitHub ``ghp_``, Hugging Face ``hf_``, AWS ``AKIA``, ``sk-``) are replaced by :data:`MASK`.

Inputs are bounded by their callers (an environment value is cut at 1,024 characters, an
argument at 4,096); no pattern nests a repetition.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

MASK = "<redacted>"

# Names of variables and options whose values are credentials. Underscore- or dash-delimited words, so that
# NCCL_IB_GID_INDEX or TORCH_KEYS_DIR-like names that merely contain "key" inside a word do not match.
SECRET_NAME_RE = re.compile(
    r"TOKEN|SECRET|PASSW|PASSPHRASE|CREDENTIAL|AUTH|JWT|OIDC|COOKIE|SESSION|PRIVATE|WEBHOOK|SIGNATURE"
    r"|(?:^|[_-])(?:API_?|ACCESS_?)?KEY(?:$|[_-])|(?:^|[_-])(?:SIG|PAT|PWD|CERT|DSN)(?:$|[_-])",
    re.IGNORECASE)

_URL_RE = re.compile(r"\b([a-zA-Z][a-zA-Z0-9+.-]{0,15})://([^\s/?#'\"<>]+)([^\s'\"<>]*)")
_JWT_RE = re.compile(r"\beyJ[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]*")
_AUTH_RE = re.compile(r"\b(Bearer|Basic|Token)\s+[A-Za-z0-9._~+/=-]{8,}", re.IGNORECASE)
_TOKEN_RE = re.compile(r"\b(?:xox[abposr]-[A-Za-z0-9-]{10,}|gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}"
                       r"|hf_[A-Za-z0-9]{20,}|AKIA[0-9A-Z]{16}|sk-[A-Za-z0-9_-]{20,})")


def _url(m: re.Match[str]) -> str:
    scheme, netloc, rest = m.group(1), m.group(2), m.group(3)
    host = netloc.rsplit("@", 1)[-1]
    return f"{scheme}://{host}" + ("/" + MASK if rest.strip("/") or "@" in netloc else "")


def redact_text(text: str) -> str:
    """``text`` with credentials in URLs, JWTs, authorization values and known tokens replaced by :data:`MASK`."""
    if not text:
        return text
    text = _URL_RE.sub(_url, text)
    text = _JWT_RE.sub(MASK, text)
    text = _AUTH_RE.sub(lambda m: f"{m.group(1)} {MASK}", text)
    return _TOKEN_RE.sub(MASK, text)


def secret_name(name: str) -> bool:
    """Whether a variable or option of this name holds a credential."""
    return bool(SECRET_NAME_RE.search(name))


def redact_value(name: str, value: str) -> str:
    """An environment value made safe to record: masked whole under a secret name, else :func:`redact_text`."""
    return MASK if secret_name(name) else redact_text(value)


def redact_argv(argv: Iterable[object]) -> list[str]:
    """A command line with option values that are credentials masked (``--token=X``, ``--api-key X``,
    ``PASSWORD=X``) and every argument passed through :func:`redact_text`."""
    out: list[str] = []
    hide_next = False
    for raw in argv:
        arg = str(raw)
        if hide_next:
            out.append(MASK)
            hide_next = False
            continue
        name, eq, _ = arg.partition("=")
        if eq and secret_name(name.lstrip("-")):
            out.append(f"{name}={MASK}")
        elif arg.startswith("-") and not eq and secret_name(arg.lstrip("-")):
            out.append(arg)
            hide_next = True
        else:
            out.append(redact_text(arg))
    return out
