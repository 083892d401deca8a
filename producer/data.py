"""Datasets for the producer: chat records from any record file, chat-template tokenization, loss masks.

Records come from JSON lines, Parquet or Arrow files (producer/records.py) as OpenAI-style `messages`
(role/content), ShareGPT-style `conversations` (from/value: human/gpt/system) or prompt/response pairs.

Loss masks are derived by rendering prefixes of the conversation with the target's own chat template (and
the job's `chat_template_kwargs`, e.g. `enable_thinking`): for assistant turn i, render(messages[:i],
add_generation_prompt=True) ends exactly where the answer starts, and render(messages[:i+1]) ends after the
answer and its end-of-turn token (plus any whitespace the template puts after it, which is not generated
and so gets no loss). The conversation text is cut at those boundaries and each piece tokenized on its own,
so no token straddles a prompt/answer boundary, and the answer tokens are exactly what the model would
generate after that prompt: for a thinking template that keeps the reasoning of the last turn, the
`<think>` block is part of the answer; a generation prompt that pre-fills an empty one (enable_thinking =
false) keeps it out. This works for any template whose rendering of a prefix is a prefix of the full
rendering (ChatML, Llama-3, Zephyr, ...) and needs no `{% generation %}` markers (most released templates
lack them).

Templates that render a turn differently once later turns follow (Qwen3 drops the reasoning of assistant
turns before the last user message, and their pre-filled empty think block) are handled as the full
rendering shows the turn: the answer starts where the full rendering departs from the generation prompt
and ends at the turn's end-of-turn token, so a history turn's loss covers the answer text the template
kept. A template that breaks even that is detected and the record skipped with a warning rather than
silently mis-masked.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from transformers import PreTrainedTokenizerBase

from common.hub import HubError, dataset_files, is_hub_id
from producer.records import (
    TABLE_SUFFIXES,
    DataError,
    RecordError,
    RecordFile,
    ShardedRecords,
    json_record,
    open_records,
)

log = logging.getLogger(__name__)

Format = Literal["chat", "prompt_response"]
Message = dict[str, str]  # role, content and, on assistant turns, an optional reasoning_content
WARNINGS_PER_REASON = 20  # then only the summary counts them
CHARS_PER_TOKEN_BOUND = 8  # first guess of the text that N tokens cover; _prefix_tokens grows it as needed
INDEX_PROGRESS_S = 15.0  # a progress line this often while a large file is indexed
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
COLUMNS: dict[str, tuple[str, ...]] = {"chat": ("messages", "conversations"), "prompt_response": ("prompt", "response")}

__all__ = [
    "ChatDataset",
    "ChatEncoder",
    "DataError",
    "HubSelection",
    "Message",
    "RecordError",
    "RecordLimits",
    "iter_messages",
    "location",
    "parse_record",
]


def _chat_messages(rec: dict) -> list[Message]:
    if rec.get("messages") is not None:
        messages = rec["messages"]
        if not isinstance(messages, list):
            raise RecordError("malformed", '"messages" is not a list')
        out = []
        for k, m in enumerate(messages):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise RecordError("malformed", f'messages[{k}] needs string "role" and "content"')
            msg = {"role": m["role"], "content": m["content"]}
            reasoning = m.get("reasoning_content")
            if reasoning is not None:  # a table column is None where a row lacks it
                if not isinstance(reasoning, str):
                    raise RecordError("malformed", f"messages[{k}].reasoning_content is not a string")
                msg["reasoning_content"] = reasoning
            out.append(msg)
        return out
    if rec.get("conversations") is not None:
        turns = rec["conversations"]
        if not isinstance(turns, list):
            raise RecordError("malformed", '"conversations" is not a list')
        out = []
        for k, t in enumerate(turns):
            if not (isinstance(t, dict) and isinstance(t.get("from"), str) and isinstance(t.get("value"), str)):
                raise RecordError("malformed", f'conversations[{k}] needs string "from" and "value"')
            role = SHAREGPT_ROLES.get(t["from"])
            if role is None:
                raise RecordError(
                    "malformed", f"conversations[{k}].from is {t['from']!r} (expected one of {sorted(SHAREGPT_ROLES)})"
                )
            out.append({"role": role, "content": t["value"]})
        return out
    raise RecordError("malformed", 'needs a "messages" list (role/content) or a "conversations" list (from/value)')


def record_messages(rec: dict, fmt: Format, require_assistant: bool = True) -> list[Message]:
    """One record (a JSON object or a table row) → the conversation's messages; RecordError says what is wrong."""
    if fmt == "prompt_response":
        prompt, response = rec.get("prompt"), rec.get("response")
        if not isinstance(prompt, str) or not isinstance(response, str):
            raise RecordError("malformed", 'needs string fields "prompt" and "response"')
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    else:
        messages = _chat_messages(rec)
    if not messages or not any(m["content"].strip() for m in messages):
        raise RecordError("empty", "no message has any content")
    if require_assistant and not any(m["role"] == "assistant" for m in messages):
        raise RecordError("no_assistant", "no assistant turn to train on")
    return messages


def parse_record(line: str, fmt: Format, require_assistant: bool = True) -> list[Message]:
    """One JSONL line → the conversation's messages; raises RecordError naming what is wrong."""
    return record_messages(json_record(line.encode("utf-8")), fmt, require_assistant)


@dataclass(frozen=True)
class HubSelection:
    """Which part of a hub dataset `data.path` names (the job's data.split, data.subset, data.revision)."""

    split: str = "train"
    subset: str | None = None
    revision: str | None = None


def open_dataset_file(
    path: str | Path, fmt: Format, max_record_bytes: int | None = None, hub: HubSelection | None = None
) -> RecordFile:
    """A local record file, or the split's files of the hub dataset `path` names (common/hub.py)."""
    if fmt not in COLUMNS:
        raise DataError(f"{path}: unknown data format {fmt!r} (chat or prompt_response)")
    if is_hub_id(str(path)):
        hub = hub or HubSelection()
        try:
            files = dataset_files(str(path), hub.split, hub.subset, hub.revision)
        except HubError as err:
            raise DataError(str(err)) from None
        shards = [open_records(f, COLUMNS[fmt], max_record_bytes) for f in files]
        return shards[0] if len(shards) == 1 else ShardedRecords(Path(path), shards)
    return open_records(path, COLUMNS[fmt], max_record_bytes)


@dataclass(frozen=True)
class RecordLimits:
    """Per-record bounds of indexing (the job's data.max_record_bytes and data.record_time_limit_s).

    The size bound is what keeps indexing's peak memory independent of the largest record (a longer JSONL
    line is never read whole); the time bound is a safety net only: encoding is linear in the record, so a
    record within the size bound takes well under a second unless the chat template itself is slow.
    """

    max_bytes: int | None = None
    max_seconds: float | None = None


class ChatEncoder:
    """Tokenizes a conversation with the tokenizer's chat template; loss mask 1 on assistant answers only.

    `template_kwargs` are passed to every rendering (the job's `data.chat_template_kwargs`).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        max_length: int,
        name: str = "tokenizer",
        template_kwargs: dict[str, Any] | None = None,
    ):
        if not getattr(tokenizer, "chat_template", None):
            raise DataError(f"{name}: the tokenizer has no chat template; loss masks need one")
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.template_kwargs = dict(template_kwargs or {})
        # end-of-turn candidates: special tokens, longest first (so <|im_end|> wins over a shorter suffix)
        self._special = sorted({t for t in tokenizer.all_special_tokens if t}, key=len, reverse=True)

    def _render(self, messages: list[Message], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **self.template_kwargs
        )

    def _answer_start(self, full: str, before: list[Message], i: int) -> int:
        prompt = self._render(before, True)
        if full.startswith(prompt):
            return len(prompt)
        # a history turn the template renders without the generation prompt's pre-fill (Qwen3's empty think
        # block): the answer starts where the full rendering departs from the generation prompt
        context = self._render(before, False) if before else ""
        if not (full.startswith(context) and prompt.startswith(context)):
            raise RecordError(
                "template_not_prefix_stable",
                f"the chat template does not render the prompt of assistant turn {i} as a prefix of the conversation",
            )
        start = len(context)
        while start < len(prompt) and start < len(full) and prompt[start] == full[start]:
            start += 1
        return start

    def _answer_end(self, full: str, start: int, upto: list[Message], i: int) -> int:
        turn = self._render(upto, False).rstrip()
        if full.startswith(turn) and len(turn) > start:
            return len(turn)
        # the template renders this turn differently once later turns follow (Qwen3 strips the reasoning of
        # turns before the last user message): the answer ends at the same end-of-turn token in the full text
        eot = next((t for t in self._special if turn.endswith(t)), None)
        end = full.find(eot, start) if eot else -1
        if end < 0:
            raise RecordError(
                "template_not_prefix_stable",
                f"the chat template does not render assistant turn {i} as a prefix of the conversation"
                " and the turn ends in no special token",
            )
        return end + len(eot)

    def encode(self, messages: list[Message], deadline: float | None = None) -> tuple[list[int], list[int], int]:
        """→ (input_ids, loss_mask) truncated to max_length, and the length before truncation (exact when
        not truncated; a lower bound above max_length when truncated: the rest is never tokenized).

        Linear in the record: the conversation is rendered once, answer boundaries are found turn by turn
        and the pieces tokenized as they come, stopping as soon as max_length tokens are known, so neither
        a record of 100k messages nor one 50 MB answer is rendered per turn or tokenized whole. The tokens
        are exactly those of tokenizing every piece in full and cutting at max_length. `deadline`
        (time.monotonic()) bounds the time spent: past it the record is skipped (RecordError "too_slow").
        """
        out = _TokenSink(self.tokenizer, self.max_length)
        for text, answer in self.pieces(messages, deadline):
            if out.add(text, answer):
                break
        out.flush()
        return out.ids[: self.max_length], out.mask[: self.max_length], out.length

    def pieces(self, messages: list[Message], deadline: float | None = None) -> Iterator[tuple[str, bool]]:
        """The rendered conversation cut into (text, is_answer) pieces, lazily: a consumer that stops early
        never renders the later turns' prefixes."""
        full = self._render(messages, False)
        cursor = 0
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            if deadline is not None and time.monotonic() > deadline:
                raise RecordError(
                    "too_slow", f"stopped at message {i} of {len(messages)}: over data.record_time_limit_s"
                )
            start = self._answer_start(full, messages[:i], i)
            if start < cursor:
                raise RecordError(
                    "template_not_prefix_stable", f"assistant turn {i} starts before the previous turn ends"
                )
            end = self._answer_end(full, start, messages[: i + 1], i)
            yield from ((t, a) for t, a in ((full[cursor:start], False), (full[start:end], True)) if t)
            cursor = end
        if full[cursor:]:
            yield full[cursor:], False


class _TokenSink:
    """Tokenizes (text, is_answer) pieces in batches until max_length tokens are certain.

    Small pieces are batched into one tokenizer call (per-call overhead dominates them); a piece longer than
    what the missing tokens could need is tokenized by growing prefixes (`_prefix_tokens`), never whole.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_length: int):
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.ids: list[int] = []
        self.mask: list[int] = []
        self.length = 0  # tokens of the pieces seen (lower bound once a piece was cut)
        self._pending: list[tuple[str, bool]] = []
        self._pending_chars = 0

    def _budget(self) -> int:
        """Characters beyond which a piece (or the pending batch) surely holds the missing tokens, or is cut."""
        return CHARS_PER_TOKEN_BOUND * max(self.max_length - len(self.ids), 1) + 1024

    def add(self, text: str, answer: bool) -> bool:
        """Queue one piece; True when max_length is exceeded (the rest of the record is not needed)."""
        if len(text) > self._budget():
            if self.flush():
                return True
            ids, cut = _prefix_tokens(self.tokenizer, text, self.max_length - len(self.ids) + 1)
            self._extend(ids, answer)
            self.length += cut  # a cut piece has more tokens than were counted
            return len(self.ids) > self.max_length
        self._pending.append((text, answer))
        self._pending_chars += len(text)
        return self._pending_chars > self._budget() and self.flush()

    def flush(self) -> bool:
        if self._pending:
            encoded = self.tokenizer([t for t, _ in self._pending], add_special_tokens=False)["input_ids"]
            for (_, answer), piece_ids in zip(self._pending, encoded, strict=True):
                self._extend(piece_ids, answer)
            self._pending, self._pending_chars = [], 0
        return len(self.ids) > self.max_length

    def _extend(self, ids: list[int], answer: bool) -> None:
        self.ids += ids
        self.mask += [int(answer)] * len(ids)
        self.length += len(ids)


def _prefix_tokens(tokenizer: PreTrainedTokenizerBase, text: str, need: int) -> tuple[list[int], int]:
    """The first `need` tokens of tokenize(text) without tokenizing all of `text`, and 1 if text was cut.

    A cut changes tokens only near the cut (pre-tokenizers split at word boundaries; merges are local), so
    prefixes are doubled until two consecutive ones agree on their first `need` tokens and both have more:
    those tokens are then the full text's. Cost: about twice the text that `need` tokens cover.
    """
    size = CHARS_PER_TOKEN_BOUND * need + 1024
    prev: list[int] | None = None
    while size < len(text):
        ids = tokenizer(text[:size], add_special_tokens=False)["input_ids"]
        if prev is not None and len(prev) > need and prev[:need] == ids[:need]:
            return ids[:need], 1
        prev, size = ids, size * 2
    return tokenizer(text, add_special_tokens=False)["input_ids"], 0


@dataclass
class DataStats:
    """What indexing read, skipped and truncated; `skipped` maps reason → count."""

    records: int = 0
    skipped: Counter = field(default_factory=Counter)
    truncated: int = 0
    tokens: int = 0  # after truncation: what the batches hold
    loss_tokens: int = 0  # of those, the ones with loss mask 1


class ChatDataset:
    """A record file indexed once: the position and (truncated) token length of every usable record.

    Sample id i is the i-th usable record of the file. Records are re-read by position and re-tokenized
    when a batch needs them, so memory holds two integers per sample, not the tokens.
    """

    def __init__(
        self,
        path: str | Path,
        fmt: Format,
        encoder: ChatEncoder,
        limits: RecordLimits | None = None,
        hub: HubSelection | None = None,
    ):
        self.path = Path(path)
        self.format: Format = fmt
        self.encoder = encoder
        self.limits = limits or RecordLimits()
        self.records = open_dataset_file(path, fmt, self.limits.max_bytes, hub)
        self.positions: list[int] = []
        self.lengths: list[int] = []
        self.stats = DataStats()
        self._index()
        if not self.stats.records:
            raise DataError(f"{self.path}: data file has no records")
        if not self.positions:
            raise DataError(f"{self.path}: no usable record ({dict(self.stats.skipped)} skipped)")

    def _index(self) -> None:
        max_length, limits = self.encoder.max_length, self.limits
        started = last_report = time.monotonic()
        for number, position, rec in self.records.scan():
            self.stats.records += 1
            now = time.monotonic()
            if now - last_report > INDEX_PROGRESS_S:
                last_report = now
                log.info(
                    "indexing %s: %d records read, %d usable, %d tokens (%.0f records/s)",
                    self.path,
                    self.stats.records,
                    len(self.positions),
                    self.stats.tokens,
                    self.stats.records / (now - started),
                )
            try:
                if isinstance(rec, RecordError):
                    raise rec
                messages = record_messages(rec, self.format)
                if limits.max_bytes is not None:
                    chars = sum(len(m["content"]) + len(m.get("reasoning_content", "")) for m in messages)
                    if chars > limits.max_bytes:
                        raise RecordError(
                            "too_large", f"{chars} characters of text, over data.max_record_bytes = {limits.max_bytes}"
                        )
                deadline = None if limits.max_seconds is None else now + limits.max_seconds
                ids, mask, full_length = self.encoder.encode(messages, deadline)
            except RecordError as err:
                self._skip(number, err)
                continue
            self.positions.append(position)
            self.lengths.append(len(ids))
            self.stats.tokens += len(ids)
            self.stats.loss_tokens += sum(mask)
            self.stats.truncated += full_length > max_length
        if self.stats.skipped or self.stats.truncated:
            log.warning(
                "%s: %d usable of %d records; skipped %s; %d truncated to %d tokens",
                self.path,
                len(self.positions),
                self.stats.records,
                dict(self.stats.skipped),
                self.stats.truncated,
                max_length,
            )

    def _skip(self, number: int, err: RecordError) -> None:
        self.stats.skipped[err.reason] += 1
        if self.stats.skipped[err.reason] <= WARNINGS_PER_REASON:
            where = location(self.path, number)
            log.warning("%s: skipped record (%s): %s", where, err.reason, err)

    def __len__(self) -> int:
        return len(self.positions)

    @property
    def files(self) -> list[Path]:
        """The files the samples come from: the data file, or a hub dataset's split shards in order."""
        records = self.records
        return [f.path for f in records.files] if isinstance(records, ShardedRecords) else [records.path]

    def reader(self) -> SampleReader:
        """A reader with its own file handle (one per thread)."""
        return SampleReader(self)


def location(path: str | Path, number: int) -> str:
    """Where a record is, for messages: file:line for JSON lines, file:row N for tables."""
    table = Path(path).suffix.lower() in TABLE_SUFFIXES or is_hub_id(str(path))
    return f"{path}:row {number}" if table else f"{path}:{number}"


class SampleReader:
    """Random access to tokenized samples by id; owns one open file handle."""

    def __init__(self, dataset: ChatDataset):
        self.dataset = dataset
        self.records = dataset.records.reader()

    def read(self, sample_id: int) -> tuple[list[int], list[int]]:
        """→ (input_ids, loss_mask) of one sample, truncated to max_length."""
        ds = self.dataset
        messages = record_messages(self.records.get(ds.positions[sample_id]), ds.format)
        ids, mask, _ = ds.encoder.encode(messages)
        if len(ids) != ds.lengths[sample_id]:
            raise DataError(f"{ds.path}: sample {sample_id} changed length since indexing; was the file edited?")
        return ids, mask

    def close(self) -> None:
        self.records.close()


def iter_messages(
    path: str | Path, fmt: Format = "chat", require_assistant: bool = True
) -> Iterator[tuple[int, list[Message]]]:
    """(line or row number, messages) of every usable record; skipped ones are logged with their location.

    The file is opened (and a missing, empty or unreadable one reported) at the call, not at the first item.
    """
    records = open_dataset_file(path, fmt)

    def messages() -> Iterator[tuple[int, list[Message]]]:
        for number, _, rec in records.scan():
            try:
                if isinstance(rec, RecordError):
                    raise rec
                found = record_messages(rec, fmt, require_assistant)
            except RecordError as err:
                log.warning("%s: skipped record (%s): %s", location(path, number), err.reason, err)
                continue
            yield number, found

    return messages()
