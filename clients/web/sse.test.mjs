// node --test clients/web/sse.test.mjs : the page's SSE decoder, held to the
// protocol on a stream cut at every point.
import { test } from "node:test";
import assert from "node:assert/strict";
import { SSEDecoder, TextStream } from "./pagedserve.js";

const STREAM =
  ': ping\r\n\r\n' +
  'data: {"id":"c","choices":[{"index":0,"delta":{"content":"Hel"}}]}\r\n\r\n' +
  'data: {"id":"c","choices":[{"index":0,\n' +
  'data: "delta":{"content":"lo"}}]}\n\n' +
  ': keep-alive\n\n' +
  'data:{"id":"c","choices":[{"index":1,"delta":{"content":"other"}}]}\r\r' +
  'data: {"id":"c","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\n' +
  'data: [DONE]\n\n';

function decodeAll(pieces) {
  const decoder = new SSEDecoder();
  return pieces.flatMap((piece) => decoder.push(piece));
}

test("every split point gives the same events", () => {
  const whole = decodeAll([STREAM]);
  assert.equal(whole.length, 5);
  assert.equal(whole.at(-1), "[DONE]");
  assert.ok(whole[1].includes('\n"delta"'), "data lines join with a newline");
  for (let cut = 1; cut < STREAM.length; cut++) {
    assert.deepEqual(decodeAll([STREAM.slice(0, cut), STREAM.slice(cut)]), whole, `cut ${cut}`);
  }
  assert.deepEqual(decodeAll([...STREAM]), whole, "one character at a time");
});

function responseOf(text) {
  return Promise.resolve(new Response(text, { headers: { "content-type": "text/event-stream" } }));
}

test("a stream yields the first choice's text, then usage", async () => {
  const stream = new TextStream(responseOf(STREAM), true);
  const pieces = [];
  for await (const text of stream) pieces.push(text);
  assert.deepEqual(pieces, ["Hel", "lo"]);
  assert.equal(stream.usage.completion_tokens, 2);
  assert.ok(stream.done);
});

test("reasoning gathers in thought; a chunk of only reasoning yields an empty text", async () => {
  const text = 'data: {"id":"c","choices":[{"index":0,"delta":{"reasoning_content":"Hm",' +
    '"reasoning":"Hm"}}]}\n\n' +
    'data: {"id":"c","choices":[{"index":0,"delta":{"reasoning":", two."}}]}\n\n' +
    'data: {"id":"c","choices":[{"index":0,"delta":{"content":"Four."}}]}\n\n' +
    'data: [DONE]\n\n';
  const stream = new TextStream(responseOf(text), true);
  const pieces = [];
  for await (const piece of stream) pieces.push(piece);
  assert.deepEqual(pieces, ["", "", "Four."]);
  assert.equal(stream.thought, "Hm, two.");
});

test("an error event throws with the server's message", async () => {
  const text = 'data: {"id":"c","choices":[{"index":0,"delta":{"content":"a"}}]}\n\n' +
    'data: {"error":{"message":"the server is shutting down","code":"shutting_down"}}\n\n';
  const stream = new TextStream(responseOf(text), true);
  const pieces = [];
  await assert.rejects(async () => { for await (const t of stream) pieces.push(t); },
    (error) => error.code === "shutting_down" && error.status === 200);
  assert.deepEqual(pieces, ["a"]);
});
