"""Datasets for the producer: JSONL readers, chat-template tokenization and assistant-only loss masks.

Loss masks are derived by rendering prefixes of the conversation with the target's own chat template: for
assistant turn i, render(messages[:i], add_generation_prompt=True) ends exactly where the answer starts, and
render(messages[:i+1]) ends after the answer and its end-of-turn token (plus any whitespace the template puts
after it, which is not generated and so gets no loss). The conversation text is cut at those boundaries and
each piece tokenized on its own, so no token straddles a prompt/answer boundary, and the answer tokens are
exactly what the model would generate after that prompt. This works for any template whose rendering of a
prefix is a prefix of the full rendering (ChatML, Llama-3, Zephyr, ...), needs no `{% generation %}`
markers (most released templates lack them), and a template that breaks the prefix property is detected
and the record skipped with a warning rather than silently mis-masked.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

Format = Literal["chat", "prompt_response"]
Message = dict[str, str]
WARNINGS_PER_REASON = 20  # then only the summary counts them


class DataError(ValueError):
    """A dataset or tokenizer that cannot be used at all; the message names the file and the reason."""


class RecordError(ValueError):
    """One record that is skipped; `reason` is its counter key."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


def parse_record(line: str, fmt: Format, require_assistant: bool = True) -> list[Message]:
    """One JSONL line → the conversation's messages; raises RecordError naming what is wrong."""
    if not line.strip():
        raise RecordError("empty", "empty line")
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as err:
        raise RecordError("malformed", f"not valid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(rec, dict):
        raise RecordError("malformed", f"expected a JSON object, got {type(rec).__name__}")
    if fmt == "prompt_response":
        prompt, response = rec.get("prompt"), rec.get("response")
        if not isinstance(prompt, str) or not isinstance(response, str):
            raise RecordError("malformed", 'needs string fields "prompt" and "response"')
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    else:
        messages = rec.get("messages")
        if not isinstance(messages, list):
            raise RecordError("malformed", 'needs a "messages" list')
        for k, m in enumerate(messages):
            if not (
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            ):
                raise RecordError("malformed", f'messages[{k}] needs string "role" and "content"')
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    if not messages or not any(m["content"].strip() for m in messages):
        raise RecordError("empty", "no message has any content")
    if require_assistant and not any(m["role"] == "assistant" for m in messages):
        raise RecordError("no_assistant", "no assistant turn to train on")
    return messages


class ChatEncoder:
    """Tokenizes a conversation with the tokenizer's chat template; loss mask 1 on assistant answers only."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_length: int, name: str = "tokenizer"):
        if not getattr(tokenizer, "chat_template", None):
            raise DataError(f"{name}: the tokenizer has no chat template; loss masks need one")
        self.tokenizer = tokenizer
        self.max_length = max_length

    def _render(self, messages: list[Message], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def pieces(self, messages: list[Message]) -> list[tuple[str, bool]]:
        """The rendered conversation cut into (text, is_answer) pieces."""
        full = self._render(messages, False)
        pieces: list[tuple[str, bool]] = []
        cursor = 0
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            prompt = self._render(messages[:i], True)
            turn = self._render(messages[: i + 1], False)
            if not (full.startswith(turn) and turn.startswith(prompt) and len(prompt) >= cursor):
                raise RecordError(
                    "template_not_prefix_stable",
                    f"the chat template does not render assistant turn {i} as a prefix of the conversation",
                )
            end = len(prompt) + len(turn[len(prompt) :].rstrip())
            pieces += [(full[cursor : len(prompt)], False), (full[len(prompt) : end], True)]
            cursor = end
        pieces.append((full[cursor:], False))
        return [(text, answer) for text, answer in pieces if text]

    def encode(self, messages: list[Message]) -> tuple[list[int], list[int], int]:
        """→ (input_ids, loss_mask) truncated to max_length, and the length before truncation."""
        pieces = self.pieces(messages)
        encoded = self.tokenizer([text for text, _ in pieces], add_special_tokens=False)["input_ids"]
        ids: list[int] = []
        mask: list[int] = []
        for (_, answer), piece_ids in zip(pieces, encoded, strict=True):
            ids += piece_ids
            mask += [int(answer)] * len(piece_ids)
        return ids[: self.max_length], mask[: self.max_length], len(ids)


@dataclass
class DataStats:
    """What indexing skipped and truncated; `skipped` maps reason → count."""

    records: int = 0
    skipped: Counter = field(default_factory=Counter)
    truncated: int = 0
    tokens: int = 0


class JsonlDataset:
    """A JSONL file indexed once: byte offset and (truncated) token length of every usable record.

    Sample id i is the i-th usable record of the file. Records are re-read by offset and re-tokenized when
    a batch needs them, so memory holds two integers per sample, not the tokens.
    """

    def __init__(self, path: str | Path, fmt: Format, encoder: ChatEncoder):
        self.path = Path(path)
        self.format: Format = fmt
        self.encoder = encoder
        self.offsets: list[int] = []
        self.lengths: list[int] = []
        self.stats = DataStats()
        if fmt not in ("chat", "prompt_response"):
            raise DataError(f"{self.path}: unknown data format {fmt!r} (chat or prompt_response)")
        if not self.path.is_file():
            raise DataError(f"{self.path}: data file does not exist")
        self._index()
        if not self.offsets:
            raise DataError(f"{self.path}: no usable record ({dict(self.stats.skipped)} skipped)")

    def _index(self) -> None:
        max_length = self.encoder.max_length
        with self.path.open("rb") as f:
            offset = 0
            for line_no, raw in enumerate(f, start=1):
                self.stats.records += 1
                try:
                    line = raw.decode("utf-8")
                    ids, _, full_length = self.encoder.encode(parse_record(line, self.format))
                except UnicodeDecodeError:
                    self._skip(line_no, RecordError("malformed", "not valid UTF-8"))
                except RecordError as err:
                    self._skip(line_no, err)
                else:
                    self.offsets.append(offset)
                    self.lengths.append(len(ids))
                    self.stats.tokens += len(ids)
                    self.stats.truncated += full_length > max_length
                offset += len(raw)
        if self.stats.skipped or self.stats.truncated:
            log.warning(
                "%s: %d usable of %d records; skipped %s; %d truncated to %d tokens",
                self.path,
                len(self.offsets),
                self.stats.records,
                dict(self.stats.skipped),
                self.stats.truncated,
                max_length,
            )

    def _skip(self, line_no: int, err: RecordError) -> None:
        self.stats.skipped[err.reason] += 1
        if self.stats.skipped[err.reason] <= WARNINGS_PER_REASON:
            log.warning("%s:%d: skipped record (%s): %s", self.path, line_no, err.reason, err)

    def __len__(self) -> int:
        return len(self.offsets)

    def reader(self) -> SampleReader:
        """A reader with its own file handle (one per thread)."""
        return SampleReader(self)


class SampleReader:
    """Random access to tokenized samples by id; owns one open file handle."""

    def __init__(self, dataset: JsonlDataset):
        self.dataset = dataset
        self.file = dataset.path.open("rb")

    def read(self, sample_id: int) -> tuple[list[int], list[int]]:
        """→ (input_ids, loss_mask) of one sample, truncated to max_length."""
        ds = self.dataset
        self.file.seek(ds.offsets[sample_id])
        messages = parse_record(self.file.readline().decode("utf-8"), ds.format)
        ids, mask, _ = ds.encoder.encode(messages)
        if len(ids) != ds.lengths[sample_id]:
            raise DataError(
                f"{ds.path}: sample {sample_id} changed length since indexing; was the file edited?"
            )
        return ids, mask

    def close(self) -> None:
        self.file.close()


def iter_messages(
    path: str | Path, fmt: Format = "chat", require_assistant: bool = True
) -> Iterator[tuple[int, list[Message]]]:
    """(line number, messages) of every usable record; skipped lines are logged with file:line."""
    path = Path(path)
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                yield line_no, parse_record(raw.decode("utf-8"), fmt, require_assistant)
            except (RecordError, UnicodeDecodeError) as err:
                log.warning("%s:%d: skipped record: %s", path, line_no, err)
