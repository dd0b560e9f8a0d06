"""Chat templates rendered the way vLLM renders them before tokenizing.

vLLM (0.32) parses OpenAI messages into a "conversation" and hands it to
transformers' ``apply_chat_template``, which renders a jinja2 template in an
``ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`` with a
non-HTML-escaping ``tojson`` filter, ``raise_exception`` and ``strftime_now``.
The parsing step depends on the template's *content format*: templates that loop
over ``message.content`` get content-part lists ("openai"), others get the text
parts joined with ``"\\n"`` ("string"). We mirror both steps for text content.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

ContentFormat = Literal["string", "openai"]

_TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text", "refusal"})


class ChatTemplateError(ValueError):
    """The model has no chat template, or the messages cannot be rendered."""


class _GenerationTag(jinja2.ext.Extension):
    # transformers' AssistantTracker: `{% generation %}` blocks render their body unchanged.
    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


class _SandboxedEnvironment(ImmutableSandboxedEnvironment):
    """jinja's immutable sandbox, with its verdict on an attribute remembered per (type, name).

    The verdict (no underscore name, not a function's or frame's internals, not a mutating method
    of a list, dict, set or deque) depends only on the object's type and the attribute's name, and
    the sandbox asks it for every attribute a template reads (`loop.last`, `message.role`): a few
    isinstance checks against abstract base classes each time, about a third of a short chat's
    rendering."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._safe: dict[tuple[type, str], bool] = {}

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        key = (type(obj), attr)
        safe = self._safe.get(key)
        if safe is None:
            safe = self._safe[key] = super().is_safe_attribute(obj, attr, value)
        return safe


def _environment() -> ImmutableSandboxedEnvironment:
    env = _SandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _is_content_access(node: jinja2.nodes.Node, names: set[str]) -> bool:
    # message.content / message['content']
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == "content" and isinstance(node.node, jinja2.nodes.Name) and node.node.name in names
    if isinstance(node, jinja2.nodes.Getitem):
        arg = node.arg
        return (isinstance(arg, jinja2.nodes.Const) and arg.value == "content"
                and isinstance(node.node, jinja2.nodes.Name) and node.node.name in names)
    return False


def detect_content_format(template: str) -> ContentFormat:
    """"openai" when the template loops over a message's content parts (vLLM's
    heuristic, simplified to the common loop shapes), else "string"."""
    try:
        ast = _environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return "string"
    message_vars: set[str] = set()
    for loop in ast.find_all(jinja2.nodes.For):
        it = loop.iter
        if isinstance(it, jinja2.nodes.Filter):  # e.g. messages | selectattr(...)
            it = it.node
        if isinstance(it, jinja2.nodes.Getitem):  # e.g. messages[1:]
            it = it.node
        if isinstance(it, jinja2.nodes.Name) and it.name == "messages" and isinstance(loop.target, jinja2.nodes.Name):
            message_vars.add(loop.target.name)
    for loop in ast.find_all(jinja2.nodes.For):
        if _is_content_access(loop.iter, message_vars):
            return "openai"
        if isinstance(loop.iter, jinja2.nodes.Name) and loop.iter.name == "content":
            return "openai"
    return "string"


def _text_of(part: Any) -> str | None:
    if isinstance(part, str):
        return part
    if isinstance(part, dict) and part.get("type", "text") in _TEXT_PART_TYPES:
        text = part.get("text", part.get("refusal"))
        return text if isinstance(text, str) else None
    return None


def to_conversation(messages: list[dict[str, Any]], content_format: ContentFormat) -> list[dict[str, Any]]:
    """OpenAI chat messages -> the conversation vLLM passes to the template (text parts only)."""
    conversation: list[dict[str, Any]] = []
    for message in messages:
        role = message["role"]
        content = message.get("content")
        out: dict[str, Any] = {"role": role}
        if isinstance(content, str):
            # vLLM wraps a plain string as one text part, which the general path below turns back
            # into the same string (or that one part); the common case, without the detour.
            out["content"] = content if content_format == "string" or role == "tool" else [
                {"type": "text", "text": content}]
            _add_calls_and_names(out, message, role)
            conversation.append(out)
            continue
        parts: list[Any] = [] if content is None else list(content)
        texts = [t for t in (_text_of(p) for p in parts) if t is not None]
        if content_format == "openai":
            wrapped = []
            for part in parts:
                text = _text_of(part)
                if text is None:
                    continue
                item = {"type": "text", "text": text}
                if isinstance(part, dict):
                    item.update({k: v for k, v in part.items() if k not in ("type", "text")})
                wrapped.append(item)
            out["content"] = wrapped
        else:
            out["content"] = "\n".join(texts)
        if role == "tool" and isinstance(out["content"], list):
            # vLLM flattens text-only tool results to a string for tool-unaware templates.
            out["content"] = "\n".join(texts) if texts else ""
        _add_calls_and_names(out, message, role)
        conversation.append(out)
    return conversation


def _add_calls_and_names(out: dict[str, Any], message: dict[str, Any], role: str) -> None:
    if role == "assistant" and message.get("tool_calls") is not None:
        calls = [_call_for_template(call) for call in message["tool_calls"]]
        if calls:  # vLLM drops an empty list, keeping templates on the plain assistant path
            out["tool_calls"] = calls
    if role == "tool" and "tool_call_id" in message:
        out["tool_call_id"] = message["tool_call_id"]
    if isinstance(message.get("name"), str):
        out["name"] = message["name"]
    if role == "developer":
        out["tools"] = message.get("tools")


def _call_for_template(call: Any) -> Any:
    """vLLM hands templates a call's arguments as an object: a JSON string is parsed, and anything
    that is not an object (malformed, a list, empty) becomes {}."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    fn = dict(call["function"])
    arguments = fn.get("arguments")
    if isinstance(arguments, str) and arguments:
        try:
            arguments = json.loads(arguments)
        except ValueError:
            arguments = None
    fn["arguments"] = arguments if isinstance(arguments, dict) else {}
    return {**call, "function": fn}


def tools_for_template(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Request tools as vLLM passes them to the template (its pydantic model's dump): only the
    declared fields, `description` and `parameters` always present (null when absent), `strict`
    and `defer_loading` only when set."""
    if tools is None:
        return None
    out = []
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict):
            out.append(tool)
            continue
        dumped: dict[str, Any] = {"name": fn.get("name"), "description": fn.get("description"),
                                  "parameters": fn.get("parameters")}
        for key in ("strict", "defer_loading"):
            value = fn.get(key)
            if value is None and key == "defer_loading":
                value = tool.get("defer_loading")  # the tool-level flag propagates into function
            if value is not None:
                dumped[key] = value
        entry: dict[str, Any] = {"type": tool.get("type", "function"), "function": dumped}
        if tool.get("defer_loading") is not None:
            entry["defer_loading"] = tool["defer_loading"]
        out.append(entry)
    return out


class ChatTemplate:
    """A model's chat template plus the special-token variables it is rendered with."""

    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        self.source = source
        self.special_tokens = special_tokens
        self.content_format: ContentFormat = detect_content_format(source)
        self._template = _environment().from_string(source)
        # jinja's Template.render copies the environment's globals (a ChainMap) into a fresh dict
        # on every call, about half the cost of rendering a short chat; flatten them once.
        self._base_vars = {**self._template.globals, **special_tokens}

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "ChatTemplate":
        model_dir = Path(model_dir)
        config_path = model_dir / "tokenizer_config.json"
        config: dict[str, Any] = json.loads(config_path.read_text()) if config_path.exists() else {}
        source: Any = None
        jinja_path = model_dir / "chat_template.jinja"
        if jinja_path.exists():
            source = jinja_path.read_text()
        elif (model_dir / "chat_template.json").exists():
            source = json.loads((model_dir / "chat_template.json").read_text()).get("chat_template")
        else:
            source = config.get("chat_template")
        if isinstance(source, list):  # named templates: transformers picks "default"
            named = {t["name"]: t["template"] for t in source}
            source = named.get("default")
        if not isinstance(source, str):
            raise ChatTemplateError(f"no chat template in {model_dir}")
        special: dict[str, str] = {}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token"):
            value = config.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                special[key] = value
        return cls(source, special)

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               add_generation_prompt: bool = True, **template_kwargs: Any) -> str:
        conversation = to_conversation(messages, self.content_format)
        template = self._template
        variables = {**self._base_vars, **template_kwargs, "messages": conversation,
                     "tools": tools_for_template(tools),
                     "documents": None, "add_generation_prompt": add_generation_prompt}
        try:
            # What Template.render does, with a context that already holds the globals.
            context = template.new_context(variables, shared=True)
            return template.environment.concat(template.root_render_func(context))  # type: ignore[attr-defined]
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(str(exc)) from exc
