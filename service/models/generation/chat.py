"""A folder's chat template: messages to the prompt text, rendered as transformers' `apply_chat_template` renders it.

The template is Jinja2. transformers 4.57 writes it to `chat_template.jinja` (and named ones to
`additional_chat_templates/NAME.jinja`); older versions kept it in `tokenizer_config.json`'s `chat_template`,
a string or a list of {"name", "template"}. The `default` one is used, as transformers uses it when no
tools are passed. It renders in Jinja's immutable sandbox with transformers' settings (trim_blocks,
lstrip_blocks, loop controls, a JSON `tojson`, `raise_exception`, `strftime_now`, the `{% generation %}`
tag), given the messages, `add_generation_prompt` and the tokenizer's special tokens (`bos_token`,
`eos_token`, ...) by name. The text is then encoded without adding special tokens: the template wrote them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from service.errors import InvalidArgument

__all__ = ["TEMPLATE_FILE", "ChatTemplate", "chat_template"]

TEMPLATE_FILE = "chat_template.jinja"
TEMPLATES_FOLDER = "additional_chat_templates"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
# The special tokens a template sees by name (transformers' SPECIAL_TOKENS_ATTRIBUTES), when the folder sets them.
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: marks what the assistant said (for training masks); rendered
    as its body, as transformers renders it when it does not track them."""

    tags = {"generation"}  # noqa: RUF012 (jinja's own class attribute)

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:  # fmt: skip
    """transformers' tojson: JSON without Jinja's HTML escaping."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled chat template and the special tokens it is rendered with."""

    source: str  # the template's Jinja text
    special_tokens: Mapping[str, Any]  # bos_token, eos_token, ... and additional_special_tokens, as set
    template: jinja2.Template

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt text of `messages`; InvalidArgument naming `messages` when the template refuses them
        (its raise_exception: roles that do not alternate, a role it does not know, ...)."""
        try:
            return self.template.render(
                **self.special_tokens,
                messages=list(messages),
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
            )
        except jinja2.exceptions.TemplateError as e:  # the sandbox's SecurityError is one too
            raise InvalidArgument(f"field 'messages': the model's chat template refused them: {e}") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            raise InvalidArgument(f"field 'messages': the model's chat template cannot render them: {e}") from None


def _token_text(value: Any) -> Any:
    """A special token as tokenizer_config.json holds it (a string, or an AddedToken's {"content": ...})."""
    if isinstance(value, dict):
        return value.get("content")
    if isinstance(value, list):
        return [t for t in (_token_text(v) for v in value) if isinstance(t, str)]
    return value


def _json_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    doc = json.loads(path.read_text(encoding="utf-8"))
    return doc if isinstance(doc, dict) else {}


def _special_tokens(folder: Path, config: dict[str, Any]) -> dict[str, Any]:
    """The special tokens by name, as transformers' special_tokens_map: tokenizer_config.json's, then
    special_tokens_map.json's over them (transformers reads it last)."""
    found: dict[str, Any] = {}
    for doc in (config, _json_file(folder / SPECIAL_TOKENS_MAP)):
        for key in (*SPECIAL_TOKENS, "additional_special_tokens"):
            value = _token_text(doc.get(key))
            if isinstance(value, str) or (key == "additional_special_tokens" and isinstance(value, list) and value):
                found[key] = value
    return found


def _default_source(folder: Path, config: dict[str, Any]) -> str | None:
    """The default template's text: chat_template.jinja, else tokenizer_config.json's chat_template."""
    path = folder / TEMPLATE_FILE
    if path.is_file():
        return path.read_text(encoding="utf-8")
    named = {p.stem: p for p in sorted((folder / TEMPLATES_FOLDER).glob("*.jinja"))}
    if "default" in named:
        return named["default"].read_text(encoding="utf-8")
    value = config.get("chat_template")
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # [{"name": ..., "template": ...}]: the default one
        by_name = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        default = by_name.get("default")
        return default if isinstance(default, str) else None
    return None


def _stamp(folder: Path) -> tuple[int, ...]:
    """When the files a template is read from last changed: a folder replaced in place is read again."""
    paths = (folder / TEMPLATE_FILE, folder / TOKENIZER_CONFIG, folder / SPECIAL_TOKENS_MAP, folder / TEMPLATES_FOLDER)
    return tuple(p.stat().st_mtime_ns if p.exists() else 0 for p in paths)


def chat_template(folder: Path) -> ChatTemplate | None:
    """The folder's default chat template, compiled (once per change of its files); None when it has none.
    ValueError when it has one that does not compile."""
    return _compiled(folder, _stamp(folder))


@lru_cache(maxsize=32)
def _compiled(folder: Path, stamp: tuple[int, ...]) -> ChatTemplate | None:
    config = _json_file(folder / TOKENIZER_CONFIG)
    source = _default_source(folder, config)
    if source is None:
        return None
    try:
        template = _environment().from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(f"the chat template of {folder.name} does not compile: {e} (line {e.lineno})") from None
    return ChatTemplate(source, _special_tokens(folder, config), template)
