"""`jaxtune chat` (a conversation on a terminal) and `jaxtune generate` (answers to prompts, for
scripts), both decoding through `runtime.decoding.stream` so each token can be shown as it is made.

The whole conversation is kept as messages and rendered again with the chat template every
turn, so the model sees exactly the format it was trained on, earlier turns included.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO


@dataclass
class Session:
    """A model opened for decoding: its streaming decoder and tokenizer."""

    decoder: Any  # runtime.decoding.stream.StreamDecoder
    tokenizer: Any
    description: str
    max_new_tokens: int
    seed: int


def quiet_loading() -> None:
    """Keep the terminal for the conversation: no loading progress bars or library deprecation notices."""
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)


def open_session(
    source: str,
    store_root: str,
    max_new_tokens: int,
    seed: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> Session:
    """Open `source` (see `model_source.open_source`) with a decoder that stops at the end of a turn."""
    from jaxtune.cli.model_source import open_source
    from jaxtune.data.templates import stop_ids
    from jaxtune.data.tokenize import pad_id_of
    from jaxtune.runtime.decoding.sampling import Sampling
    from jaxtune.runtime.decoding.stream import StreamDecoder

    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    if temperature == 0 and (top_k or top_p != 1):
        raise ValueError("--top-k and --top-p need sampling: set --temperature above 0")
    sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p)
    opened = open_source(source, store_root)
    stops = stop_ids(opened.tokenizer, getattr(opened.model.module, "generation_config", None))
    decoder = StreamDecoder(opened.model, stops, pad_id_of(opened.tokenizer), sampling)
    return Session(decoder, opened.tokenizer, opened.description, max_new_tokens, seed)


def require_chat_template(session: Session) -> None:
    if not getattr(session.tokenizer, "chat_template", None):
        raise ValueError(
            f"{session.description}: its tokenizer has no chat template (a base model?); "
            "`jaxtune generate` encodes prompts as they are"
        )


@dataclass
class Conversation:
    """The turns so far, after an optional system message."""

    system: str | None = None
    turns: list[dict[str, str]] = field(default_factory=list)

    @property
    def messages(self) -> list[dict[str, str]]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.turns


def prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The conversation rendered by the chat template, ending where the assistant's answer starts."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids)


def reply(session: Session, ids: Sequence[int]) -> Iterator[str]:
    """The answer's text, in pieces as its tokens arrive.

    The growing token list is decoded whole and the new suffix given, since one token may be
    part of a character (UTF-8 bytes split across tokens) and decode alone cannot tell.
    """
    tokens: list[int] = []
    shown = 0
    for token in session.decoder.stream(ids, session.max_new_tokens, session.seed):
        tokens.append(token)
        text = session.tokenizer.decode(tokens, skip_special_tokens=True)
        if not text.endswith("\ufffd"):  # U+FFFD: the last character's bytes are not all here yet
            yield text[shown:]
            shown = len(text)


def chat(
    session: Session, lines: TextIO, out: TextIO, err: TextIO, system: str | None = None, show_prompt: bool = False
) -> Conversation:
    """Answer each line of `lines` until EOF or /exit; /reset forgets the turns so far.

    `show_prompt` writes each turn's rendered prompt to `err`. Ctrl-C stops an answer; at the
    prompt it ends the chat, as EOF does.
    """
    conversation = Conversation(system)
    err.write(f"jaxtune chat: {session.description}; /reset clears the history, /exit or Ctrl-D ends\n")
    while True:
        out.write("you> ")
        out.flush()
        try:
            line = lines.readline()
        except KeyboardInterrupt:
            line = ""
        if not line or line.strip() == "/exit":
            out.write("\n" if not line else "")
            return conversation
        if line.strip() == "/reset":
            conversation.turns.clear()
            err.write("(history cleared)\n")
            continue
        if not line.strip():
            continue
        conversation.turns.append({"role": "user", "content": line.strip()})
        ids = prompt_ids(session.tokenizer, conversation.messages)
        if show_prompt:
            err.write(f"[prompt]{session.tokenizer.decode(ids)}[/prompt]\n")
        conversation.turns.append({"role": "assistant", "content": _say(session, ids, out)})
        out.write("\n")
        err.write(_speed(session.decoder.last) + "\n")


def _say(session: Session, ids: Sequence[int], out: TextIO) -> str:
    pieces = []
    try:
        for piece in reply(session, ids):
            out.write(piece)
            out.flush()
            pieces.append(piece)
    except KeyboardInterrupt:
        out.write(" [stopped]")
    return "".join(pieces)


def generate(
    session: Session, prompts: Sequence[str], out: TextIO, err: TextIO, system: str | None = None, jsonl: bool = False
) -> list[str]:
    """Answer each prompt alone and print the answers one a line, in order; tokens/s to `err`.

    Prompts are rendered as a user turn when the tokenizer has a chat template, else encoded as
    they are. A plain line writes newlines inside an answer as \\n (and \\ as \\\\); `jsonl`
    writes {"prompt", "answer"} objects instead.
    """
    answers, tokens, seconds, compiling = [], 0, 0.0, 0.0
    for prompt in prompts:
        if getattr(session.tokenizer, "chat_template", None):
            ids = prompt_ids(session.tokenizer, Conversation(system, [{"role": "user", "content": prompt}]).messages)
        else:
            ids = session.tokenizer(prompt)["input_ids"]
        answer = "".join(reply(session, ids))
        answers.append(answer)
        if jsonl:
            out.write(json.dumps({"prompt": prompt, "answer": answer}, ensure_ascii=False) + "\n")
        else:
            out.write(answer.replace("\\", "\\\\").replace("\n", "\\n") + "\n")
        out.flush()
        last = session.decoder.last
        tokens, seconds, compiling = tokens + last.tokens, seconds + last.seconds, compiling + last.compile_seconds
    from jaxtune.runtime.decoding.stream import Stats

    err.write(f"{len(prompts)} answers: {_speed(Stats(tokens, seconds, compiling))}\n")
    return answers


def _speed(stats: Any) -> str:
    return f"{stats.tokens} tokens in {stats.seconds:.2f} s, {stats.tokens_per_second:.1f} tokens/s" + (
        f" (compiling took {stats.compile_seconds:.1f} s more)" if stats.compile_seconds else ""
    )


def read_prompts(prompts: Sequence[str], prompts_file: str | None) -> list[str]:
    """The prompts given on the command line, then those of `prompts_file`: one a line, or for a
    .jsonl file each line's "prompt" field. Blank lines are skipped."""
    found = list(prompts)
    if prompts_file is not None:
        path = Path(prompts_file)
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except OSError as e:
            raise ValueError(f"{path}: {e.strerror or e}") from None
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            if path.suffix.lower() != ".jsonl":
                found.append(line)
                continue
            try:
                found.append(str(json.loads(line)["prompt"]))
            except (ValueError, KeyError, TypeError):
                raise ValueError(f'{path}:{number}: not a JSON object with a "prompt" field') from None
    if not found:
        raise ValueError("no prompts: give them as arguments or with --prompts-file")
    return found
