"""Chat templates: the named ones a config can ask for, and the tokens that end a turn.

A base checkpoint (Gemma 3 270M) ships no chat template; `model.chat_template: gemma` gives it
Gemma's own, as the published Gemma 3 recipes apply it. Decoding must stop where the template
closes the assistant turn (`<end_of_turn>`, `<|im_end|>`), which is often not the tokenizer's eos.
"""

from __future__ import annotations

from typing import Any

from jaxtune.errors import ChatTemplateError

# Gemma 3's chat template, text only: a leading system message is folded into the first user
# turn, the assistant's role is written 'model', and every turn ends with "<end_of_turn>\n".
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)

NAMED_TEMPLATES = {"gemma": GEMMA_CHAT_TEMPLATE}
_PROBE = "Zq"  # an answer short enough that no tokenizer merges it with what the template writes after it


def apply_chat_template_setting(tokenizer: Any, setting: str | None) -> Any:
    """Set `tokenizer.chat_template` from `model.chat_template`: a name in NAMED_TEMPLATES or a
    Jinja string; None keeps the tokenizer's own. Returns the tokenizer."""
    if setting is not None:
        tokenizer.chat_template = NAMED_TEMPLATES.get(setting, setting)
    return tokenizer


def require_chat_template(tokenizer: Any, model_name: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        names = ", ".join(f"'{name}'" for name in NAMED_TEMPLATES)
        raise ChatTemplateError(
            f"{model_name}: its tokenizer has no chat template; set model.chat_template to {names} or a Jinja template string"
        )


def end_of_turn_ids(tokenizer: Any) -> list[int]:
    """The special token(s) the chat template writes right after an assistant answer.

    Found by rendering a short exchange and reading the first special token after the answer,
    so it works for any template: `<end_of_turn>` (Gemma), `<|im_end|>` (ChatML, SmolLM2),
    `<|eot_id|>` (Llama 3). Empty when there is no template or it closes turns with plain text.
    """
    if not getattr(tokenizer, "chat_template", None):
        return []
    user = [{"role": "user", "content": "Hi"}]
    prompt = tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=True, return_dict=False)
    full = tokenizer.apply_chat_template(
        [*user, {"role": "assistant", "content": _PROBE}], tokenize=True, return_dict=False
    )
    if list(full[: len(prompt)]) != list(prompt):
        return []
    special = set(tokenizer.all_special_ids) | {
        i for i, token in tokenizer.added_tokens_decoder.items() if getattr(token, "special", False)
    }
    first = next((i for i in full[len(prompt) :] if i in special), None)
    return [] if first is None else [first]


def stop_ids(tokenizer: Any, generation_config: Any = None) -> list[int]:
    """Every id that ends an answer: the template's end of turn, the tokenizer's eos, and the
    model's generation-config eos ids, in that order (the first one pads finished rows)."""
    ids = generation_config.eos_token_id if generation_config is not None else None
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    candidates = [*end_of_turn_ids(tokenizer), tokenizer.eos_token_id, *ids]
    return [i for i in dict.fromkeys(candidates) if i is not None]
