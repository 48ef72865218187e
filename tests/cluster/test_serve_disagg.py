"""``splitserve serve --prefill 1 --decode 1``: two pools behind the router, same answers."""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
import threading

import httpx
import psutil
from procs import die_with_parent, free_port, metric, stop_group

PROMPT = "Explain, step by step, how a hash table handles collisions. " * 12


def _read_lines(stream, out: queue.Queue) -> None:
    for line in stream:
        out.put(line)


def test_disaggregated_serve_matches_offline_and_stops_cleanly():
    from splitserve import LLM, SamplingParams

    messages = [{"role": "user", "content": PROMPT}]
    expected = LLM().chat(messages, SamplingParams(max_tokens=12, temperature=0))[0]
    port = free_port()
    argv = [sys.executable, "-m", "splitserve.cli", "serve", "--port", str(port)]
    argv += ["--prefill", "1", "--decode", "1", "--threads-per-worker", "1"]
    argv += ["--remote-prefill-threshold", "64", "--ready-timeout", "240"]
    launcher = subprocess.Popen(
        argv, stdout=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=die_with_parent
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=_read_lines, args=(launcher.stdout, lines), daemon=True).start()
    try:
        url = f"http://127.0.0.1:{port}"
        assert f"{url}/v1" in lines.get(timeout=240)
        body = {"messages": messages, "max_tokens": 12, "temperature": 0}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == expected.outputs[0].text
        decode_url = r.headers["x-splitserve-decode-worker"]
        assert r.headers.get("x-splitserve-prefill-worker")  # the prompt went to the P pool
        pulled = metric(decode_url, "splitserve:kv_blocks_received_total")
        assert pulled == (len(expected.prompt_token_ids) - 1) // 16
        family = [psutil.Process(launcher.pid), *psutil.Process(launcher.pid).children(True)]
        assert len(family) >= 4  # launcher, prefill worker, decode worker, router
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=60) == 0
        gone, alive = psutil.wait_procs(family, timeout=15)
        assert not alive, f"orphans left behind: {alive}"
    finally:
        stop_group(launcher)
