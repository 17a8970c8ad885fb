"""The chat page in a real browser: Debian's Chromium, headless, driven by
playwright, against a real server on the tiny model. Plus the page's own
client tests under node's test runner.

The screenshot goes to tests/artifacts/ (ignored by git) for a person to look at.
"""

from __future__ import annotations

import re
import shutil
import threading
import subprocess
from pathlib import Path

import pytest

from engine.frontend.async_engine import Command
from live_server import run_server, tiny_config, wait_until
from need import need

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = ROOT / "tests" / "artifacts"


@pytest.fixture
def browser(tmp_path):
    need(Path(CHROMIUM).exists(), "Chromium is not installed (apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        need(False, "playwright is not installed (pip install playwright)")
    with sync_playwright() as playwright:
        # A fresh profile folder: playwright passes it as --user-data-dir.
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=CHROMIUM, headless=True, args=FLAGS)
        yield context
        context.close()


def test_the_page_streams_an_answer_and_stop_aborts_it(browser, tiny_llama_path):
    with run_server(tiny_config(tiny_llama_path)) as live:
        page = browser.new_page()
        page.goto(live.url + "/")
        page.get_by_test_id("status").filter(has_text="Ready").wait_for(timeout=30_000)
        assert page.get_by_test_id("model-picker").input_value() == "tiny"
        states = _answer_states(page, "Tell me about the sea.")
        assert len(states) >= 4, states  # empty, at least two partial texts, the whole
        assert all(later.startswith(earlier) for earlier, later in zip(states, states[1:]))
        status = page.get_by_test_id("status").inner_text()
        assert "tokens/s" in status and "prompt tokens cached" in status, status
        _stop_a_long_answer(page, live)
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "web-chat.png"), full_page=True)


def _answer_states(page, text: str) -> list[str]:
    """Every text the assistant's bubble showed while the answer streamed in."""
    page.evaluate("""() => {
        window.answerStates = [];
        new MutationObserver(() => {
            const bubbles = document.querySelectorAll('[data-testid="message-assistant"]');
            if (bubbles.length) window.answerStates.push(bubbles[bubbles.length - 1].textContent);
        }).observe(document.getElementById("conversation"),
                   {childList: true, subtree: true, characterData: true});
    }""")
    page.get_by_test_id("message-input").fill(text)
    page.get_by_test_id("send").click()
    page.get_by_test_id("stop").wait_for(state="attached")
    page.wait_for_function("() => document.getElementById('stop').disabled === true "
                           "&& window.answerStates.length > 0", timeout=60_000)
    states = page.evaluate("() => window.answerStates")
    return [s for i, s in enumerate(states) if i == 0 or s != states[i - 1]]


def _stop_a_long_answer(page, live) -> None:
    """Stop mid-answer: each engine step is slowed while the browser catches up
    (a busy Chromium can show its first word after the tiny model has filled
    its whole context), then the engine thread is held, so the answer cannot
    finish before the click."""
    engine = live.state.engine
    page.get_by_test_id("new-chat").click()
    page.get_by_test_id("message-input").fill("Count to a thousand.")
    generated = engine.stats.counters["generation_tokens"]
    slow, gate = threading.Event(), threading.Event()
    _pause_between_steps(engine, slow, seconds=0.05)
    try:
        page.get_by_test_id("send").click()
        # Some text, so the request is streaming. (Not has_text=" ": playwright
        # normalizes whitespace, and " " matched the bubble while still empty,
        # before the page's request had reached the engine.)
        answer = page.get_by_test_id("message-assistant").last
        answer.filter(has_text=re.compile(r"\S")).wait_for(timeout=30_000)
        engine._submit(Command(lambda: gate.wait(30)))
        assert engine.num_open == 1
        page.get_by_test_id("stop").click()
        page.get_by_test_id("status").filter(has_text="Stopped").wait_for(timeout=10_000)
    finally:
        slow.set()
        gate.set()
    assert wait_until(lambda: engine.num_open == 0 and engine.stats.counters[
        "num_requests_running"] == 0, 10)
    room = live.state.config.engine.max_model_len
    assert engine.stats.counters["generation_tokens"] - generated < room - 20


def _pause_between_steps(engine, done: threading.Event, seconds: float) -> None:
    """Until `done` is set, the engine thread sleeps `seconds` before every step:
    a command that queues itself again runs once per pass of the engine loop."""
    def pause() -> None:
        if not done.wait(seconds):
            engine._submit(Command(pause))
    engine._submit(Command(pause))


def test_the_page_asks_for_a_key_when_the_server_needs_one(browser, tiny_llama_path):
    with run_server(tiny_config(tiny_llama_path, api_keys=("secret",))) as live:
        page = browser.new_page()
        page.goto(live.url + "/")  # the page itself needs no key
        page.get_by_test_id("status").filter(has_text="needs an API key").wait_for(timeout=30_000)
        page.get_by_test_id("api-key").fill("secret")
        page.get_by_test_id("api-key").dispatch_event("change")
        page.get_by_test_id("status").filter(has_text="Ready").wait_for(timeout=30_000)
        page.get_by_test_id("message-input").fill("Hello")
        page.get_by_test_id("send").click()
        page.get_by_test_id("status").filter(has_text="tokens/s").wait_for(timeout=60_000)
        assert page.get_by_test_id("message-assistant").last.inner_text()


def test_the_page_shows_a_thought_greyed_above_the_answer(browser, smollm2_path, tmp_path):
    """A tiny Qwen3 taught to close its thought (tests/service/test_reasoning_http.py
    says how), served with --reasoning-parser qwen3 and greedy by default."""
    import json

    from transformers import AutoTokenizer

    from tiny_models import THINK_TOKENS, make_tiny_thinker, teach_to_end_thought

    question, max_tokens = "What is two plus two?", 24
    folder = make_tiny_thinker(tmp_path / "thinker", smollm2_path)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                           tokenize=False, add_generation_prompt=True)
    taught = teach_to_end_thought(folder, tokenizer.encode(prompt, add_special_tokens=False),
                                  max_tokens)
    thought, answer = tokenizer.decode(taught).split(THINK_TOKENS[1])
    generation = folder / "generation_config.json"  # the page sends no temperature
    generation.write_text(json.dumps({**json.loads(generation.read_text()), "temperature": 0.0}))
    with run_server(tiny_config(folder, reasoning_parser="qwen3")) as live:
        page = browser.new_page()
        page.goto(live.url + "/")
        page.get_by_test_id("status").filter(has_text="Ready").wait_for(timeout=30_000)
        page.get_by_test_id("max-tokens").fill(str(max_tokens))
        page.get_by_test_id("message-input").fill(question)
        page.get_by_test_id("send").click()
        page.get_by_test_id("status").filter(has_text="tokens/s").wait_for(timeout=60_000)
        shown = page.get_by_test_id("thought").last
        assert shown.is_visible() and shown.text_content() == thought
        assert page.get_by_test_id("message-assistant").last.text_content() == thought + answer
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "web-chat-thought.png"), full_page=True)


def test_the_js_client_under_node():
    node = shutil.which("node")
    need(node is not None, "node is not installed")
    result = subprocess.run([node, "--test", "clients/web/sse.test.mjs"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "# fail 0" in result.stdout
