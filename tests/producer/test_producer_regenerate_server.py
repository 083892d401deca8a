"""Regeneration through a real OpenAI-compatible server: `transformers serve` on a tiny target, started here.

Every record once with 4 requests in flight, greedy answers equal to the local path's, a SIGKILL of
regenerate and a kill of the server mid-run (both resumable), retries and failed records, pass-through of
sampling parameters and chat_template_kwargs.
"""

import json
import signal
import subprocess
import sys
import time

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from bench.regenerate import TransformersServe
from demo.tiny import build_tiny_target, corpus_texts, synthetic_chats, train_tokenizer, write_jsonl
from producer.regenerate import iter_prompts, main, regenerate, regenerate_server
from producer.regenerate_server import ServerOptions

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    tok = train_tokenizer(corpus_texts(synthetic_chats(60)), 500, root / "tok")
    model_dir = build_tiny_target(root / "model", tok, num_layers=2, hidden_size=32, intermediate_size=64)
    lines = [json.dumps(c) for c in synthetic_chats(16, seed=11)]
    lines.insert(3, "{broken")
    lines.insert(5, json.dumps({"messages": [{"role": "user", "content": "no answer yet"}]}))
    prompts = root / "prompts.jsonl"
    prompts.write_text("\n".join(lines) + "\n")
    many = write_jsonl(root / "many.jsonl", synthetic_chats(30, seed=12, max_turns=1))
    return root, model_dir, prompts, many


@pytest.fixture(scope="module")
def server(assets):
    root, model_dir, _, _ = assets
    with TransformersServe(model_dir, root / "serve.log", threads=1) as s:
        yield s


def cli(url, prompts, out, *extra, **popen):
    cmd = [sys.executable, "-m", "producer", "regenerate", "--server", url, "--prompts", str(prompts),
           "--out", str(out), *extra]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def run_main(capsys, url, prompts, out, *extra):
    """The same command in this process (no interpreter start-up): (status, stdout, stderr)."""
    capsys.readouterr()
    rc = main(["--server", url, "--prompts", str(prompts), "--out", str(out), *extra])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def finish(proc, timeout=300):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def records(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def wait_for_lines(path, n, proc, timeout=300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_bytes().count(b"\n") >= n:
            return
        assert proc.poll() is None, f"regenerate ended early: {proc.communicate()}"
        time.sleep(0.02)
    raise AssertionError(f"{path}: fewer than {n} lines after {timeout} s")


def test_concurrency_4_writes_every_record_once(assets, server, tmp_path, capsys):
    _, model_dir, prompts, _ = assets
    expected = {n: m for n, m in iter_prompts(prompts)}
    out = tmp_path / "served.jsonl"
    rc, stdout, stderr = finish(cli(server.url, prompts, out, "--concurrency", "4", "--max-new-tokens", "8",
                                    "--progress-interval", "0"))  # fmt: skip
    assert rc == 0, stderr
    served = records(out)
    assert sorted(r["prompt_line"] for r in served) == sorted(expected) and len(served) == 17
    for r in served:
        assert r["messages"][:-1] == expected[r["prompt_line"]]
        assert r["messages"][-1]["role"] == "assistant" and r["finish"] in ("stop", "length")
    assert "records/s" in stdout and "tokens/s" in stdout and "ETA" in stdout
    assert "done, 17 written, 0 already present, 0 failed" in stdout
    # a rerun has nothing left to do
    rc, stdout, _ = run_main(capsys, server.url, prompts, out, "--concurrency", "4", "--max-new-tokens", "8")
    assert rc == 0 and "done, 0 written, 17 already present" in stdout
    assert len(records(out)) == 17

    # greedy: the same tokens as the local path. transformers serve runs its Qwen response parser on a Qwen3
    # model: it decodes keeping special tokens (only EOS ends the text), strips surrounding whitespace and
    # would split a <think> block into reasoning_content; the local path decodes skipping special tokens.
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    local = tmp_path / "local.jsonl"
    regenerate(model_dir, prompts, local, batch_size=1, max_new_tokens=8, dtype="float32")
    by_line = {r["prompt_line"]: r for r in records(local)}
    for r in served:
        ids = greedy_ids(tok, model, expected[r["prompt_line"]], 8)
        assert by_line[r["prompt_line"]]["messages"][-1]["content"] == tok.decode(ids, skip_special_tokens=True)
        raw = tok.decode(ids[:-1] if ids[-1] == tok.eos_token_id else ids)
        assert "<think>" not in raw
        assert r["messages"][-1]["content"] == raw.strip()
        assert r["finish"] == by_line[r["prompt_line"]]["finish"]


def greedy_ids(tok, model, messages, max_new_tokens):
    enc = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
    ids = out[0, enc["input_ids"].shape[1] :].tolist()
    return ids[: ids.index(tok.eos_token_id) + 1] if tok.eos_token_id in ids else ids


def test_greedy_answers_equal_the_local_path_without_a_response_parser(assets, tmp_path, capsys):
    """A Llama-architecture tiny target: transformers serve returns its plain decode, as vLLM and SGLang do
    without a reasoning parser; every record equals the local path's, text and finish."""
    _, qwen_dir, prompts, _ = assets
    tok = AutoTokenizer.from_pretrained(qwen_dir)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)  # fmt: skip
    torch.manual_seed(1)
    model = LlamaForCausalLM(cfg)
    model.generation_config.eos_token_id = tok.eos_token_id
    model_dir = tmp_path / "llama"
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    served, local = tmp_path / "served.jsonl", tmp_path / "local.jsonl"
    with TransformersServe(model_dir, tmp_path / "serve.log", threads=1) as llama:
        rc, _, stderr = run_main(capsys, llama.url, prompts, served, "--concurrency", "4", "--max-new-tokens", "12")
    assert rc == 0, stderr
    regenerate(model_dir, prompts, local, batch_size=1, max_new_tokens=12, dtype="float32")
    by_line = {r["prompt_line"]: r for r in records(local)}
    assert len(by_line) == 17
    assert sorted(records(served), key=lambda r: r["prompt_line"]) == [by_line[n] for n in sorted(by_line)]


def test_sigkill_mid_run_then_rerun_completes_without_duplicates(assets, server, tmp_path, capsys, caplog):
    _, _, _, many = assets
    out = tmp_path / "out.jsonl"
    args = ("--concurrency", "4", "--max-new-tokens", "48")
    proc = cli(server.url, many, out, *args)
    wait_for_lines(out, 4, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    written = out.read_bytes().count(b"\n")
    assert 4 <= written < 30, "the kill came after the end: nothing was interrupted"
    with out.open("ab") as f:
        f.write(b'{"messages": [{"role": "user", "con')  # a write torn by the kill
    rc, stdout, stderr = run_main(capsys, server.url, many, out, *args)
    assert rc == 0, stderr
    lines = sorted(r["prompt_line"] for r in records(out))
    assert lines == list(range(1, 31))
    assert f"done, {30 - written} written, {written} already present" in stdout
    assert "dropping a truncated last line" in caplog.text


def test_unreachable_server_and_wrong_url(assets, server, tmp_path, capsys):
    _, _, prompts, _ = assets
    rc, _, stderr = run_main(capsys, "http://127.0.0.1:9/v1", prompts, tmp_path / "o.jsonl", "--retries", "1",
                             "--backoff", "0.05")  # fmt: skip
    assert rc == 2 and "server unreachable after 2 tries" in stderr
    rc, _, stderr = run_main(capsys, server.url.removesuffix("/v1") + "/nope", prompts, tmp_path / "o.jsonl")
    assert rc == 2 and "HTTP 404 (is --server the API base, ending in /v1?)" in stderr
    assert not (tmp_path / "o.jsonl").exists() or (tmp_path / "o.jsonl").read_bytes() == b""


class FlakyServer:
    """An in-process OpenAI endpoint (httpx transport): 500 twice for one prompt, 400 for another."""

    def __init__(self):
        self.bodies, self.tries = [], {}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/models"):
            return httpx.Response(200, json={"data": [{"id": "tiny"}]})
        body = json.loads(request.content)
        self.bodies.append(body)
        prompt = body["messages"][-1]["content"]
        self.tries[prompt] = self.tries.get(prompt, 0) + 1
        if prompt == "poison":
            return httpx.Response(400, json={"error": "bad request"})
        if prompt == "flaky" and self.tries[prompt] <= 2:
            return httpx.Response(503, text="overloaded")
        answer = {"role": "assistant", "content": f"re: {prompt}", "reasoning_content": "thought"}
        return httpx.Response(200, json={"choices": [{"message": answer, "finish_reason": "stop"}],
                                         "usage": {"completion_tokens": 3}})  # fmt: skip


def test_retries_failed_records_and_pass_through(tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"messages": [{"role": "user", "content": c}]}
                                                 for c in ("a", "flaky", "poison", "b")])  # fmt: skip
    out = tmp_path / "o.jsonl"
    fake = FlakyServer()
    opts = ServerOptions(url="http://fake/v1", concurrency=2, retries=3, backoff_s=0.01, temperature=0.7,
                         top_p=0.8, seed=5, chat_template_kwargs={"enable_thinking": False},
                         extra_body={"top_k": 20})  # fmt: skip
    stats = regenerate_server(prompts, out, opts, transport=httpx.MockTransport(fake))
    assert stats.written == 3 and fake.tries["flaky"] == 3 and fake.tries["poison"] == 1
    assert stats.failed == [(f"{prompts}:3", 'HTTP 400: {"error":"bad request"}')]
    by_line = {r["prompt_line"]: r for r in records(out)}
    assert sorted(by_line) == [1, 2, 4]
    assert by_line[2]["messages"][-1] == {"role": "assistant", "content": "re: flaky", "reasoning_content": "thought"}
    body = fake.bodies[0]
    assert body["chat_template_kwargs"] == {"enable_thinking": False} and body["top_k"] == 20
    assert body["temperature"] == 0.7 and body["top_p"] == 0.8 and body["model"] == "tiny"
    assert {b["seed"] for b in fake.bodies if b["messages"][-1]["content"] == "a"} == {5 * 1_000_003 + 1}
    # the rerun retries only the failed record
    fake.bodies.clear()
    stats = regenerate_server(prompts, out, opts, transport=httpx.MockTransport(fake))
    assert [b["messages"][-1]["content"] for b in fake.bodies] == ["poison"] and stats.already_done == 3


def test_server_killed_mid_run_is_a_clear_error_and_resumable(assets, server, tmp_path, capsys):
    """Last in the module: it kills the module's server."""
    _, model_dir, _, many = assets
    out = tmp_path / "out.jsonl"
    args = ("--concurrency", "4", "--max-new-tokens", "48", "--retries", "2", "--backoff", "0.1")
    proc = cli(server.url, many, out, *args)
    wait_for_lines(out, 3, proc)
    server.kill()
    rc, _, stderr = finish(proc, timeout=120)
    assert rc == 2
    assert "cannot connect" in stderr and "rerun the same command to resume" in stderr
    assert "Traceback" not in stderr
    written = out.read_bytes().count(b"\n")
    assert 3 <= written < 30
    with TransformersServe(model_dir, tmp_path / "serve-b.log", threads=1) as second:  # a new port
        rc, stdout, stderr = run_main(capsys, second.url, many, out, *args)
    assert rc == 0, stderr
    assert sorted(r["prompt_line"] for r in records(out)) == list(range(1, 31))
    assert f"{written} already present" in stdout
