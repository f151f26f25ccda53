"""What one HTTP request may cost ``dsi serve`` before it reaches the engine: its body.

:class:`BodyLimit` is a pure ASGI middleware that refuses a body over ``max_bytes`` with 413:
at once from its ``Content-Length`` header, before reading any of it (a client that sent
``Expect: 100-continue`` never uploads it), and for a chunked body by counting its bytes as they
arrive, so that no more than ``max_bytes`` is ever held. The endpoints read bodies with
:func:`read_body` (one buffer of the declared size, no list of chunks to join) and check the content type with
:func:`check_json_content_type`.

Does not know: the endpoints, or what a body means.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi.responses import JSONResponse

from dsi.server.protocol import APIError

# The largest legitimate body is a prompt that fills the context: 128k tokens of text is about
# 0.5 MB, or 3 MB if every character is JSON-escaped (\uXXXX); a token-id prompt of 1M ids is
# about 7 MB. 16 MiB leaves room for that and bounds what a request can make the server hold.
DEFAULT_MAX_BODY_BYTES = 16 * 2**20

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class BodyTooLarge(APIError):
    """413: the request body is over the server's limit."""

    def __init__(self, limit: int, size: int | None = None) -> None:
        what = "the request body" if size is None else f"the request body of {size} bytes"
        super().__init__(413, f"{what} exceeds this server's limit of {limit} bytes (dsi serve --max-body-bytes)",
                         code="request_too_large")


def content_length(scope: Scope) -> int | None:
    """The request's declared body size (None: not given, or malformed)."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP server answers a malformed length itself
    return None


class BodyLimit:
    """Pure ASGI middleware: bodies over ``max_bytes`` are answered 413 without being read.

    ``on_reject(scope, status)`` is called for each request refused from its header (the
    endpoints never see those); a chunked body over the limit makes the app's ``receive`` raise
    :class:`BodyTooLarge`, which the app answers (or, if it does not, this middleware does).
    """

    def __init__(self, app: ASGIApp, max_bytes: int,
                 on_reject: Callable[[Scope, int], None] | None = None) -> None:
        if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 1:
            raise ValueError(f"max_bytes={max_bytes!r} must be an integer >= 1")
        self.app = app
        self.max_bytes = max_bytes
        self.on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = content_length(scope)
        if length is not None and length > self.max_bytes:
            await self._refuse(BodyTooLarge(self.max_bytes, length), scope, receive, send)
            return
        received = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge as exc:
            if started:
                raise
            await self._refuse(exc, scope, receive, send)

    async def _refuse(self, error: BodyTooLarge, scope: Scope, receive: Receive, send: Send) -> None:
        if self.on_reject is not None:
            self.on_reject(scope, error.status)
        await JSONResponse(error.body(), status_code=error.status)(scope, receive, send)


async def read_body(receive: Receive, size: int | None = None) -> bytearray:
    """The whole request body, in one buffer; a client that leaves first is a 499.

    With the declared ``size`` (Content-Length, already within the limit) the buffer is allocated
    once at that size and filled in place: a growing buffer would be copied as it grows, which
    at least doubles a large body's peak memory."""
    if size is not None and size > 0:
        body = bytearray(size)
        view, filled = memoryview(body), 0
        try:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise APIError(499, "client closed the request", code="client_closed_request")
                chunk = message.get("body", b"")
                if filled + len(chunk) > size:  # more than declared: the HTTP server should not let it in
                    raise APIError(400, f"the request body is longer than its Content-Length of {size} bytes",
                                   code="invalid_request")
                view[filled: filled + len(chunk)] = chunk
                filled += len(chunk)
                if not message.get("more_body", False):
                    break
        finally:
            view.release()
        del body[filled:]  # a shorter body than declared (the HTTP server normally refuses it)
        return body
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise APIError(499, "client closed the request", code="client_closed_request")
        body += message.get("body", b"")
        if not message.get("more_body", False):
            return body


def check_json_content_type(content_type: str | None) -> None:
    """415 unless the body is declared JSON (``application/json`` or ``*/*+json``) or not declared.

    A browser may send ``text/plain`` or form bodies to any origin without asking first (CORS
    "simple requests"), so refusing them keeps web pages from driving a server on loopback.
    """
    if content_type is None:
        return
    media = content_type.split(";", 1)[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise APIError(415, f"Content-Type {content_type!r} is not supported: send the body as JSON with "
                            "'Content-Type: application/json'", code="unsupported_media_type")
