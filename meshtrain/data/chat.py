"""Chat templates: a tokenizer's ``chat_template`` (a Jinja template in its ``tokenizer_config.json``,
or in a ``chat_template.jinja`` file beside it) turns a conversation into the text the model was tuned
on, rendered the way HuggingFace ``transformers``' ``apply_chat_template`` renders it: a sandboxed,
immutable Jinja environment with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols``
extension, a ``tojson`` filter that leaves non-ASCII text and HTML characters as they are, the
functions ``raise_exception(message)`` and ``strftime_now(format)``, the ``{% generation %}`` tag
(marks the assistant's text; :meth:`ChatTemplate.render_spans` returns where it fell), and the
variables ``messages``, ``add_generation_prompt``, ``tools``, ``documents`` and the tokenizer's special
tokens (``bos_token``, ``eos_token``, ...). The rendered text is tokenized without adding special
tokens (the template writes them), as transformers does.

Generation (``meshtrain generate --chat``) renders prompts as user turns; chat fine-tuning reuses
:meth:`ChatTemplate.render_spans` to find the assistant's tokens. Example::

    template = load_chat_template("runs/smollm")          # None: the tokenizer has no template
    text = template.render([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    ids = load_tokenizer("runs/smollm").encode(text)
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import threading
from datetime import datetime
from typing import Any, Dict, List, Optional, Sequence, Tuple

from meshtrain.data.tokenizer import CHAT_TEMPLATE_FILE, SPECIAL_TOKENS_FILE, TOKENIZER_CONFIG_FILE
from meshtrain.errors import ConfigError

#: the special-token variables a template sees (transformers' ``SPECIAL_TOKENS_ATTRIBUTES``)
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
                       "additional_special_tokens")

Message = Dict[str, Any]


class ChatTemplateError(ConfigError):
    """A template that does not compile, refuses a conversation (``raise_exception``) or fails while
    rendering it; the message names the template's file and what went wrong."""


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A chat template's Jinja ``source``, the special tokens it sees as variables (``{"bos_token":
    "<s>", ...}``) and ``where`` it was read from (named in errors)."""

    source: str
    special_tokens: Dict[str, Any] = dataclasses.field(default_factory=dict)
    where: str = "the chat template"

    def render(self, messages: Sequence[Message], *, add_generation_prompt: bool = False, **variables) -> str:
        """The text of conversation ``messages`` (``[{"role": "user", "content": "Hi"}, ...]``);
        ``add_generation_prompt``: end with the header of an assistant turn (generation needs it);
        ``variables``: more template variables (``tools=[...]``, ``enable_thinking=False``), which
        override the special tokens of the same name as in transformers."""
        return self.render_spans(messages, add_generation_prompt=add_generation_prompt, **variables)[0]

    def render_spans(self, messages: Sequence[Message], *, add_generation_prompt: bool = False,
                     **variables) -> Tuple[str, List[Tuple[int, int]]]:
        """``(text, spans)``: :meth:`render`'s text and the ``(start, end)`` character ranges that the
        template's ``{% generation %}`` blocks produced (the assistant's text; empty when the template
        has no such blocks)."""
        check_messages(messages, self.where)
        template = _compiled(self.source, self.where)
        values = {**self.special_tokens, "tools": None, "documents": None, **variables,
                  "messages": [dict(m) for m in messages], "add_generation_prompt": bool(add_generation_prompt)}
        pieces: List[str] = []
        spans: List[Tuple[int, int]] = []
        try:
            # one rendering at a time per process: the span collector lives in the template's environment
            with _RENDERING, template.environment.generation_spans(pieces, spans):
                for piece in template.generate(**values):
                    pieces.append(piece)
        except ChatTemplateError:
            raise
        except Exception as exc:  # noqa: BLE001 - jinja2 raises TemplateError, and templates can raise anything
            raise ChatTemplateError(f"{self.where} failed on this conversation ({type(exc).__name__}: "
                                    f"{str(exc)[:300]}); give messages the template accepts") from None
        return "".join(pieces), spans


def check_messages(messages: Any, where: str = "the conversation") -> None:
    """``messages`` must be a non-empty list of objects, each with a string ``role`` and a ``content``
    (text, or a list of parts as multimodal templates take); a ``ChatTemplateError`` names the first
    that is not."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ChatTemplateError(f"a conversation must be a non-empty list of messages such as "
                                f"[{{\"role\": \"user\", \"content\": \"Hi\"}}], not {str(messages)[:60]!r}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise ChatTemplateError(f"message {i} of a conversation for {where} is {str(m)[:60]!r}; give an "
                                    f"object with a string \"role\" and a \"content\"")


def load_chat_template(folder: str) -> Optional[ChatTemplate]:
    """The default chat template of the tokenizer in ``folder`` (a run or HuggingFace folder):
    ``chat_template.jinja`` if present, else ``tokenizer_config.json``'s ``chat_template`` (a string,
    or a list of named templates, of which ``default`` is taken); ``None`` when it has none. A
    template that does not compile raises :class:`ChatTemplateError` naming the file and line."""
    config = read_tokenizer_config(folder)
    path = os.path.join(folder, CHAT_TEMPLATE_FILE)
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                source, where = f.read(), path
        except (OSError, UnicodeDecodeError) as exc:
            raise ChatTemplateError(f"cannot read {path} ({exc}); replace it with the model's own, or remove it") \
                from None
    else:
        where = os.path.join(folder, TOKENIZER_CONFIG_FILE)
        source = _config_template(config.get("chat_template"), where)
        if source is None:
            return None
    template = ChatTemplate(source, special_tokens(folder, config), where)
    _compiled(template.source, template.where)  # a syntax error shows now, not at the first conversation
    return template


def read_tokenizer_config(folder: str) -> Dict[str, Any]:
    """``folder``'s ``tokenizer_config.json`` as a dict (``{}`` when there is none)."""
    path = os.path.join(folder, TOKENIZER_CONFIG_FILE)
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path} ({exc}); replace it with the model's own, or remove it") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path} is not a JSON object; replace it with the model's own, or remove it")
    return config


def special_tokens(folder: str, config: Dict[str, Any]) -> Dict[str, Any]:
    """The special tokens a template sees: ``special_tokens_map.json``'s, overridden by ``config``'s
    (``tokenizer_config.json``); a token saved as ``{"content": "<s>", ...}`` is its content; unset
    and empty ones are left out, as transformers' ``special_tokens_map`` leaves them out."""
    merged: Dict[str, Any] = {}
    legacy = os.path.join(folder, SPECIAL_TOKENS_FILE)
    if os.path.isfile(legacy):
        try:
            with open(legacy, encoding="utf-8") as f:
                found = json.load(f)
            merged.update(found if isinstance(found, dict) else {})
        except (OSError, ValueError):
            pass  # a legacy file transformers would also read past: the config's entries still apply
    merged.update({k: config[k] for k in SPECIAL_TOKEN_NAMES if k in config})
    out = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = merged.get(name)
        value = [_content(v) for v in value] if isinstance(value, list) else _content(value)
        if value:
            out[name] = value
    return out


def _content(token: Any) -> Any:
    return token.get("content") if isinstance(token, dict) else token


def _config_template(value: Any, where: str) -> Optional[str]:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                       and isinstance(t.get("template"), str) for t in value):
        named = {t["name"]: t["template"] for t in value}
        if "default" in named:
            return named["default"]
        raise ChatTemplateError(f"{where}: chat_template names {sorted(named)} but none is 'default'; name one "
                                f"of them 'default'")
    raise ChatTemplateError(f"{where}: chat_template is {type(value).__name__}; give a Jinja template string "
                            f"or a list of {{\"name\": ..., \"template\": ...}}")


# -- the Jinja environment (jinja2 is imported here only: commands without chat do not pay for it) ----
_TEMPLATES: Dict[str, Any] = {}
_RENDERING = threading.Lock()


def _compiled(source: str, where: str):
    """``source`` compiled in the chat environment (cached per source text)."""
    if source not in _TEMPLATES:
        import jinja2

        try:
            _TEMPLATES[source] = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"{where}: the chat template does not compile (line {exc.lineno}: {exc.message})"
                                    f"; replace it with the model's own") from None
    return _TEMPLATES[source]


def _environment():
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_generation_tag(), jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _raise_exception(message):
    raise ChatTemplateError(f"the chat template refused the conversation: {message}")


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes <, >, & and ' for HTML; chat templates want the JSON text itself
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _generation_tag():
    """The ``{% generation %}...{% endgeneration %}`` extension: renders its body unchanged and, while
    :meth:`ChatTemplate.render_spans` collects them, records the character range the body fell on."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationTag(Extension):
        tags = {"generation"}

        def __init__(self, environment):
            super().__init__(environment)
            self._pieces = self._spans = None
            environment.extend(generation_spans=self._collect)

        def parse(self, parser):
            line = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(line)

        @jinja2.pass_eval_context
        def _body(self, eval_ctx, caller):
            text = caller()
            if self._pieces is not None:
                start = sum(map(len, self._pieces))  # the text rendered before this block
                self._spans.append((start, start + len(text)))
            return text

        @contextlib.contextmanager
        def _collect(self, pieces, spans):
            self._pieces, self._spans = pieces, spans
            try:
                yield
            finally:
                self._pieces = self._spans = None

    return GenerationTag
