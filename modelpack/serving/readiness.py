"""When a served model is ready: t8 (the health endpoint answers) and t9 (a deterministic request
returns the expected tokens), recorded as events for ``modelpack timeline``.

A server that answers ``/health`` has weights in memory but may still serve the wrong ones (a
different version, a bad shard); t9 is the first moment its output is known right. The check is a
fixed greedy completion from prompt token ids (no tokenizer ambiguity), compared token by token
with the expected ids recorded from a trusted run (``DeterministicCheck.save``), or given by the
user. vLLM's OpenAI server is assumed: ``GET /health``, ``POST /v1/completions`` with
``return_tokens_as_token_ids``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import requests

from modelpack.errors import ReadinessError
from modelpack.events import EventLog, NullEventLog
from modelpack.files import atomic_write_bytes

MAX_CHECK_BYTES = 1024 * 1024


@dataclass(frozen=True)
class DeterministicCheck:
    """A greedy completion and the tokens it must return."""

    prompt_token_ids: list[int]
    expected_token_ids: list[int]
    max_tokens: int = 0  # 0: len(expected_token_ids)

    @property
    def tokens_wanted(self) -> int:
        return self.max_tokens or len(self.expected_token_ids)

    @classmethod
    def from_dict(cls, doc: Any, *, where: str = "check") -> DeterministicCheck:
        if not isinstance(doc, dict):
            raise ReadinessError(f"{where}: a check is a JSON object")
        prompt, expected = doc.get("prompt_token_ids"), doc.get("expected_token_ids")
        max_tokens = doc.get("max_tokens", 0)
        for name, ids in (("prompt_token_ids", prompt), ("expected_token_ids", expected)):
            if not isinstance(ids, list) or not ids or not all(_is_int(i) and i >= 0 for i in ids):
                raise ReadinessError(f"{where}: {name} must be a non-empty list of token ids")
        if not _is_int(max_tokens) or max_tokens < 0:
            raise ReadinessError(f"{where}: max_tokens must be a non-negative integer")
        assert isinstance(prompt, list) and isinstance(expected, list)
        return cls(list(prompt), list(expected), max_tokens)

    @classmethod
    def load(cls, path: str) -> DeterministicCheck:
        try:
            with open(path, "rb") as f:
                raw = f.read(MAX_CHECK_BYTES + 1)
        except OSError as exc:
            raise ReadinessError(f"{path}: cannot read the check: {exc.strerror or exc}") from exc
        if len(raw) > MAX_CHECK_BYTES:
            raise ReadinessError(f"{path}: larger than {MAX_CHECK_BYTES} bytes")
        try:
            doc = json.loads(raw)
        except ValueError as exc:
            raise ReadinessError(f"{path}: not JSON: {exc}") from exc
        return cls.from_dict(doc, where=path)

    def save(self, path: str) -> None:
        atomic_write_bytes(path, (json.dumps(asdict(self), indent=2) + "\n").encode())


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def wait_healthy(
    base_url: str,
    *,
    timeout: float,
    events: EventLog | None = None,
    start_id: str | None = None,
    interval: float = 0.1,
    alive: Callable[[], bool] | None = None,
    session: requests.Session | None = None,
) -> float:
    """Poll ``GET {base_url}/health`` until it answers 200; emits t8; returns its unix time.

    ``alive`` (e.g. ``lambda: proc.poll() is None``) stops the wait early when the server died,
    which is how a refused start (wrong digest, tampered blob) shows up here.
    """
    log = events or NullEventLog()
    http = session or requests.Session()
    deadline = time.monotonic() + timeout
    last = "no answer yet"
    url = base_url.rstrip("/") + "/health"
    while time.monotonic() < deadline:
        if alive is not None and not alive():
            log.emit(
                "serving.unhealthy", start_id=start_id, url=url, reason="server exited before it was healthy"
            )
            raise ReadinessError(f"{url}: the server exited before it answered ({last})")
        try:
            r = http.get(url, timeout=2)
            if r.status_code == 200:
                ts = time.time()
                log.emit("serving.healthy", ts=ts, stage="t8", start_id=start_id, url=url)
                return ts
            last = f"HTTP {r.status_code}"
        except requests.RequestException as exc:
            last = type(exc).__name__
        time.sleep(interval)
    log.emit("serving.unhealthy", start_id=start_id, url=url, reason=f"timeout after {timeout}s ({last})")
    raise ReadinessError(f"{url}: not healthy after {timeout} s ({last})")


def served_model(base_url: str, session: requests.Session | None = None) -> str:
    """The id of the (single) model the server serves."""
    http = session or requests.Session()
    r = http.get(base_url.rstrip("/") + "/v1/models", timeout=10)
    if r.status_code != 200:
        raise ReadinessError(f"{base_url}/v1/models: HTTP {r.status_code}")
    data = r.json().get("data") or []
    if not data:
        raise ReadinessError(f"{base_url}/v1/models: serves no model")
    return str(data[0]["id"])


@dataclass
class CheckResult:
    passed: bool
    token_ids: list[int]
    logprobs: list[float]
    duration_ms: float


def complete(
    base_url: str,
    prompt_token_ids: Sequence[int],
    max_tokens: int,
    *,
    model: str | None = None,
    session: requests.Session | None = None,
) -> tuple[list[int], list[float]]:
    """Greedy completion: (token ids, their logprobs)."""
    http = session or requests.Session()
    body = {
        "model": model or served_model(base_url, http),
        "prompt": list(prompt_token_ids),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "logprobs": 1,
        "ignore_eos": True,
        "return_tokens_as_token_ids": True,
    }
    r = http.post(base_url.rstrip("/") + "/v1/completions", json=body, timeout=120)
    if r.status_code != 200:
        raise ReadinessError(f"{base_url}/v1/completions: HTTP {r.status_code}: {r.text[:500]}")
    lp = r.json()["choices"][0]["logprobs"]
    ids = []
    for tok in lp["tokens"]:
        if not isinstance(tok, str) or not tok.startswith("token_id:"):
            raise ReadinessError(
                f"{base_url}: token {tok!r} is not 'token_id:N' (return_tokens_as_token_ids)"
            )
        ids.append(int(tok.split(":", 1)[1]))
    return ids, [float(x) for x in lp["token_logprobs"]]


def run_check(
    base_url: str,
    check: DeterministicCheck,
    *,
    events: EventLog | None = None,
    start_id: str | None = None,
    digest: str | None = None,
    model: str | None = None,
    session: requests.Session | None = None,
) -> CheckResult:
    """Send the check's request; emits t9 when the tokens match (``passed=False`` otherwise)."""
    log = events or NullEventLog()
    t = time.monotonic()
    ids, logprobs = complete(
        base_url, check.prompt_token_ids, check.tokens_wanted, model=model, session=session
    )
    ms = round((time.monotonic() - t) * 1000, 3)
    passed = ids[: len(check.expected_token_ids)] == check.expected_token_ids
    log.emit(
        "serving.check",
        stage="t9" if passed else None,
        start_id=start_id,
        digest=digest,
        passed=passed,
        duration_ms=ms,
        output_ids=ids,
        expected_ids=None if passed else check.expected_token_ids,
    )
    return CheckResult(passed, ids, logprobs, ms)
