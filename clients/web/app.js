// The chat page: a conversation with the server that serves this page, over
// the same streaming client any frontend can import (pagedserve.js).
import { Client } from "./pagedserve.js";

const $ = (id) => document.getElementById(id);
const state = { client: null, messages: [], controller: null };

// The key stays in this tab only (sessionStorage), never in the page's URL.
const apiKey = () => $("api-key").value.trim() || null;

function newSession(announce = false) {
  state.messages = [];
  state.client = new Client({ sessionId: crypto.randomUUID(), model: $("model").value || null,
                              apiKey: apiKey() });
  $("conversation").replaceChildren();
  if (announce) $("status").textContent = "New conversation.";
}

function bubble(role, text) {
  const element = document.createElement("div");
  element.className = `message ${role}`;
  element.dataset.testid = `message-${role}`;
  element.textContent = text;
  $("conversation").append(element);
  element.scrollIntoView({ block: "end" });
  return element;
}

function busy(on) {
  $("send").disabled = on;
  $("stop").disabled = !on;
}

async function send(text) {
  const system = $("system").value.trim();
  const history = system ? [{ role: "system", content: system }, ...state.messages] : state.messages;
  const messages = [...history, { role: "user", content: text }];
  state.messages.push({ role: "user", content: text });
  bubble("user", text);
  const output = bubble("assistant", "");
  // A thinking model's reasoning, greyed above the answer (hidden until there is some).
  const thought = document.createElement("div");
  thought.className = "thought";
  thought.dataset.testid = "thought";
  thought.hidden = true;
  const answer = document.createElement("span");
  output.append(thought, answer);
  state.controller = new AbortController();
  busy(true);
  const started = performance.now();
  let first = null;
  let pieces = 0;
  const params = { max_tokens: Number($("max-tokens").value) || undefined };
  const stream = state.client.chatStream(messages, params, { signal: state.controller.signal });
  try {
    for await (const piece of stream) {
      first ??= performance.now();
      pieces += 1;
      if (stream.thought) {
        thought.hidden = false;
        thought.textContent = stream.thought;
      }
      answer.textContent += piece;
      output.scrollIntoView({ block: "end" });
    }
    report(stream, started, first, pieces);
  } catch (error) {
    if (error.name === "AbortError") {
      $("status").textContent = "Stopped.";
    } else {
      output.classList.add("error");
      answer.textContent += (answer.textContent ? "\n" : "") + `Error: ${error.message}`;
      $("status").textContent = "The server refused or failed.";
    }
  } finally {
    state.messages.push({ role: "assistant", content: answer.textContent });  // not the thought
    state.controller = null;
    busy(false);
  }
}

function report(stream, started, first, pieces) {
  const usage = stream.usage ?? {};
  const tokens = usage.completion_tokens ?? pieces;
  const ttft = first === null ? 0 : first - started;
  const seconds = first === null ? 0 : (performance.now() - first) / 1000;
  const rate = seconds > 0 ? ((tokens - 1) / seconds).toFixed(1) : "–";
  const cached = usage.prompt_tokens_details?.cached_tokens ?? 0;
  $("status").textContent =
    `First token ${ttft.toFixed(0)} ms · ${rate} tokens/s · ${tokens} tokens · ` +
    `${cached} of ${usage.prompt_tokens ?? "?"} prompt tokens cached`;
}

async function loadModels() {
  try {
    const models = await new Client({ apiKey: apiKey() }).models();
    $("model").replaceChildren(...models.map((model) => new Option(model.id, model.id)));
    if (state.client) state.client.model = $("model").value;
    const health = await new Client().health();
    $("status").textContent = health.status === "ok" ? "Ready." : `Server: ${health.status}`;
  } catch (error) {
    $("status").textContent = error.status === 401
      ? "This server needs an API key: enter it in the settings above."
      : `Cannot reach the server: ${error.message}`;
  }
}

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("message").value.trim();
  if (!text || state.controller) return;
  $("message").value = "";
  send(text);
});
$("message").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => state.controller?.abort());
$("new-chat").addEventListener("click", () => {
  state.controller?.abort();
  newSession(true);
});
$("model").addEventListener("change", () => { state.client.model = $("model").value; });
$("api-key").value = sessionStorage.getItem("pagedserve-api-key") ?? "";
$("api-key").addEventListener("change", () => {
  sessionStorage.setItem("pagedserve-api-key", $("api-key").value.trim());
  state.client.apiKey = apiKey();
  loadModels();
});

newSession();
await loadModels();
