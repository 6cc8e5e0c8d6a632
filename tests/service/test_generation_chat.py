"""The chat template (service/models/generation/chat.py) against transformers' apply_chat_template on the same
folders: the same text and the same token ids, for templates written as transformers 4.57 writes them
(chat_template.jinja) and as older versions did (tokenizer_config.json), with the features real templates
use (special tokens by name, raise_exception, loop controls, tojson, strftime_now, {% generation %})."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service.errors import InvalidArgument
from service.models.generation.chat import chat_template

pytest.importorskip("transformers")

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Llama 2's: the bos token by name, roles that must alternate (raise_exception), a system message folded in.
LLAMA2 = (
    (
        "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
        "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
        "{% set system_message = false %}{% endif %}\n"
    )
    + """{% for message in loop_messages %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {% if loop.index0 == 0 and system_message != false %}
        {% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}
    {% else %}
        {% set content = message['content'] %}
    {% endif %}
    {% if message['role'] == 'user' %}
        {{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}
    {% elif message['role'] == 'assistant' %}
        {% generation %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endgeneration %}
    {% endif %}
{% endfor %}"""
)
# Loop controls, tojson of a message, a date (the same day: the test does not run at midnight's edge).
FEATURES = """{{ bos_token }}Today is {{ strftime_now('%Y') }}.
{% for message in messages %}{% if message['role'] == 'system' %}{% continue %}{% endif %}{{ message | tojson }}
{% if loop.index > 3 %}{% break %}{% endif %}{% endfor %}{% if add_generation_prompt %}>>>{% endif %}"""

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Héllo there, what is a Transformer?"},
    {"role": "assistant", "content": "  A model. "},
    {"role": "user", "content": 'Say "more" <please> & thanks'},
]


def _tokenizer(into: Path, template: str, where: str) -> Path:
    """A small BPE tokenizer with bos, eos and ChatML's markers as special tokens, saved by transformers;
    the template written to chat_template.jinja (`where` "jinja") or tokenizer_config.json ("config")."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([m["content"] for m in MESSAGES] * 4 + ["system user assistant INST SYS"], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )  # fmt: skip
    fast.save_pretrained(into)
    (into / "chat_template.jinja").unlink(missing_ok=True)
    if where == "jinja":
        (into / "chat_template.jinja").write_text(template)
    else:
        config = json.loads((into / "tokenizer_config.json").read_text())
        config["chat_template"] = template if where == "config" else [{"name": "default", "template": template}]
        (into / "tokenizer_config.json").write_text(json.dumps(config))
    return into


@pytest.mark.parametrize("where", ["jinja", "config", "named"])
@pytest.mark.parametrize(("template", "messages"), [(CHATML, MESSAGES), (LLAMA2, MESSAGES), (FEATURES, MESSAGES * 2)],
                         ids=["chatml", "llama2", "features"])  # fmt: skip
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_the_same_text_and_ids_as_transformers(
    tmp_path: Path, template: str, messages: list[dict[str, str]], where: str, add_generation_prompt: bool
) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    folder = _tokenizer(tmp_path, template, where)
    hf = AutoTokenizer.from_pretrained(folder)
    ours = chat_template(folder)
    assert ours is not None
    text = ours.render(messages, add_generation_prompt)
    assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    ids = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    assert ids == hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    assert len(ids) > 20


def test_a_template_that_refuses_the_messages_names_them(tmp_path: Path) -> None:
    ours = chat_template(_tokenizer(tmp_path, LLAMA2, "jinja"))
    assert ours is not None
    with pytest.raises(InvalidArgument, match=r"field 'messages'.*roles must alternate"):
        ours.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_the_sandbox_refuses_what_a_template_must_not_reach(tmp_path: Path) -> None:
    """A template is Jinja from the model's folder: rendered in the immutable sandbox, it reads no Python
    internals and changes no message."""
    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    ours = chat_template(_tokenizer(tmp_path / "a", escape, "jinja"))
    assert ours is not None
    with pytest.raises(InvalidArgument, match="field 'messages'"):
        ours.render(MESSAGES)
    mutate = "{% set _ = messages.append({'role': 'user', 'content': 'x'}) %}{{ messages | length }}"
    ours = chat_template(_tokenizer(tmp_path / "b", mutate, "jinja"))
    assert ours is not None
    with pytest.raises(InvalidArgument, match="field 'messages'"):
        ours.render(MESSAGES)


def test_no_template_and_a_broken_one(tmp_path: Path) -> None:
    folder = _tokenizer(tmp_path, CHATML, "jinja")
    (folder / "chat_template.jinja").unlink()
    assert chat_template(folder) is None
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m }")
    with pytest.raises(ValueError, match="does not compile"):
        chat_template(folder)
