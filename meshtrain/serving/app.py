"""The HTTP side: a Starlette (ASGI) app in front of the :class:`~meshtrain.serving.scheduler.Scheduler`.

Routes::

    GET  /health                 {"status": "ok", "slots", "running", "waiting", "finished": {...}}
    GET  /v1/models              the one model served
    POST /v1/completions         OpenAI's completions, whole or streamed ("stream": true: server-sent events)
    POST /v1/chat/completions    OpenAI's chat completions, the same

Every refusal is OpenAI's error body (:class:`~meshtrain.serving.protocol.ApiError`): 400/404 for a bad
request (its field named), 429 with ``Retry-After`` when the waiting line is full, 503 while the
server drains (SIGTERM), 504 when a request ran past ``serve.request_timeout`` (a stream ends with an
error event instead). A client that goes away cancels its request and frees its slot: a stream's
task is cancelled by Starlette when the connection closes; a whole response polls for the disconnect.

Example::

    app = make_app(model, scheduler)     # then uvicorn.Server(uvicorn.Config(app)).run()
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from typing import Any, AsyncIterator, Dict, List

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from meshtrain.serving.protocol import ApiError, Kind, Request, ServedModel, parse
from meshtrain.serving.scheduler import Event, Finish, Overloaded, Scheduler, Ticket

#: how often a whole (not streamed) response checks that its client is still there
DISCONNECT_POLL_S = 0.2


def error_response(exc: ApiError, headers: Dict[str, str] = None) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def _ended_badly(finish: Finish, timeout_s: float) -> ApiError:
    if finish is Finish.TIMEOUT:
        return ApiError(504, f"the request ran past the server's timeout of {timeout_s:g} s "
                             f"(serve.request_timeout); ask for fewer tokens", None, "timeout")
    return ApiError(500, "the server failed while generating (its log has the traceback); retry", None, "server_error")


class Responder:
    """Builds one request's response bodies (OpenAI's objects) as its events arrive."""

    def __init__(self, request: Request):
        self.request = request
        chat = request.kind is Kind.CHAT
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _envelope(self, obj: str, choices: List[Dict[str, Any]]) -> Dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.request.model, "choices": choices}

    def usage(self, completion_tokens: int) -> Dict[str, int]:
        prompt = len(self.request.job.prompt_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
                "total_tokens": prompt + completion_tokens}

    def choice(self, text: str, ids, finish) -> Dict[str, Any]:
        reason = finish.value if finish is not None else None
        if self.request.kind is Kind.CHAT:
            out = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason}
        else:
            out = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        if self.request.return_token_ids:
            out["token_ids"] = list(ids)
        return out

    def whole(self, text: str, ids, finish: Finish, completion_tokens: int) -> Dict[str, Any]:
        return {**self._envelope(self.object, [self.choice(text, ids, finish)]), "usage": self.usage(completion_tokens)}

    def chunk(self, text: str, ids=(), finish=None, first: bool = False) -> str:
        if self.request.kind is Kind.CHAT:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text or ids else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish.value if finish else None}
            obj = "chat.completion.chunk"
        else:
            choice, obj = {"index": 0, "text": text, "logprobs": None,
                           "finish_reason": finish.value if finish else None}, "text_completion"
        if self.request.return_token_ids:
            choice["token_ids"] = list(ids)
        return sse(self._envelope(obj, [choice]))

    def usage_chunk(self, completion_tokens: int) -> str:
        obj = "chat.completion.chunk" if self.request.kind is Kind.CHAT else "text_completion"
        return sse({**self._envelope(obj, []), "usage": self.usage(completion_tokens)})


def sse(data: Any) -> str:
    """One server-sent event carrying ``data`` as JSON (``[DONE]`` as is)."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class Server:
    """The routes' state: the served model, its scheduler, the request timeout."""

    def __init__(self, model: ServedModel, scheduler: Scheduler, timeout_s: float):
        self.model, self.scheduler, self.timeout_s = model, scheduler, timeout_s

    async def health(self, _request: HttpRequest) -> JSONResponse:
        status = self.scheduler.status()
        return JSONResponse({"status": "draining" if status["closing"] else "ok", "model": self.model.name, **status})

    async def models(self, _request: HttpRequest) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": self.model.name, "object": "model", "created": 0,
                                                         "owned_by": "meshtrain",
                                                         "max_model_len": self.model.context}]})

    async def completions(self, request: HttpRequest):
        return await self._serve(request, Kind.COMPLETION)

    async def chat(self, request: HttpRequest):
        return await self._serve(request, Kind.CHAT)

    async def _serve(self, http: HttpRequest, kind: Kind):
        try:
            body = json.loads(await http.body())
        except (ValueError, UnicodeDecodeError) as exc:
            return error_response(ApiError(400, f"the request body is not valid JSON ({exc})", "body"))
        try:
            request = parse(kind, body, self.model)
        except ApiError as exc:
            return error_response(exc)
        loop, events = asyncio.get_running_loop(), asyncio.Queue()

        def deliver(event: Event) -> None:  # on the scheduler's thread
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody is listening any more
                loop.call_soon_threadsafe(events.put_nowait, event)

        try:
            ticket = self.scheduler.submit(request.job, deliver, whole=not request.stream)
        except Overloaded as exc:
            status, kind_ = (503, "server_shutting_down") if exc.draining else (429, "rate_limit_exceeded")
            return error_response(ApiError(status, str(exc), None, kind_, kind_),
                                  {"Retry-After": str(exc.retry_after_s)})
        responder = Responder(request)
        if request.stream:
            return StreamingResponse(self._stream(responder, ticket, events), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await self._whole(http, responder, ticket, events)

    async def _whole(self, http: HttpRequest, responder: Responder, ticket: Ticket, events: asyncio.Queue):
        texts, ids = [], []
        try:
            while True:
                try:
                    event = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if await http.is_disconnected():
                        ticket.cancel()
                        return JSONResponse({}, status_code=499)  # nobody reads it
                    continue
                texts.append(event.text)
                ids.extend(event.token_ids)
                if event.finish is not None:
                    break
        finally:
            ticket.cancel()  # (a no-op once it finished) a cancelled handler frees the slot too
        if event.finish in (Finish.STOP, Finish.LENGTH):
            return JSONResponse(responder.whole("".join(texts), ids, event.finish, event.completion_tokens))
        return error_response(_ended_badly(event.finish, self.timeout_s))

    async def _stream(self, responder: Responder, ticket: Ticket, events: asyncio.Queue) -> AsyncIterator[str]:
        try:
            if responder.request.kind is Kind.CHAT:
                yield responder.chunk("", first=True)
            while True:
                event = await events.get()
                if event.finish is None:
                    if event.text or responder.request.return_token_ids:
                        yield responder.chunk(event.text, event.token_ids)
                    continue
                if event.finish in (Finish.STOP, Finish.LENGTH):
                    if event.text or event.token_ids:
                        yield responder.chunk(event.text, event.token_ids)
                    yield responder.chunk("", (), event.finish)
                    if responder.request.include_usage:
                        yield responder.usage_chunk(event.completion_tokens)
                else:
                    yield sse(_ended_badly(event.finish, self.timeout_s).body())
                yield sse("[DONE]")
                return
        finally:
            ticket.cancel()  # the client went away (Starlette cancelled this task): free the slot


async def _http_error(_request: HttpRequest, exc: HTTPException) -> JSONResponse:
    return error_response(ApiError(exc.status_code, str(exc.detail), None,
                                   "not_found" if exc.status_code == 404 else "invalid_request_error"))


def make_app(model: ServedModel, scheduler: Scheduler, timeout_s: float) -> Starlette:
    """The ASGI app; its lifespan starts the scheduler and, at shutdown (after the server stopped taking
    connections and the requests in flight finished), closes it."""
    server = Server(model, scheduler, timeout_s)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        scheduler.start()
        yield
        scheduler.close()
        await asyncio.to_thread(scheduler.join, 60)

    routes = [Route("/health", server.health, methods=["GET"]), Route("/v1/models", server.models, methods=["GET"]),
              Route("/v1/completions", server.completions, methods=["POST"]),
              Route("/v1/chat/completions", server.chat, methods=["POST"])]
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: _http_error})
