// pagedserve.js — a dependency-free streaming client for pagedserve's
// OpenAI-compatible API, for any page or frontend (plain ES module).
//
//   import { Client } from "./pagedserve.js";
//   const client = new Client({ baseUrl: "", apiKey: null, sessionId: "abc" });
//   const stream = client.chatStream(messages, { max_tokens: 256 }, { signal });
//   for await (const text of stream) output.textContent += text;
//   stream.usage            // {prompt_tokens, completion_tokens, prompt_tokens_details}
//
// Streams are server-sent events read from fetch()'s ReadableStream:
//
//   data: {"choices": [{"delta": {"content": "Hel"}}]}   -> "Hel"
//   : ping                                               (a comment: skipped)
//   data: {"error": {...}}                               -> throws APIError
//   data: [DONE]                                         -> the end
//
// An AbortController's signal stops a stream: the connection closes and the
// server aborts the request.

/** Turns text, in whatever pieces the network delivers it, into SSE events. */
export class SSEDecoder {
  constructor() {
    this.buffer = "";
    this.data = [];
  }

  /** Feed more text; returns the data of every event completed by it. */
  push(text) {
    this.buffer += text;
    const events = [];
    for (;;) {
      const match = /\r\n|\r|\n/.exec(this.buffer);
      if (match === null) break;
      // A lone "\r" at the very end may be the first half of "\r\n": wait.
      if (match[0] === "\r" && match.index === this.buffer.length - 1) break;
      const line = this.buffer.slice(0, match.index);
      this.buffer = this.buffer.slice(match.index + match[0].length);
      const event = this.line(line);
      if (event !== null) events.push(event);
    }
    return events;
  }

  /** The stream ended: a last event without its blank line is dropped, as the spec says. */
  end() {
    this.buffer = "";
    this.data = [];
    return [];
  }

  line(line) {
    if (line === "") {
      if (this.data.length === 0) return null;
      const event = this.data.join("\n");
      this.data = [];
      return event;
    }
    if (line.startsWith(":")) return null; // a comment (keep-alive)
    const colon = line.indexOf(":");
    const field = colon === -1 ? line : line.slice(0, colon);
    let value = colon === -1 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (field === "data") this.data.push(value);
    return null;
  }
}

/** The server refused, or an error arrived inside a stream (status 200). */
export class APIError extends Error {
  constructor(status, error) {
    super(error.message || `HTTP ${status}`);
    this.name = "APIError";
    this.status = status;
    this.type = error.type ?? null;
    this.code = error.code ?? null;
    this.param = error.param ?? null;
  }
}

async function errorFrom(response) {
  const text = await response.text();
  try {
    return new APIError(response.status, JSON.parse(text).error);
  } catch {
    return new APIError(response.status, { message: text.slice(0, 500) });
  }
}

/** A streamed answer: iterate it for text deltas; usage and finishReason after.
 * A thinking model's reasoning (the server's --reasoning-parser) gathers in
 * `thought`; a chunk that carries only reasoning yields "" so a page can show it. */
export class TextStream {
  constructor(responsePromise, chat) {
    this.responsePromise = responsePromise;
    this.chat = chat;
    this.thought = "";
    this.usage = null;
    this.finishReason = null;
    this.id = null;
    this.done = false;
  }

  async *[Symbol.asyncIterator]() {
    const response = await this.responsePromise;
    if (!response.ok) throw await errorFrom(response);
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    const decoder = new SSEDecoder();
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) return;
        for (const data of decoder.push(value)) {
          if (data === "[DONE]") {
            this.done = true;
            return;
          }
          const thought = this.thought.length;
          const text = this.take(JSON.parse(data));
          if (text || this.thought.length > thought) yield text;
        }
      }
    } finally {
      reader.cancel().catch(() => {});
    }
  }

  /** The first choice's new text in one event; an error event throws. */
  take(payload) {
    if (payload.error) throw new APIError(200, payload.error);
    this.id = payload.id ?? this.id;
    if (payload.usage) this.usage = payload.usage;
    let text = "";
    for (const choice of payload.choices ?? []) {
      if (choice.index !== 0) continue;
      text = (this.chat ? choice.delta?.content : choice.text) ?? "";
      if (this.chat) this.thought += choice.delta?.reasoning_content ?? choice.delta?.reasoning ?? "";
      this.finishReason = choice.finish_reason ?? this.finishReason;
    }
    return text;
  }

  /** Read the whole answer. */
  async text() {
    let all = "";
    for await (const piece of this) all += piece;
    return all;
  }
}

export class Client {
  constructor({ baseUrl = "", apiKey = null, sessionId = null, model = null } = {}) {
    this.baseUrl = baseUrl.replace(/\/$/, "");
    this.apiKey = apiKey;
    this.sessionId = sessionId;
    this.model = model;
  }

  headers() {
    const headers = { "Content-Type": "application/json" };
    if (this.apiKey) headers.Authorization = `Bearer ${this.apiKey}`;
    // Keeps a conversation on the replica holding its history (the load balancer).
    if (this.sessionId) headers["X-Session-ID"] = this.sessionId;
    return headers;
  }

  body(fields, params, stream) {
    const body = { ...fields, ...params };
    if (this.model && body.model === undefined) body.model = this.model;
    if (stream) {
      body.stream = true;
      body.stream_options ??= { include_usage: true };
    }
    return JSON.stringify(body);
  }

  post(path, body, signal) {
    return fetch(this.baseUrl + path, { method: "POST", headers: this.headers(), body, signal });
  }

  async json(path, body, signal) {
    const response = body === undefined
      ? await fetch(this.baseUrl + path, { headers: this.headers(), signal })
      : await this.post(path, body, signal);
    if (!response.ok) throw await errorFrom(response);
    return response.json();
  }

  chat(messages, params = {}, { signal } = {}) {
    return this.json("/v1/chat/completions", this.body({ messages }, params, false), signal);
  }

  chatStream(messages, params = {}, { signal } = {}) {
    const body = this.body({ messages }, params, true);
    return new TextStream(this.post("/v1/chat/completions", body, signal), true);
  }

  completeStream(prompt, params = {}, { signal } = {}) {
    const body = this.body({ prompt }, params, true);
    return new TextStream(this.post("/v1/completions", body, signal), false);
  }

  async models() {
    return (await this.json("/v1/models")).data;
  }

  /** Readiness: {status, detail}, 503 included (an answer, not an error). */
  async health() {
    const response = await fetch(this.baseUrl + "/health", { headers: this.headers() });
    return response.json();
  }
}
