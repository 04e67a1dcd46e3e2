"""What every HTTP request passes before routing: the API key first, then the body-size limit.

A plain ASGI middleware, so that nothing (routing, body parsing, validation) runs for a request
that is not authenticated, and no body above the limit is read, let alone parsed.
"""

from __future__ import annotations

import hashlib
import hmac
import json

from fluidserve.serve.protocol import error_body


class Gate:
    def __init__(self, app, api_key: str | None, protect_metrics: bool, max_body: int) -> None:
        self.app = app
        self.max_body = max_body
        self.protect_metrics = protect_metrics
        # Digests of equal length: the comparison takes the same time whatever the key given.
        self._key = None if api_key is None else hashlib.sha256(api_key.encode()).digest()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self._key is not None and self._protected(scope["path"]) and not self._authorized(scope):
            return await _reply(send, 401, "missing or invalid API key", "authentication_error",
                                [(b"www-authenticate", b"Bearer")])
        length = _header(scope, b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            return await _reply(send, 413, f"the request body exceeds the limit of"
                                f" {self.max_body} bytes", "request_too_large")
        body = bytearray()
        while True:  # read the body here, so that its size is known before anyone parses it
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body += msg.get("body", b"")
            if len(body) > self.max_body:
                return await _reply(send, 413, f"the request body exceeds the limit of"
                                    f" {self.max_body} bytes", "request_too_large")
            if not msg.get("more_body", False):
                break
        return await self.app(scope, _replay(bytes(body), receive), send)

    def _protected(self, path: str) -> bool:
        return path == "/v1" or path.startswith("/v1/") or (self.protect_metrics
                                                             and path == "/metrics")

    def _authorized(self, scope) -> bool:
        header = (_header(scope, b"authorization") or "").strip()
        scheme, _, token = header.partition(" ")
        given = hashlib.sha256(token.strip().encode()).digest()
        return hmac.compare_digest(given, self._key) and scheme.lower() == "bearer"


def _header(scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _replay(body: bytes, receive):
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # after the body: the disconnect, when it comes

    return replay


async def _reply(send, status: int, message: str, type_: str,
                 headers: list[tuple[bytes, bytes]] | None = None) -> None:
    payload = json.dumps(error_body(message, type_, code=status)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode()),
                            (b"connection", b"close"), *(headers or [])]})
    await send({"type": "http.response.body", "body": payload})
