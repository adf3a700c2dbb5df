"""One row's values, checked and read: text fields, the category, chat turns, the prompt and
answers of a preference pair, and the prompt and answer of a prompt_answer row. Each check
raises DataError starting with `where`, the row's file and line (or row), so a bad value is
reported where the user can find it.

Text is stripped of surrounding whitespace: chat templates trim it anyway (Gemma's does), and
generations are scored against the answer by exact match.
"""

from __future__ import annotations

import json
import math
from typing import Any

from jaxtune.errors import DataError

DEFAULT_CATEGORY = "general"
ROLES = ("system", "user", "assistant")


def text_of(row: dict, key: str, where: str, required: bool = False, non_empty: bool = False) -> str:
    """`row[key]` as a string; a missing or null optional field is ''."""
    value = row.get(key)
    if value is None and not required:
        return ""
    if not isinstance(value, str) or (non_empty and not value.strip()):
        got = "an empty string" if isinstance(value, str) else type_name(value)
        raise DataError(f"{where}: {key!r} must be a {'non-empty ' if non_empty else ''}string, got {got}")
    return value.strip()


def category_of(row: dict, where: str) -> str:
    value = row.get("category")
    if value is None or value == "":
        return DEFAULT_CATEGORY
    if not isinstance(value, str):
        raise DataError(f"{where}: 'category' must be a string, got {type_name(value)}")
    return value


def split_messages(messages: Any, where: str) -> tuple[list[dict], str]:
    """Prompt turns and the final assistant answer of a `messages` row."""
    turns = chat_turns(messages, where)
    if turns[-1]["role"] != "assistant":
        raise DataError(f"{where}: the last message must be the 'assistant' answer, got role {turns[-1]['role']!r}")
    prompt = turns[:-1]
    if not any(t["role"] == "user" for t in prompt):
        raise DataError(f"{where}: 'messages' has no 'user' turn before the assistant answer")
    return prompt, turns[-1]["content"]


def chat_turns(messages: Any, where: str) -> list[dict]:
    """A `messages` value as checked {role, content} turns."""
    if isinstance(messages, str):  # CSV cells hold the list as JSON text
        try:
            messages = json.loads(messages)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: 'messages' is text but not valid JSON ({e.msg})") from None
    if not isinstance(messages, list) or not messages:
        raise DataError(
            f"{where}: 'messages' must be a non-empty list of {{role, content}} objects, got {type_name(messages)}"
        )
    return [chat_message(m, where, i) for i, m in enumerate(messages, start=1)]


def preference_pair(row: dict, where: str, category: str) -> dict:
    """A pair's prompt turns, chosen `response` and `rejected` answer."""
    return {
        "messages": prompt_of(row, where, "preference"),
        "response": pair_answer(row, "chosen", where),
        "rejected": pair_answer(row, "rejected", where),
        "category": category,
    }


def prompt_answer(row: dict, where: str, category: str) -> dict:
    """A prompt_answer row's prompt turns, and its answer as `response`: what the rewards check
    sampled answers against, never trained on."""
    return {
        "messages": prompt_of(row, where, "prompt_answer"),
        "response": answer_text(row, where),
        "category": category,
    }


def prompt_of(row: dict, where: str, data_format: str) -> list[dict]:
    """The prompt turns of a preference or prompt_answer row: `prompt` (text, one user turn) or
    `messages` (the conversation the answers follow), exactly one of them."""
    has_prompt, has_messages = row.get("prompt") is not None, row.get("messages") is not None
    if has_prompt == has_messages:
        given = "both" if has_prompt else "neither"
        raise DataError(
            f"{where}: a {data_format} row needs its prompt as 'prompt' (text) or 'messages' (the "
            f"conversation before {_answers(data_format)}), exactly one of them; got {given}"
        )
    if has_prompt:
        return [{"role": "user", "content": text_of(row, "prompt", where, required=True, non_empty=True)}]
    return prompt_turns(row["messages"], where, data_format)


def prompt_turns(messages: Any, where: str, data_format: str) -> list[dict]:
    """The turns the answers follow: they end with a 'user' turn."""
    turns = chat_turns(messages, where)
    if turns[-1]["role"] != "user":
        raise DataError(
            f"{where}: in a {data_format} row 'messages' is the conversation before "
            f"{_answers(data_format)}, so its last message must be a 'user' turn, got role {turns[-1]['role']!r}"
        )
    return turns


def _answers(data_format: str) -> str:
    return "the two answers" if data_format == "preference" else "the answer"


def answer_text(row: dict, where: str) -> str:
    """A prompt_answer row's `answer`: text, or a JSON number as its text (42 -> '42', 2.5 -> '2.5').
    Never empty: an answer is what every sampled answer is checked against."""
    value = row.get("answer")
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, float) and math.isfinite(value):
        return repr(value)
    if isinstance(value, str) and value.strip():
        return value.strip()
    got = "an empty string" if isinstance(value, str) else str(value) if isinstance(value, float) else type_name(value)
    raise DataError(f"{where}: 'answer' must be non-empty text or a finite number, got {got}")


def pair_answer(row: dict, key: str, where: str) -> str:
    """A preference row's `chosen` or `rejected` answer: text, or a list holding one 'assistant' message
    (TRL's conversational form). May be empty: the pair is then dropped and counted."""
    value = row.get(key)
    if isinstance(value, str) and value.strip().startswith("[") and value.strip().endswith("]"):
        try:  # CSV cells hold a list as JSON text
            value = json.loads(value)
        except json.JSONDecodeError:
            pass
    if isinstance(value, list):
        if len(value) != 1:
            raise DataError(
                f"{where}: {key!r} as a list must hold one 'assistant' message (the answer), got {len(value)} messages"
            )
        message = chat_message(value[0], where, 1)
        if message["role"] != "assistant":
            raise DataError(f"{where}: {key!r} must be the 'assistant' answer, got role {message['role']!r}")
        return message["content"]
    return text_of(row, key, where, required=True)


def chat_message(message: Any, where: str, index: int) -> dict:
    if not isinstance(message, dict):
        raise DataError(f"{where}: message {index} must be an object with role and content, got {type_name(message)}")
    role, content = message.get("role"), message.get("content")
    if role not in ROLES:
        raise DataError(f"{where}: message {index} has role {role!r}; expected one of {', '.join(ROLES)}")
    if not isinstance(content, str):
        raise DataError(f"{where}: message {index} 'content' must be a string, got {type_name(content)}")
    return {"role": role, "content": content.strip()}


def type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__
