"""dflash-eval --server against a loopback stand-in engine (tests/engine_standin.py, a real process) that
answers in SGLang's and vLLM's exact shapes: τ, histograms and per-position acceptance against a hand
count, the request bodies as z-lab's server path sends them, and the /metrics window excluding warm-up."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from evaluation.benchmarks import build_prompts
from evaluation.server import parse_vllm_metrics, run_server
from tests.evaluation.test_side_by_side import QWEN3_LIKE_TEMPLATE, RECORDS

HERE = Path(__file__).resolve().parents[1]
# request 0 is the warm-up; requests 1..4 decode with steps [3, 1, 4], [2, 2], [8, 8, 8], [3, 1, 4]
ACCEPTS = [[8, 8, 8], [3, 1, 4], [2, 2]]
HIST = [2, 2, 2, 2, 0, 0, 0, 3]  # steps by committed length 1..8 over requests 1..4
GSM8K_TEXT = (
    "<|im_start|>user\nNatalia sold clips to 48 of her friends in April, and then she sold half as many clips in"
    " May. How many clips did Natalia sell altogether in April and May?\nPlease reason step by step, and put your"
    " final answer within \\boxed{}.<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from demo.tiny import train_tokenizer

    path = tmp_path_factory.mktemp("tok")
    tok = train_tokenizer([f"count {i} and say hello" for i in range(50)], 300, path)
    tok.chat_template = QWEN3_LIKE_TEMPLATE
    tok.save_pretrained(path)
    return path


def start(engine: str, tmp_path: Path) -> tuple[subprocess.Popen, str]:
    port_file = tmp_path / f"{engine}.port"
    proc = subprocess.Popen(
        [
            sys.executable,
            str(HERE / "engine_standin.py"),
            "--engine",
            engine,
            "--port-file",
            str(port_file),
            "--accepts",
            json.dumps(ACCEPTS),
            "--lifetime",
            "60",
        ]
    )
    deadline = time.monotonic() + 30
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"stand-in {engine} did not start")
        time.sleep(0.05)
    return proc, f"http://127.0.0.1:{port_file.read_text()}"


@pytest.fixture
def engine(request, tmp_path):
    proc, url = start(request.param, tmp_path)
    yield request.param, url
    proc.kill()
    proc.wait(timeout=10)


@pytest.mark.parametrize("engine", ["sglang", "vllm"], indirect=True)
def test_server_figures_against_a_hand_count(engine, tokenizer_dir):
    from transformers import AutoTokenizer

    kind, url = engine
    prompts = build_prompts("gsm8k", RECORDS["gsm8k"] * 2)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir) if kind == "sglang" else None
    r = run_server(url, prompts, tokenizer=tok, max_new_tokens=64, chat_template_kwargs={"enable_thinking": False})
    assert (r.engine, r.requests, r.completion_tokens, r.verify_steps) == (kind, 4, 44, 11)
    assert r.accept_histogram == HIST
    sent = httpx.get(f"{url}/requests").json()
    assert len(sent) == 5  # the warm-up, then the four
    if kind == "sglang":  # mean over requests of completion_tokens / spec_verify_ct, as z-lab prints it
        assert r.tau == pytest.approx((8 / 3 + 4 / 2 + 24 / 3 + 8 / 3) / 4)
        assert sent[1] == {
            "text": GSM8K_TEXT,
            "sampling_params": {"temperature": 0.0, "top_p": 1.0, "top_k": 1, "max_new_tokens": 64},
        }
    else:  # pooled over the /metrics window: 1 + 33 accepted / 11 drafts; the warm-up's 3 drafts left out
        assert r.tau == pytest.approx(1 + 33 / 11)
        assert r.per_position_acceptance == pytest.approx([9 / 11, 7 / 11, 5 / 11, 3 / 11, 3 / 11, 3 / 11, 3 / 11])
        assert sent[1] == {
            "model": "tiny-target",
            "messages": [{"role": "user", "content": prompts[0].turns[0]}],
            "max_tokens": 64,
            "temperature": 0.0,
            "top_p": 1.0,
            "top_k": 1,
            "chat_template_kwargs": {"enable_thinking": False},
        }


def test_vllm_exposition_is_summed_over_engines_and_skips_created():
    text = (
        "# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.\n"
        "# TYPE vllm:spec_decode_num_drafts_total counter\n"
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 5.0\n'
        'vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 7.0\n'
        'vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e+09\n'
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 9.0\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 2.0\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="0"} 4.0\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 3.0\n'
    )
    got = parse_vllm_metrics(text)
    assert (got["drafts"], got["accepted"], got["draft_tokens"], got["per_pos"]) == (12.0, 9.0, 0.0, [7.0, 2.0])


def test_cli_server_sglang_json_and_unreachable(tmp_path, tokenizer_dir, capsys):
    from evaluation.cli import main

    (tmp_path / "gsm8k.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS["gsm8k"] * 2))
    proc, url = start("sglang", tmp_path)
    try:
        rc = main(
            [
                "--server",
                url,
                "--target",
                str(tokenizer_dir),
                "--bench",
                f"gsm8k={tmp_path / 'gsm8k.jsonl'}",
                "--num-prompts",
                "3",
                "--max-new-tokens",
                "64",
                "--thinking",
                "on",
                "--json",
            ]
        )
        sent = httpx.get(f"{url}/requests").json()
    finally:
        proc.kill()
        proc.wait(timeout=10)
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and doc["chat_template_kwargs"] == {"enable_thinking": True}
    assert sent[1]["text"] == GSM8K_TEXT.removesuffix("<think>\n\n</think>\n\n")  # thinking on: no empty block
    g = doc["benchmarks"]["gsm8k"]
    assert g["engine"] == "sglang" and g["requests"] == 3 and g["tau"] == pytest.approx((8 / 3 + 2 + 8) / 3)
    assert main(["--server", "http://127.0.0.1:9", "--bench", f"gsm8k={tmp_path / 'gsm8k.jsonl'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dflash-eval: --server http://127.0.0.1:9: cannot connect")
