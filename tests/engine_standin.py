"""A loopback stand-in for a serving engine running speculative decoding, for tests of dflash-eval --server.

    python tests/engine_standin.py --engine sglang|vllm --port-file F --accepts '[[3, 1, 4], [2, 2]]' [--lifetime 60]

Request i (in arrival order, the warm-up included) "decodes" with the accept lengths accepts[i % len] and
answers in the engine's own shapes:
- sglang: POST /generate -> {"text", "output_ids", "meta_info"} with the fields SGLang's
  `fill_spec_decoding_meta` writes (python/sglang/srt/managers/tokenizer_manager_components/
  spec_decoding_meta.py); GET /get_model_info answers.
- vllm: POST /v1/chat/completions -> an OpenAI chat completion with `usage`; GET /metrics -> the Prometheus
  text exposition of vLLM's SpecDecodingProm counters (vllm/v1/spec_decode/metrics.py) as prometheus_client
  renders them (`_total` samples, `_created` gauges), for two engines (requests alternate), starting from
  non-zero counts as a server that has served before would; GET /v1/models lists the model.
GET /requests returns every request body received. Binds 127.0.0.1 only and exits after --lifetime seconds.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

BLOCK = 8  # speculative_num_draft_tokens: a verify step proposes BLOCK - 1 drafts
MODEL = "tiny-target"
COUNTERS = (
    ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", "drafts"),
    ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", "draft_tokens"),
    ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", "accepted"),
)


class State:
    def __init__(self, accepts: list[list[int]]):
        self.accepts = accepts
        self.lock = threading.Lock()
        self.requests: list[dict] = []
        # vLLM counters per engine, as after one earlier request of steps [8, 1] on each engine
        self.counters = {e: {"drafts": 2, "draft_tokens": 14, "accepted": 7, "per_pos": [1] * 7} for e in "01"}

    def take(self, body: dict) -> tuple[int, list[int]]:
        with self.lock:
            i = len(self.requests)
            self.requests.append(body)
            return i, self.accepts[i % len(self.accepts)]


def sglang_answer(i: int, steps: list[int]) -> dict:
    tokens, verify = sum(steps), len(steps)
    correct = sum(s - 1 for s in steps)
    proposed = verify * (BLOCK - 1)
    hist = [sum(1 for s in steps if s - 1 == k) for k in range(BLOCK)]
    meta = {
        "id": f"req-{i}",
        "finish_reason": {"type": "length", "length": tokens},
        "prompt_tokens": 17,
        "weight_version": "default",
        "completion_tokens": tokens,
        "cached_tokens": 0,
        "e2e_latency": 0.01,
        "spec_accept_rate": correct / proposed,
        "spec_accept_length": tokens / verify,
        "spec_num_correct_drafts": correct,
        "spec_num_proposed_drafts": proposed,
        "spec_verify_ct": verify,
        "spec_accepted_drafts": correct,
        "spec_proposed_drafts": proposed,
        "spec_correct_drafts_histogram": hist,
        "spec_accept_histogram": hist,
    }
    return {"text": " ok" * tokens, "output_ids": list(range(tokens)), "meta_info": meta}


def vllm_answer(state: State, i: int, steps: list[int]) -> dict:
    c = state.counters["01"[i % 2]]
    with state.lock:
        c["drafts"] += len(steps)
        c["draft_tokens"] += len(steps) * (BLOCK - 1)
        c["accepted"] += sum(s - 1 for s in steps)
        for s in steps:
            for k in range(s - 1):
                c["per_pos"][k] += 1
    tokens = sum(steps)
    return {
        "id": f"chatcmpl-{i}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": " ok" * tokens, "tool_calls": []},
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
            }
        ],
        "usage": {"prompt_tokens": 17, "total_tokens": 17 + tokens, "completion_tokens": tokens},
    }


def exposition(state: State) -> str:
    lines = [
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
    ]
    lines += [f'vllm:num_requests_running{{engine="{e}",model_name="{MODEL}"}} 0.0' for e in "01"]
    with state.lock:
        for name, doc, key in COUNTERS:
            lines += [f"# HELP {name}_total {doc}", f"# TYPE {name}_total counter"]
            lines += [
                f'{name}_total{{engine="{e}",model_name="{MODEL}"}} {float(c[key])}' for e, c in state.counters.items()
            ]
            lines += [f"# HELP {name}_created {doc}", f"# TYPE {name}_created gauge"]
            lines += [f'{name}_created{{engine="{e}",model_name="{MODEL}"}} 1.7e+09' for e in state.counters]
        name = "vllm:spec_decode_num_accepted_tokens_per_pos"
        lines += [f"# HELP {name}_total Accepted tokens per draft position.", f"# TYPE {name}_total counter"]
        for e, c in state.counters.items():
            lines += [
                f'{name}_total{{engine="{e}",model_name="{MODEL}",position="{k}"}} {float(n)}'
                for k, n in enumerate(c["per_pos"])
            ]
    return "\n".join(lines) + "\n"


def handler(engine: str, state: State):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def _send(self, code: int, body: str, kind: str = "application/json"):
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/requests":
                return self._send(200, json.dumps(state.requests))
            if engine == "sglang" and self.path == "/get_model_info":
                return self._send(200, json.dumps({"model_path": MODEL, "is_generation": True}))
            if engine == "vllm" and self.path == "/v1/models":
                return self._send(200, json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}))
            if engine == "vllm" and self.path == "/metrics":
                return self._send(200, exposition(state), "text/plain; version=0.0.4; charset=utf-8")
            self._send(404, json.dumps({"detail": "Not Found"}))

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if engine == "sglang" and self.path == "/generate":
                i, steps = state.take(body)
                return self._send(200, json.dumps(sglang_answer(i, steps)))
            if engine == "vllm" and self.path == "/v1/chat/completions":
                i, steps = state.take(body)
                return self._send(200, json.dumps(vllm_answer(state, i, steps)))
            self._send(404, json.dumps({"detail": "Not Found"}))

    return Handler


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=["sglang", "vllm"], required=True)
    ap.add_argument("--port-file", required=True)
    ap.add_argument("--accepts", required=True)
    ap.add_argument("--lifetime", type=float, default=60.0)
    args = ap.parse_args()
    state = State(json.loads(args.accepts))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler(args.engine, state))
    threading.Timer(args.lifetime, server.shutdown).start()  # bounded: never outlives a test by long
    tmp = Path(args.port_file + ".tmp")
    tmp.write_text(str(server.server_address[1]))
    tmp.rename(args.port_file)
    server.serve_forever()


if __name__ == "__main__":
    main()
