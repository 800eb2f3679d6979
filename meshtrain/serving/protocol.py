"""OpenAI's completions and chat completions, as this server reads and writes them.

:func:`parse` checks a request body (a decoded JSON object) and turns it into a :class:`Request`: the
scheduler's :class:`~meshtrain.serving.scheduler.Job` plus how to answer (streamed or whole, with
usage, with token ids). Anything it cannot serve is an :class:`ApiError` whose body is OpenAI's
``{"error": {"message", "type", "param", "code"}}`` and names the field: an unknown model (404), a
missing or ill-typed field, ``max_tokens`` below 1 or past the context, a prompt longer than the
context, an unknown field, or a field whose non-default value this server does not implement (``n``,
``logprobs``, ``tools``, penalties, ...): 400.

Read: ``model``, ``prompt`` (text, or token ids) / ``messages`` (rendered by the run tokenizer's chat
template with the assistant header, as ``meshtrain generate --chat``), ``max_tokens`` (chat also
``max_completion_tokens``; default 16 for completions as OpenAI's, the rest of the context for chat),
``temperature`` (default 1, 0: greedy), ``top_p``, ``seed``, ``stop`` (up to 4 texts), ``stream``,
``stream_options.include_usage``, and two extensions vLLM also reads: ``ignore_eos`` (do not stop at
the end-of-sequence ids) and ``return_token_ids`` (each choice carries the new ``token_ids``).

Example::

    request = parse(Kind.CHAT, {"model": "smollm", "messages": [{"role": "user", "content": "Hi"}]}, model)
    request.job.prompt_ids, request.stream
"""

from __future__ import annotations

import dataclasses
import enum
import math
import secrets
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from meshtrain.errors import MeshtrainError
from meshtrain.serving.scheduler import Job
from meshtrain.serving.slots import RowSampling


class Kind(str, enum.Enum):
    COMPLETION = "completion"
    CHAT = "chat"


class ApiError(MeshtrainError):
    """A request the server refuses: HTTP ``status`` and OpenAI's error body (:meth:`body`)."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 kind: str = "invalid_request_error", code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> Dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param)


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """What requests are checked against: the model id clients send, the tokens per slot, the vocabulary
    size, the end-of-sequence ids, and text <-> ids (``encode`` ``None``: the run has no tokenizer, token
    id prompts only; ``render``: conversation -> text, ``None`` without a chat template)."""

    name: str
    context: int
    vocab_size: int
    end_ids: Tuple[int, ...]
    encode: Optional[Callable[[str], List[int]]]
    render: Optional[Callable[[Sequence[Dict[str, Any]]], str]] = None


@dataclasses.dataclass(frozen=True)
class Request:
    """A checked request: the scheduler's ``job`` and how to answer it."""

    kind: Kind
    model: str
    job: Job
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False


_COMMON = frozenset({"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed",
                     "user", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "ignore_eos",
                     "return_token_ids"})
FIELDS = {Kind.COMPLETION: _COMMON | {"prompt", "echo", "best_of", "suffix"},
          Kind.CHAT: _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "response_format", "tools",
                                "tool_choice", "parallel_tool_calls", "functions", "function_call"}}
#: fields read but not implemented: a request may send their default (None, or the value here), nothing else
NOT_IMPLEMENTED = {"n": 1, "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0, "echo": False,
                   "logprobs": False, "top_logprobs": 0, "logit_bias": None, "suffix": None, "tools": None,
                   "tool_choice": None, "parallel_tool_calls": None, "functions": None, "function_call": None}
MAX_STOP_TEXTS = 4


def parse(kind: Kind, body: Any, model: ServedModel) -> Request:
    """``body`` checked against ``model`` (module docstring); :class:`ApiError` naming the field."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", None)
    unknown = sorted(set(body) - FIELDS[kind])
    if unknown:
        raise bad(unknown[0], f"unrecognized request argument {unknown[0]!r}")
    _refuse_not_implemented(body)
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise bad("model", f"give the model id, {model.name!r} (GET /v1/models lists it)")
    if name != model.name:
        raise ApiError(404, f"model: the model {name!r} does not exist here; this server serves {model.name!r}",
                       "model", code="model_not_found")
    prompt_ids = _chat_ids(body, model) if kind is Kind.CHAT else _prompt_ids(body.get("prompt"), model)
    field = "messages" if kind is Kind.CHAT else "prompt"
    if len(prompt_ids) >= model.context:
        raise bad(field, f"the prompt has {len(prompt_ids)} tokens; the context is {model.context} tokens "
                         f"(prompt and completion together): shorten it")
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise bad("stream_options", "give {\"include_usage\": true|false}, and only with \"stream\": true")
    job = Job(tuple(prompt_ids), _max_tokens(kind, body, len(prompt_ids), model.context), _sampling(body),
              _stop_texts(body.get("stop")),
              frozenset() if _flag(body, "ignore_eos") else frozenset(model.end_ids))
    return Request(kind, name, job, stream, bool((options or {}).get("include_usage")),
                   _flag(body, "return_token_ids"))


def _refuse_not_implemented(body: Dict[str, Any]) -> None:
    for key, default in NOT_IMPLEMENTED.items():
        value = body.get(key)
        if value is None or value == default or (key == "logit_bias" and value == {}):
            continue
        raise bad(key, f"{value!r} is not supported by this server (leave {key} out)")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise bad("response_format", "only {\"type\": \"text\"} is supported (leave it out)")


def _flag(body: Dict[str, Any], key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad(key, f"give true or false, not {value!r}")
    return value


def _integer(body: Dict[str, Any], key: str) -> Optional[int]:
    value = body.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise bad(key, f"give an integer, not {value!r}")
    return value


def _number(body: Dict[str, Any], key: str, default: float, low: float, high: float, open_low: bool = False) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or \
            not (low < value if open_low else low <= value) or value > high:
        raise bad(key, f"give a number in {'(' if open_low else '['}{low}, {high}], not {value!r}")
    return float(value)


def _sampling(body: Dict[str, Any]) -> RowSampling:
    seed = _integer(body, "seed")
    return RowSampling(_number(body, "temperature", 1.0, 0.0, 2.0), _number(body, "top_p", 1.0, 0.0, 1.0, True),
                       secrets.randbits(32) if seed is None else seed % 2 ** 32)


def _max_tokens(kind: Kind, body: Dict[str, Any], prompt_len: int, context: int) -> int:
    key = "max_completion_tokens" if kind is Kind.CHAT and body.get("max_completion_tokens") is not None else \
        "max_tokens"
    value = _integer(body, key)
    room = context - prompt_len
    if value is None:
        return min(16, room) if kind is Kind.COMPLETION else room
    if value < 1:
        raise bad(key, f"{value} is below 1; give the most tokens to generate (at most {room} for this prompt)")
    if value > room:
        raise bad(key, f"{value} tokens after a prompt of {prompt_len} exceed the context of {context} tokens; "
                       f"give at most {room}")
    return value


def _stop_texts(stop: Any) -> Tuple[str, ...]:
    if stop is None:
        return ()
    texts = [stop] if isinstance(stop, str) else stop
    if not isinstance(texts, list) or not all(isinstance(s, str) for s in texts) or len(texts) > MAX_STOP_TEXTS:
        raise bad("stop", f"give a string or a list of up to {MAX_STOP_TEXTS} strings")
    return tuple(s for s in texts if s)


def _prompt_ids(prompt: Any, model: ServedModel) -> List[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if model.encode is None:
            raise bad("prompt", "this model has no tokenizer (trained on token ids): give a list of token ids")
        ids = model.encode(prompt)
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
        outside = [t for t in ids if not 0 <= t < model.vocab_size]
        if outside:
            raise bad("prompt", f"token id {outside[0]} is outside the vocabulary (0 .. {model.vocab_size - 1})")
    else:
        raise bad("prompt", "give one prompt: a string, or a list of token ids (batches of prompts are not "
                            "supported: send one request each)")
    if not ids:
        raise bad("prompt", "the prompt is empty; give at least one token")
    return ids


def _chat_ids(body: Dict[str, Any], model: ServedModel) -> List[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "give a non-empty list of {\"role\": ..., \"content\": ...} objects")
    plain = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}]", "give an object with a \"role\" (system, user, assistant) and \"content\"")
        plain.append({**m, "content": _content(m.get("content"), f"messages[{i}].content")})
    if model.render is None or model.encode is None:
        raise bad("messages", "this model's tokenizer has no chat template; use /v1/completions with the prompt in "
                              "the model's own format")
    try:
        text = model.render(plain)
    except MeshtrainError as exc:  # ChatTemplateError: the template refused the conversation
        raise bad("messages", str(exc)) from None
    ids = model.encode(text)
    if not ids:
        raise bad("messages", "the conversation renders to no tokens")
    return ids


def _content(content: Any, where: str) -> str:
    """A message's content as text: a string, or a list of ``{"type": "text", "text": ...}`` parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and
                                         isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise bad(where, "give a string or a list of {\"type\": \"text\", \"text\": ...} parts (only text is supported)")
