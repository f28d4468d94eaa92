// A round trip of `berth serve` with the official OpenAI client library (npm package `openai`).
// usage: node roundtrip.mjs BASE_URL API_KEY
// Prints one JSON object with what the client saw; tests/server/test_server_cli.cpp checks it.
import OpenAI from 'openai';

const [baseURL, apiKey] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey, maxRetries: 0, timeout: 60000 });
const out = {};

const models = await client.models.list();
out.models = models.data.map((m) => m.id);

const messages = [{ role: 'user', content: 'Tell me a story about a cat.' }];
const chat = await client.chat.completions.create({
  model: 'any', messages, max_tokens: 12, temperature: 0,
});
out.chat = {
  object: chat.object,
  content: chat.choices[0].message.content,
  role: chat.choices[0].message.role,
  finish_reason: chat.choices[0].finish_reason,
  usage: chat.usage,
};

// Streaming with usage: the SDK's iterator must see role, deltas, finish and the usage chunk.
const stream = await client.chat.completions.create({
  model: 'any', messages, max_completion_tokens: 12, temperature: 0, stream: true,
  stream_options: { include_usage: true },
});
let content = '';
let role = null;
let finish = null;
let usage = null;
let chunks = 0;
for await (const chunk of stream) {
  chunks += 1;
  if (chunk.usage) usage = chunk.usage;
  for (const c of chunk.choices) {
    if (c.delta.role) role = c.delta.role;
    if (c.delta.content) content += c.delta.content;
    if (c.finish_reason) finish = c.finish_reason;
  }
}
out.stream = { content, role, finish_reason: finish, usage, chunks };

// The SDK's stream helper accumulates the same message.
const runner = client.chat.completions.stream({
  model: 'any', messages, max_tokens: 12, temperature: 0,
});
const final = await runner.finalChatCompletion();
out.helper = { content: final.choices[0].message.content, finish_reason: final.choices[0].finish_reason };

const completion = await client.completions.create({
  model: 'any', prompt: 'Once upon a time', max_tokens: 16, temperature: 0, stop: ['Lily'],
});
out.completion = {
  text: completion.choices[0].text,
  finish_reason: completion.choices[0].finish_reason,
  usage: completion.usage,
};

// Errors reach the caller as APIError with the server's status and type.
try {
  await client.chat.completions.create({
    model: 'any', messages: [{ role: 'user', content: 'cat '.repeat(5000) }], max_tokens: 4,
  });
  out.overflow = { status: 200 };
} catch (e) {
  out.overflow = { status: e.status, type: e.type ?? e.error?.type, code: e.code };
}
try {
  await client.chat.completions.create({ model: 'any', messages: [], max_tokens: 4 });
  out.invalid = { status: 200 };
} catch (e) {
  out.invalid = { status: e.status, type: e.type ?? e.error?.type };
}
const bad = new OpenAI({ baseURL, apiKey: 'wrong-key', maxRetries: 0 });
try {
  await bad.chat.completions.create({ model: 'any', messages, max_tokens: 4 });
  out.unauthorized = { status: 200 };
} catch (e) {
  out.unauthorized = { status: e.status, type: e.type ?? e.error?.type };
}
console.log(JSON.stringify(out));
