"""Regenerate answers through an OpenAI-compatible server (vLLM, SGLang, `transformers serve`).

The serving engine batches what is in flight, so throughput comes from concurrency: `concurrency` workers
each keep one chat-completions request open. A request that fails on the connection, times out, or gets a
5xx or 429 is retried with exponential backoff; a record that still fails is reported (file:line and the
reason) and left out of the output, so rerunning the same command retries exactly those. A server that
cannot be reached at all ends the run with an error (nothing is lost; rerun to resume).

Output and resumption are the local path's (producer/regenerate.py): each record is one `os.write` of a
whole line on an O_APPEND descriptor, identified by its `prompt_line`. Records complete out of order, so
resumption is by identity, not by line count: on restart, the `prompt_line`s already in the file are
skipped and a torn last line (SIGKILL mid-write) is cut off; a request in flight at the kill is simply
made again. Nothing is written twice, nothing is lost.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from producer.data import DataError, Message

log = logging.getLogger(__name__)

RETRY_STATUS = {408, 429, 500, 502, 503, 504}


class ServerError(RuntimeError):
    """The server cannot be used at all (unreachable, wrong URL, no such model); the run stops."""


class RecordFailed(Exception):
    """One record failed for good; `reason` says why (the last error)."""


@dataclass
class ServerOptions:
    url: str  # the API base, e.g. http://127.0.0.1:8000/v1
    model: str | None = None  # default: the one model the server lists
    concurrency: int = 8
    timeout_s: float = 600.0  # per request
    retries: int = 5  # tries after the first
    backoff_s: float = 1.0  # first retry delay; doubles, with jitter, up to backoff_max_s
    backoff_max_s: float = 30.0
    progress_s: float = 10.0
    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    extra_body: dict[str, Any] = field(default_factory=dict)  # e.g. {"top_k": 20} for vLLM/SGLang


@dataclass
class ServerStats:
    records: int  # records in the input file (usable or not)
    already_done: int = 0
    written: int = 0
    failed: list[tuple[str, str]] = field(default_factory=list)  # (file:line, reason)
    new_tokens: int = 0
    seconds: float = 0.0


class Progress:
    """One line every `interval` seconds: records done, records/s, tokens/s, ETA."""

    def __init__(self, stats: ServerStats, interval: float, todo: int):
        self.stats, self.interval, self.todo = stats, interval, todo
        self.start = time.perf_counter()
        self.last = self.start

    def maybe_print(self, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self.last < self.interval:
            return
        self.last = now
        s = self.stats
        s.seconds = now - self.start
        finished = s.written + len(s.failed)
        rate = s.written / max(s.seconds, 1e-9)
        left = max(self.todo - finished, 0)
        eta = f"{left / rate:.0f} s" if rate > 0 else "?"
        print(
            f"regenerate: {s.already_done + s.written}/{s.already_done + self.todo} records"
            f" ({s.already_done} were present), {rate:.3f} records/s,"
            f" {s.new_tokens / max(s.seconds, 1e-9):.1f} tokens/s, ETA {eta}, {len(s.failed)} failed",
            flush=True,
        )


def request_body(messages: list[Message], number: int, opts: ServerOptions, model: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": m["role"], "content": m["content"]} for m in messages],
        "max_tokens": opts.max_new_tokens,
        "temperature": opts.temperature,
        "stream": False,
    }
    if opts.temperature > 0:
        body["top_p"] = opts.top_p
        body["seed"] = opts.seed * 1_000_003 + number  # per record: the same answer whatever the order
    if opts.chat_template_kwargs:
        body["chat_template_kwargs"] = opts.chat_template_kwargs
    body.update(opts.extra_body)
    return body


def parse_answer(payload: Any) -> tuple[Message, str, int]:
    """A chat-completions response → (assistant message, finish reason, completion tokens)."""
    try:
        choice = payload["choices"][0]
        message = choice["message"]
        content = message.get("content") or ""
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        finish = choice.get("finish_reason") or "stop"
        tokens = int((payload.get("usage") or {}).get("completion_tokens", 0))
    except (KeyError, IndexError, TypeError, AttributeError, ValueError) as err:
        raise RecordFailed(f"unexpected response ({type(err).__name__}: {err}): {str(payload)[:200]}") from None
    if not isinstance(content, str):
        raise RecordFailed(f"response content is not a string: {str(content)[:200]}")
    answer: Message = {"role": "assistant", "content": content}
    if isinstance(reasoning, str) and reasoning:
        answer["reasoning_content"] = reasoning  # a server's reasoning parser split it off; templates re-join it
    return answer, "length" if finish == "length" else "stop", tokens


class Client:
    """Chat completions with retries; raises RecordFailed for one record, ServerError for the server."""

    def __init__(self, opts: ServerOptions, transport: httpx.AsyncBaseTransport | None = None):
        self.opts = opts
        self.base = opts.url.rstrip("/")
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(opts.timeout_s, connect=min(opts.timeout_s, 30.0)),
            limits=httpx.Limits(max_connections=opts.concurrency, max_keepalive_connections=opts.concurrency),
            transport=transport,  # None: real sockets (tests may route requests elsewhere)
        )

    async def close(self) -> None:
        await self.http.aclose()

    def _delay(self, attempt: int) -> float:
        return min(self.opts.backoff_s * 2**attempt, self.opts.backoff_max_s) * random.uniform(0.5, 1.0)

    async def model_name(self) -> str:
        """The --model value, or the one model the server lists; also proves the URL is an OpenAI API."""
        url = f"{self.base}/models"
        for attempt in range(self.opts.retries + 1):
            try:
                resp = await self.http.get(url)
            except httpx.TransportError as err:
                if attempt == self.opts.retries:
                    raise ServerError(
                        f"{url}: server unreachable after {attempt + 1} tries ({type(err).__name__}: {err})"
                    ) from None
                await asyncio.sleep(self._delay(attempt))
                continue
            if resp.status_code in RETRY_STATUS and attempt < self.opts.retries:
                await asyncio.sleep(self._delay(attempt))
                continue
            if resp.status_code != 200:
                raise ServerError(
                    f"{url}: HTTP {resp.status_code} (is --server the API base, ending in /v1?): {resp.text[:200]}"
                )
            try:
                ids = [m["id"] for m in resp.json()["data"]]
            except (ValueError, KeyError, TypeError):
                raise ServerError(f"{url}: not an OpenAI model list: {resp.text[:200]}") from None
            if self.opts.model:
                if ids and self.opts.model not in ids:
                    log.warning("%s: the server lists %s, not %r; sending it anyway", url, ids, self.opts.model)
                return self.opts.model
            if len(ids) != 1:
                raise ServerError(f"{url}: the server lists {len(ids)} models {ids}; choose one with --model")
            return ids[0]
        raise AssertionError("unreachable")

    async def complete(self, body: dict[str, Any]) -> tuple[Message, str, int]:
        url = f"{self.base}/chat/completions"
        reason = ""
        for attempt in range(self.opts.retries + 1):
            if attempt:
                await asyncio.sleep(self._delay(attempt - 1))
            try:
                resp = await self.http.post(url, json=body)
            except httpx.ConnectError as err:
                reason = f"cannot connect ({err})"
                continue
            except httpx.TransportError as err:  # timeouts, a dropped connection, ...
                reason = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
                continue
            if resp.status_code == 200:
                try:
                    return parse_answer(resp.json())
                except ValueError:
                    raise RecordFailed(f"response is not JSON: {resp.text[:200]}") from None
            reason = f"HTTP {resp.status_code}: {resp.text[:200]}"
            if resp.status_code not in RETRY_STATUS:
                raise RecordFailed(reason)  # the request itself is wrong: retrying will not help
        if reason.startswith("cannot connect"):
            raise ServerError(f"{url}: {reason} after {self.opts.retries + 1} tries")
        raise RecordFailed(f"{reason} (after {self.opts.retries + 1} tries)")


async def regenerate_via_server(
    prompts: Iterator[tuple[int, str, list[Message]]],
    fd: int,
    opts: ServerOptions,
    stats: ServerStats,
    todo: int,
    transport: httpx.AsyncBaseTransport | None = None,
) -> None:
    """Answer every (number, location, messages); append each record to `fd` as it completes."""
    client = Client(opts, transport)
    progress = Progress(stats, opts.progress_s, todo)
    last_sync = time.monotonic()
    try:
        model = await client.model_name()
        log.info("regenerating with %s at %s, %d requests in flight", model, opts.url, opts.concurrency)

        async def worker() -> None:
            nonlocal last_sync
            for number, where, messages in prompts:  # shared iterator: each prompt goes to one worker
                try:
                    answer, finish, tokens = await client.complete(request_body(messages, number, opts, model))
                except RecordFailed as err:
                    stats.failed.append((where, str(err)))
                    log.warning("%s: record failed, not written: %s", where, err)
                    continue
                record = {"messages": [*messages, answer], "prompt_line": number, "finish": finish}
                os.write(fd, (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))
                stats.written += 1
                stats.new_tokens += tokens
                if time.monotonic() - last_sync >= 1.0:
                    os.fsync(fd)
                    last_sync = time.monotonic()
                progress.maybe_print()

        workers = [asyncio.create_task(worker()) for _ in range(opts.concurrency)]
        try:
            await asyncio.gather(*workers)
        finally:
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
    finally:
        os.fsync(fd)
        await client.close()
        progress.maybe_print(force=True)


def check_options(opts: ServerOptions) -> None:
    if opts.concurrency < 1:
        raise DataError(f"--concurrency must be at least 1, got {opts.concurrency}")
    if not opts.url.startswith(("http://", "https://")):
        raise DataError(f"--server {opts.url!r}: expected an http(s) URL such as http://127.0.0.1:8000/v1")
