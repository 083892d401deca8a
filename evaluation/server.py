"""dflash-eval --server URL: the benchmark prompts through a serving engine, with the acceptance it reports.

What each engine reports, from its current source:
- SGLang, `python/sglang/srt/managers/tokenizer_manager_components/spec_decoding_meta.py`
  (`fill_spec_decoding_meta`): the native `POST /generate` answer's `meta_info` carries, per request,
  `completion_tokens`, `spec_verify_ct` (verify steps), `spec_accept_length` (= completion_tokens /
  spec_verify_ct, bonus token included), `spec_accept_rate`, `spec_num_correct_drafts`,
  `spec_num_proposed_drafts` and `spec_correct_drafts_histogram` (steps by number of correct drafts,
  0, 1, …; `spec_accept_histogram` is its older alias). τ = the mean over requests of spec_accept_length
  (what z-lab's `dflash/benchmark.py` `_run_server` prints), histogram summed over requests.
- vLLM, `vllm/v1/spec_decode/metrics.py` (`SpecDecodingProm`): no per-request figures; Prometheus counters
  on `GET /metrics`, `vllm:spec_decode_num_drafts_total`, `vllm:spec_decode_num_draft_tokens_total`,
  `vllm:spec_decode_num_accepted_tokens_total` and `vllm:spec_decode_num_accepted_tokens_per_pos_total`
  (label `position`, from 0), per engine/model label set. Read before and after the run: τ = 1 + Δaccepted /
  Δdrafts (vLLM's "mean acceptance length", pooled over steps, not a mean of per-request means); the
  steps that accepted exactly j drafts are Δper_pos[j-1] - Δper_pos[j] (Δper_pos[-1] = Δdrafts).
Prompts as z-lab's server path sends them: each record's first turn; SGLang gets the text the target's chat
template renders (with `chat_template_kwargs`), vLLM the messages plus `chat_template_kwargs`. One warm-up
request goes first and is left out of the figures (and out of the /metrics window).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

import httpx

from evaluation.benchmarks import BenchPrompt, render_text

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_POSITION = re.compile(r'position="(\d+)"')
VLLM_COUNTERS = {
    "drafts": "vllm:spec_decode_num_drafts",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "accepted": "vllm:spec_decode_num_accepted_tokens",
}
VLLM_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


class ServerError(Exception):
    """The server cannot be reached or answers out of shape: one line naming the URL and what was wrong."""


@dataclass
class ServerResult:
    engine: str
    requests: int
    completion_tokens: int
    seconds: float
    tokens_per_second: float
    tau: float | None  # None: the engine reported no speculative figures (not speculating?)
    tau_source: str
    accept_histogram: list[int] = field(default_factory=list)  # [k-1] = steps that committed k tokens
    verify_steps: int = 0
    per_position_acceptance: list[float] = field(default_factory=list)  # vLLM: share of drafts accepted at k


def parse_vllm_metrics(text: str) -> dict:
    """The speculative counters of a Prometheus exposition, summed over label sets (engines, models)."""
    out = {key: 0.0 for key in VLLM_COUNTERS}
    per_pos: dict[int, float] = {}
    names = {v: k for k, v in VLLM_COUNTERS.items()}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or line.startswith("#"):
            continue
        name, labels, value = m.group(1), m.group(2) or "", m.group(3)
        if name.endswith("_created"):
            continue
        name = name.removesuffix("_total")
        if name in names:
            out[names[name]] += float(value)
        elif name == VLLM_PER_POS and (pos := _POSITION.search(labels)):
            per_pos[int(pos.group(1))] = per_pos.get(int(pos.group(1)), 0.0) + float(value)
    out["per_pos"] = [per_pos.get(i, 0.0) for i in range(max(per_pos) + 1)] if per_pos else []
    return out


def vllm_figures(before: dict, after: dict) -> tuple[float | None, list[int], list[float], int]:
    """(τ, histogram by accepted length 1..K+1, per-position acceptance, steps) of a /metrics window."""
    drafts = round(after["drafts"] - before["drafts"])
    accepted = after["accepted"] - before["accepted"]
    per_pos = [a - b for a, b in zip(after["per_pos"], before["per_pos"] or [0.0] * len(after["per_pos"]), strict=True)]
    if drafts <= 0:
        return None, [], [], 0
    reach = [float(drafts), *per_pos, 0.0]  # reach[j]: steps that accepted at least j drafts
    hist = [round(reach[j] - reach[j + 1]) for j in range(len(per_pos) + 1)]
    return 1.0 + accepted / drafts, hist, [n / drafts for n in per_pos], drafts


def detect_engine(client: httpx.Client, url: str) -> str:
    """SGLang answers GET /get_model_info; vLLM does not (it has /v1/models and /metrics)."""
    try:
        if client.get(f"{url}/get_model_info").status_code == 200:
            return "sglang"
        if client.get(f"{url}/v1/models").status_code == 200:
            return "vllm"
    except httpx.HTTPError as err:
        raise ServerError(f"--server {url}: cannot connect ({err})") from None
    raise ServerError(f"--server {url}: neither SGLang (/get_model_info) nor vLLM (/v1/models) answers")


def _post(client: httpx.Client, url: str, body: dict) -> dict:
    try:
        resp = client.post(url, json=body)
    except httpx.HTTPError as err:
        raise ServerError(f"{url}: request failed ({err})") from None
    if resp.status_code != 200:
        raise ServerError(f"{url}: HTTP {resp.status_code}: {resp.text[:200]}")
    out = resp.json()
    return out if isinstance(out, dict) else out[0]


def _metrics(client: httpx.Client, url: str) -> dict:
    try:
        resp = client.get(f"{url}/metrics")
    except httpx.HTTPError as err:
        raise ServerError(f"{url}/metrics: request failed ({err})") from None
    if resp.status_code != 200:
        raise ServerError(f"{url}/metrics: HTTP {resp.status_code} (start vLLM with its metrics endpoint on)")
    return parse_vllm_metrics(resp.text)


def run_server(
    url: str,
    prompts: list[BenchPrompt],
    *,
    engine: str = "auto",
    tokenizer=None,
    model: str | None = None,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int | None = None,
    chat_template_kwargs: dict | None = None,
    timeout_s: float = 600.0,
) -> ServerResult:
    """Send every prompt's first turn, one at a time; figures as the module docstring says."""
    url = url.rstrip("/")
    top_k = (1 if temperature == 0.0 else -1) if top_k is None else top_k  # z-lab's 1 would make T > 0 greedy
    kwargs = dict(chat_template_kwargs or {})
    with httpx.Client(timeout=timeout_s) as client:
        engine = detect_engine(client, url) if engine == "auto" else engine
        if engine == "sglang" and tokenizer is None:
            raise ServerError("--server with SGLang renders the chat template here: pass --target (its tokenizer)")
        if engine == "vllm" and model is None:
            model = client.get(f"{url}/v1/models").json()["data"][0]["id"]

        def send(p: BenchPrompt) -> dict:
            if engine == "sglang":
                text = render_text(tokenizer, [{"role": "user", "content": p.turns[0]}], kwargs)
                return _post(
                    client,
                    f"{url}/generate",
                    {
                        "text": text,
                        "sampling_params": {
                            "temperature": temperature,
                            "top_p": top_p,
                            "top_k": top_k,
                            "max_new_tokens": max_new_tokens,
                        },
                    },
                )
            return _post(
                client,
                f"{url}/v1/chat/completions",
                {
                    "model": model,
                    "messages": [{"role": "user", "content": p.turns[0]}],
                    "max_tokens": max_new_tokens,
                    "temperature": temperature,
                    "top_p": top_p,
                    "top_k": top_k,
                    "chat_template_kwargs": kwargs,
                },
            )

        if len(prompts) > 1:
            send(prompts[0])  # warm-up, not counted
        before = _metrics(client, url) if engine == "vllm" else None
        t0 = time.perf_counter()
        outs = [send(p) for p in prompts]
        seconds = time.perf_counter() - t0
        after = _metrics(client, url) if engine == "vllm" else None
    if engine == "vllm":
        tokens = sum(int(o.get("usage", {}).get("completion_tokens", 0)) for o in outs)
        tau, hist, per_pos, steps = vllm_figures(before, after)
        source = "vLLM /metrics window: 1 + Δaccepted_tokens / Δdrafts"
        return ServerResult(
            engine,
            len(outs),
            tokens,
            seconds,
            tokens / seconds if seconds > 0 else 0.0,
            tau,
            source,
            hist,
            steps,
            per_pos,
        )
    metas = [o.get("meta_info") or {} for o in outs]
    tokens = sum(int(m.get("completion_tokens", 0)) for m in metas)
    lengths = [float(m["spec_accept_length"]) for m in metas if m.get("spec_accept_length") is not None]
    hist: list[int] = []
    for m in metas:
        h = m.get("spec_correct_drafts_histogram") or m.get("spec_accept_histogram") or []
        hist += [0] * (len(h) - len(hist))
        for i, n in enumerate(h):
            hist[i] += int(n)
    return ServerResult(
        engine,
        len(outs),
        tokens,
        seconds,
        tokens / seconds if seconds > 0 else 0.0,
        sum(lengths) / len(lengths) if lengths else None,
        "SGLang meta_info: mean over requests of spec_accept_length (completion_tokens / spec_verify_ct)",
        hist,
        sum(int(m.get("spec_verify_ct", 0)) for m in metas),
    )


def format_server(name: str, r: ServerResult) -> str:
    tau = f"{r.tau:.3f}" if r.tau is not None else "n/a (no speculative figures reported)"
    total = sum(r.accept_histogram) or 1
    lines = [
        f"{name} via {r.engine}: {r.requests} requests, {r.completion_tokens} tokens, {r.tokens_per_second:.1f} tok/s",
        f"  tau {tau}   [{r.tau_source}]",
        f"  verify steps {r.verify_steps}; accepted 1..{len(r.accept_histogram)} (% of steps): "
        + " ".join(f"{round(100 * n / total)}" for n in r.accept_histogram),
    ]
    if r.per_position_acceptance:
        lines.append("  per-position acceptance: " + " ".join(f"{x:.2f}" for x in r.per_position_acceptance))
    return "\n".join(lines)
