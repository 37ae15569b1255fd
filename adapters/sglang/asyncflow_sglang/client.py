"""A small async HTTP client for an SGLang server: every failure becomes an EngineError naming the route.

Three kinds of failure, because callers treat them differently:

- :class:`ServerAnswerError`: the server answered 4xx/5xx (``status`` and the
  server's own message are kept). One request can fail this way alone.
- :class:`ServerTimeoutError`: no answer before the deadline.
- :class:`ServerUnreachableError`: no connection, or the connection broke
  (the server died or restarted). The whole engine is gone.

Every call has a deadline: ``timeout_s`` bounds the whole call (connecting,
sending, waiting, reading, and the one retry below), not each socket operation.

Keep-alive: SGLang serves HTTP with uvicorn, ``timeout_keep_alive`` =
``SGLANG_TIMEOUT_KEEP_ALIVE`` (5 s, 0.5.20 to 0.5.23): it closes a connection
idle that long. httpx keeps idle connections for 5 s by default, so a request
written onto a connection the server is closing at that moment is lost
(``ReadError`` / ``RemoteProtocolError``, no reply). Idle connections are
therefore dropped here after ``keepalive_s`` (below the server's), and the
calls that are idempotent on SGLang (:data:`IDEMPOTENT_ROUTES`, and every GET)
are sent once more on a fresh connection after such a transport error.
``/generate`` is not retried (a second send could run the request twice).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from asyncflow_core.errors import EngineError


class ServerError(EngineError):
    """A call to the SGLang server failed; ``route`` says which."""

    def __init__(self, message: str, *, route: str, status: int | None = None, detail: str = "") -> None:
        super().__init__(message)
        self.route = route
        self.status = status
        self.detail = detail


class ServerAnswerError(ServerError):
    """The server answered with an error status (``status``, ``detail`` = its message)."""


class ServerTimeoutError(ServerError):
    """The server did not answer in time."""


class ServerUnreachableError(ServerError):
    """No connection to the server, or it broke mid-call."""


#: Routes SGLang marks ``AuthLevel.ADMIN_OPTIONAL`` (``http_server.py``, 0.5.20 to 0.5.23) that this client calls:
#: a server started with ``--admin-api-key`` accepts only that key on them, and ``--api-key`` alone on the rest.
ADMIN_ROUTES = frozenset({
    "/abort_request", "/pause_generation", "/continue_generation", "/flush_cache",
    "/init_weights_update_group", "/destroy_weights_update_group", "/begin_weight_update", "/end_weight_update",
    "/update_weights_from_distributed", "/update_weights_from_tensor", "/update_weight_version",
    "/release_memory_occupation", "/resume_memory_occupation",
})


#: POST routes whose repetition leaves SGLang as one call would (0.5.20 to 0.5.23): a second abort of a rid is
#: ignored, abort_all / pause / continue / flush are states, not steps. Weight and memory routes are not here (a
#: second /resume_memory_occupation of a tag kills the server; a second /begin_weight_update is refused).
IDEMPOTENT_ROUTES = frozenset({"/abort_request", "/pause_generation", "/continue_generation", "/flush_cache"})

#: Transport errors after which a request may never have reached the server's handler (a connection it closed
#: as the request went out, or no connection): an idempotent call is sent once more
_RETRYABLE = (httpx.ConnectError, httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)


def auth_header(route: str, api_key: str | None, admin_api_key: str | None) -> dict[str, str]:
    """The Authorization header SGLang's ``decide_request_auth`` wants for ``route`` (empty when none)."""
    key = (admin_api_key or api_key) if route in ADMIN_ROUTES else api_key
    return {"Authorization": f"Bearer {key}"} if key else {}


class SGLangClient:
    """JSON over HTTP to one server. One connection pool; calls may run concurrently."""

    def __init__(
        self,
        base_url: str,
        *,
        connect_timeout_s: float,
        max_connections: int,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        keepalive_s: float = 2.0,
    ) -> None:
        self.base_url = base_url
        self._keys = (api_key, admin_api_key)
        # idle connections go before SGLang's 5 s keep-alive timeout closes them (see the module docstring)
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=min(max_connections, 64),
                              keepalive_expiry=keepalive_s)
        self._connect_timeout_s = connect_timeout_s
        # trust_env=False: never route loopback traffic through a proxy from the environment
        self._http = httpx.AsyncClient(base_url=base_url, limits=limits, trust_env=False)

    async def close(self) -> None:
        await self._http.aclose()

    async def get(self, route: str, *, timeout_s: float) -> Any:
        return await self._call("GET", route, None, timeout_s)

    async def post(self, route: str, payload: dict[str, Any] | None, *, timeout_s: float) -> Any:
        return await self._call("POST", route, payload, timeout_s)

    async def _call(self, method: str, route: str, payload: dict[str, Any] | None, timeout_s: float) -> Any:
        timeout = httpx.Timeout(timeout_s, connect=min(self._connect_timeout_s, timeout_s))
        where = f"{method} {self.base_url}{route}"
        headers = auth_header(route, *self._keys)
        attempts = 2 if method == "GET" or route in IDEMPOTENT_ROUTES else 1
        try:
            # one deadline for the whole call: httpx's timeouts bound each socket operation, not their sum
            async with asyncio.timeout(timeout_s):
                for attempt in range(1, attempts + 1):
                    try:
                        response = await self._http.request(method, route, json=payload, timeout=timeout,
                                                            headers=headers)
                        break
                    except _RETRYABLE:
                        if attempt == attempts:
                            raise
        except (httpx.TimeoutException, TimeoutError) as exc:
            raise ServerTimeoutError(
                f"SGLang server did not answer {where} within {timeout_s:g}s ({type(exc).__name__})", route=route
            ) from exc
        except httpx.TransportError as exc:
            tries = f" (tried {attempts} times)" if attempts > 1 else ""
            raise ServerUnreachableError(
                f"lost the SGLang server at {where}{tries}: {type(exc).__name__}: {exc or 'connection failed'}; "
                "is it running (check its log)?",
                route=route,
            ) from exc
        if response.status_code >= 400:
            detail = _message(response)
            raise ServerAnswerError(
                f"SGLang server answered {where} with {response.status_code}: {detail}",
                route=route,
                status=response.status_code,
                detail=detail,
            )
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError:
            return response.text


def _message(response: httpx.Response) -> str:
    """The server's own words: ``{"error": {"message": ...}}``, ``{"error": "..."}``, ``{"message": ...}`` or the
    body text."""
    text = response.text.strip()
    try:
        body = json.loads(text)
    except ValueError:
        return text[:500] or response.reason_phrase
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:500]
        if isinstance(err, str):
            return err[:500]
        if body.get("message"):
            return str(body["message"])[:500]
        if body.get("detail"):
            return str(body["detail"])[:500]
    return text[:500]
