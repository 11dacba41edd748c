"""The API's outer layer, pure ASGI, run before any route, dependency or body parser: a body over its cap is
refused (413) from its Content-Length or as soon as the bytes streamed pass the cap, and a request without a live
key is refused (401) before a byte of its body is read. A tenant has at most UPLOADS_PER_TENANT uploads in flight
in this process (429 beyond, before the body is read), and a body that stalls for BODY_IDLE_S, or takes longer
than BODY_TOTAL_S in all, is cut (408). The tenant goes to the routes as `request.state.tenant`."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ingest.openai_api.objects import ApiError
from ingest.openai_api.quotas import NoSlot, TenantSlots

UPLOADS_PER_TENANT = 2
BODY_IDLE_S = 30.0  # no byte of the body for this long: a stalled or deliberately slow sender
BODY_TOTAL_S = 900.0  # a whole body (200 MiB at under 250 kB/s takes longer)


class BodyTooLarge(Exception):
    pass


class BodyTooSlow(Exception):
    pass


def too_slow() -> ApiError:
    return ApiError(408, f"the request body was not received in time (no byte for {BODY_IDLE_S:.0f} s, or over "
                         f"{BODY_TOTAL_S:.0f} s in all)", code="request_timeout")


def too_large(limit: int, flag: str) -> ApiError:
    return ApiError(413, f"request body is larger than the limit of {limit:,} bytes ({flag})",
                    code="request_too_large")


Render = Callable[[str, ApiError], tuple[dict[str, Any], dict[str, str]]]  # (path, error) -> (body, headers)


def openai_error(_path: str, error: ApiError) -> tuple[dict[str, Any], dict[str, str]]:
    return error.body(), {}


async def answer(send: Send, error: ApiError, path: str = "", render: Render = openai_error) -> None:
    shown, headers = render(path, error)
    body = json.dumps(shown).encode()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"),
                            *((name.encode(), value.encode()) for name, value in headers.items())]})
    await send({"type": "http.response.body", "body": body})


class RequestGuard:
    """`body_limit(method, path)` -> (cap in bytes, the flag that sets it); `authenticate(token)` -> the tenant of
    a live key or None (run in a thread: it reads the database); `is_upload(method, path)`: a request whose body is
    a batch's input (a file upload, a message batch); `render(path, error)`: the body and headers of an error in the
    words of the API that owns the path. The key is `x-api-key` (Anthropic's) or `Authorization: Bearer`."""

    def __init__(self, app: ASGIApp, body_limit: Callable[[str, str], tuple[int, str]],
                 authenticate: Callable[[str], str | None], is_upload: Callable[[str, str], bool],
                 render: Render = openai_error) -> None:
        self.app, self.body_limit, self.authenticate, self.is_upload = app, body_limit, authenticate, is_upload
        self.render = render
        self.uploads = TenantSlots(UPLOADS_PER_TENANT)  # a tenant's uploads in flight

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {name.lower(): value for name, value in scope["headers"]}
        limit, flag = self.body_limit(scope["method"], scope["path"])
        declared = headers.get(b"content-length", b"").strip()
        if declared and (not declared.isdigit() or int(declared) > limit):
            return await self._answer(send, scope, too_large(limit, flag))
        if (error := await self._authenticate(headers, scope)) is not None:
            return await self._answer(send, scope, error)
        if not self.is_upload(scope["method"], scope["path"]):
            return await self._guarded(scope, receive, send, limit, flag)
        try:
            with self.uploads.slot(scope["state"]["tenant"]):
                await self._guarded(scope, receive, send, limit, flag)
        except NoSlot:
            await self._answer(send, scope, ApiError(
                429, f"{UPLOADS_PER_TENANT} uploads (or message batches) of yours are in progress; retry once one "
                     f"ends", code="rate_limit_exceeded"))

    async def _guarded(self, scope: Scope, receive: Receive, send: Send, limit: int, flag: str) -> None:
        state: dict[str, Any] = {"received": 0, "over": False, "slow": False, "started": False, "whole": False}
        body_deadline = time.monotonic() + BODY_TOTAL_S

        async def counted_receive() -> Message:
            if state["whole"]:  # the body is in: what follows is a disconnect, however late
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, min(BODY_IDLE_S,
                                                                          body_deadline - time.monotonic())))
            except TimeoutError:
                state["slow"] = True
                raise BodyTooSlow() from None
            state["whole"] = message["type"] != "http.request" or not message.get("more_body", False)
            if message["type"] == "http.request":
                state["received"] += len(message.get("body", b""))
                if state["received"] > limit:
                    state["over"] = True
                    raise BodyTooLarge()
            return message

        async def guarded_send(message: Message) -> None:
            if state["over"] or state["slow"]:  # the app's answer to a cut body (a parse error, a 500) gives way
                return
            state["started"] = state["started"] or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, guarded_send)
        except Exception:
            if not (state["over"] or state["slow"]):
                raise
        if state["started"]:
            return
        if state["over"]:
            await self._answer(send, scope, too_large(limit, flag))
        elif state["slow"]:
            await self._answer(send, scope, too_slow())

    async def _answer(self, send: Send, scope: Scope, error: ApiError) -> None:
        await answer(send, error, scope["path"], self.render)

    async def _authenticate(self, headers: dict[bytes, bytes], scope: Scope) -> ApiError | None:
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        token = token.strip() if scheme.lower() == "bearer" else ""
        token = headers.get(b"x-api-key", b"").decode("latin-1").strip() or token
        if not token:
            return ApiError(401, "You didn't provide an API key (Authorization: Bearer <key>, or x-api-key: <key>).",
                            code="invalid_api_key")
        tenant = await run_in_threadpool(self.authenticate, token) if len(token) <= 512 else None
        if tenant is None:
            return ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
        scope.setdefault("state", {})["tenant"] = tenant
        return None
