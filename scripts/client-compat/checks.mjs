// Node `openai` SDK checks for scripts/client-compat.sh, against a running Switchyard server;
// judged on the protocol (what the SDK and its helpers parse out of our responses), not on
// the small model's answers.
// usage: node checks.mjs BASE_URL KEY TINY_KEY (run from a folder with openai and zod installed)
// Exits 1 if any check fails; prints one line per check.
import OpenAI from 'openai';
import { zodFunction, zodResponseFormat, zodResponsesFunction, zodTextFormat } from 'openai/helpers/zod';
import { z } from 'zod';

const [BASE, KEY, TINY] = process.argv.slice(2);
const M = 'smollm2';
const client = new OpenAI({ baseURL: BASE, apiKey: KEY, maxRetries: 0 });
const failures = [];
async function check(name, f) {
  try {
    const detail = await f();
    console.log(`ok   ${name}${detail ? ': ' + detail : ''}`);
  } catch (e) {
    failures.push(name);
    console.log(`FAIL ${name}: ${e?.constructor?.name}: ${String(e?.message).slice(0, 300)}`);
  }
}
function expect(cond, what) { if (!cond) throw new Error(typeof what === 'string' ? what : JSON.stringify(what)); }
async function raises(f, cls, needle) {
  try { await f(); } catch (e) {
    expect(e instanceof cls && String(e.message).includes(needle), `${e.constructor.name}: ${e.message}`);
    return e.constructor.name;
  }
  throw new Error(`no ${cls.name}`);
}
const user = (content) => [{ role: 'user', content }];
const weather = [{ type: 'function', function: { name: 'get_weather', description: 'Get the weather for a city',
  parameters: { type: 'object', properties: { city: { type: 'string' } }, required: ['city'], additionalProperties: false } } }];
const Event = z.object({ name: z.string(), year: z.number().int() });

await check('models.list / retrieve', async () => {
  const ids = [];
  for await (const m of client.models.list()) ids.push(m.id);
  expect(ids.includes(M) && (await client.models.retrieve(M)).id === M, ids);
  return ids.join(',');
});
await check('chat n, stop, logprobs, max_completion_tokens', async () => {
  const r = await client.chat.completions.create({ model: M, messages: user('Say hi'), n: 2, stop: ['\n'],
    max_completion_tokens: 10, logprobs: true, top_logprobs: 2 });
  expect(r.choices.length === 2 && r.choices[0].logprobs.content[0].top_logprobs.length === 2 && r.usage.completion_tokens > 0, r);
});
await check('completions logprobs, n', async () => {
  const r = await client.completions.create({ model: M, prompt: 'The capital of France is', max_tokens: 4, logprobs: 2, n: 2, temperature: 0 });
  expect(r.choices.length === 2 && r.choices[0].logprobs.tokens.length >= 1, r);
});
await check('stream include_usage', async () => {
  const s = await client.chat.completions.create({ model: M, messages: user('hi'), max_tokens: 6, stream: true, stream_options: { include_usage: true } });
  let last; let text = '';
  for await (const c of s) { last = c; text += c.choices[0]?.delta?.content ?? ''; }
  expect(last.choices.length === 0 && last.usage.completion_tokens === 6 && text, last);
});
await check('chat.completions.stream helper (n=2, logprobs)', async () => {
  const s = client.chat.completions.stream({ model: M, messages: user('hi'), max_tokens: 5, n: 2, logprobs: true, stream_options: { include_usage: true } });
  const f = await s.finalChatCompletion();
  expect(f.choices.length === 2 && f.choices.every((c) => c.logprobs.content.length === 5) && f.usage.completion_tokens === 10, f);
});
await check('tools: stream helper accumulates calls', async () => {
  const s = client.chat.completions.stream({ model: M, messages: user('Weather in Paris?'), max_tokens: 60, temperature: 0, tools: weather, tool_choice: 'required' });
  const m = (await s.finalChatCompletion()).choices[0].message;
  expect(m.tool_calls?.length >= 1 && m.tool_calls[0].function.name === 'get_weather' && JSON.parse(m.tool_calls[0].function.arguments).city, m);
  return m.tool_calls[0].function.arguments;
});
await check('tools: call, tool message back', async () => {
  const r = await client.chat.completions.create({ model: M, messages: user('Weather in Paris?'), max_tokens: 60, temperature: 0, tools: weather, tool_choice: 'required', parallel_tool_calls: false });
  const m = r.choices[0].message;
  expect(m.tool_calls.length === 1 && r.choices[0].finish_reason === 'tool_calls', r.choices[0]);
  const r2 = await client.chat.completions.create({ model: M, max_tokens: 5, tools: weather,
    messages: [...user('Weather in Paris?'), m, { role: 'tool', tool_call_id: m.tool_calls[0].id, content: [{ type: 'text', text: 'sunny' }] }] });
  expect(r2.choices[0].finish_reason, r2);
});
for (const stream of [false, true]) {
  await check(`runTools${stream ? ' (stream)' : ''}`, async () => {
    const calls = [];
    const runner = client.chat.completions.runTools({ model: M, messages: user('Weather in Paris?'), max_tokens: 60, temperature: 0, stream,
      tool_choice: { type: 'function', function: { name: 'get_weather' } },
      tools: [{ type: 'function', function: { name: 'get_weather', parameters: weather[0].function.parameters,
        function: (a) => { calls.push(a); return 'sunny'; }, parse: JSON.parse } }] });
    await runner.done();
    const roles = runner.messages.map((m) => m.role);
    expect(calls.length >= 1 && typeof calls[0].city === 'string' && roles.includes('tool'), { calls, roles });
    return roles.join(',');
  });
}
await check('zodResponseFormat + parse', async () => {
  const r = await client.chat.completions.parse({ model: M, messages: user('Name an event with its year.'), max_tokens: 80, temperature: 0, response_format: zodResponseFormat(Event, 'event') });
  expect(Event.safeParse(r.choices[0].message.parsed).success, r.choices[0].message);
  return JSON.stringify(r.choices[0].message.parsed);
});
await check('zodResponseFormat + stream helper', async () => {
  const s = client.chat.completions.stream({ model: M, messages: user('Name an event with its year.'), max_tokens: 80, temperature: 0, response_format: zodResponseFormat(Event, 'event') });
  const m = (await s.finalChatCompletion()).choices[0].message;
  expect(Event.safeParse(m.parsed).success, m);
});
await check('zodFunction + parse', async () => {
  const r = await client.chat.completions.parse({ model: M, messages: user('Record an event.'), max_tokens: 80, temperature: 0,
    tools: [zodFunction({ name: 'record', parameters: Event })], tool_choice: { type: 'function', function: { name: 'record' } } });
  const c = r.choices[0].message.tool_calls[0];
  expect(Event.safeParse(c.function.parsed_arguments).success, r.choices[0]);
  return JSON.stringify(c.function.parsed_arguments);
});
await check('errors (400, 404, 401)', async () => {
  const a = await raises(() => client.chat.completions.create({ model: M, messages: user('x'), n: 100 }), OpenAI.BadRequestError, 'n must be in [1, 16]');
  const b = await raises(() => client.chat.completions.create({ model: 'nope', messages: user('x') }), OpenAI.NotFoundError, 'does not exist');
  const c = await raises(() => new OpenAI({ baseURL: BASE, apiKey: 'wrong', maxRetries: 0 }).models.list(), OpenAI.AuthenticationError, 'Incorrect API key');
  return [a, b, c].join(', ');
});
await check('503 then retry after Retry-After', async () => {
  // The hog holds the tiny tier's only seat: a stream of 100 tokens; the checks start once
  // its first chunk is out, so it is surely being served (not still on its way in).
  const res = await fetch(`${BASE}/completions`, { method: 'POST', headers: { authorization: `Bearer ${TINY}`, 'content-type': 'application/json' },
    body: JSON.stringify({ prompt: 'hi', max_tokens: 100, ignore_eos: true, stream: true }) });
  const reader = res.body.getReader();
  await reader.read();
  const hog = (async () => { while (!(await reader.read()).done); })();
  const tiny = (retries) => new OpenAI({ baseURL: BASE, apiKey: TINY, maxRetries: retries });
  const a = await raises(() => tiny(0).chat.completions.create({ model: M, messages: user('x'), max_tokens: 2 }), OpenAI.InternalServerError, 'retry shortly');
  const t0 = Date.now();
  await tiny(3).chat.completions.create({ model: M, messages: user('x'), max_tokens: 2 });
  const secs = (Date.now() - t0) / 1000;
  await hog;
  expect(secs >= 0.9, `${secs}s`);
  return `${a}, then served after ${secs.toFixed(2)}s`;
});
// The Responses API (/v1/responses).
const ask = { model: M, instructions: 'Answer in one sentence.', input: 'What is the capital of France?', max_output_tokens: 40, temperature: 0 };
const rtools = [{ type: 'function', name: 'get_weather', description: 'Get the weather for a city', strict: true,
  parameters: weather[0].function.parameters }];
const question = [{ role: 'user', content: 'What is the weather in Paris?' }];
let plainText;
await check('responses.create, output_text (+ history back)', async () => {
  const r = await client.responses.create({ ...ask, metadata: { k: 'v' } });
  expect(r.id.startsWith('resp_') && r.object === 'response' && r.output_text && r.metadata.k === 'v'
    && r.usage.total_tokens === r.usage.input_tokens + r.usage.output_tokens, r);
  plainText = r.output_text;
  const again = await client.responses.create({ model: M, max_output_tokens: 5,
    input: [{ role: 'user', content: ask.input }, ...r.output, { role: 'user', content: 'And of Italy?' }] });
  expect(again.output_text, again);
  return `${r.status}, ${r.usage.input_tokens} in, ${r.usage.output_tokens} out`;
});
await check('responses.create({stream: true})', async () => {
  const events = [];
  for await (const e of await client.responses.create({ ...ask, stream: true })) events.push(e);
  const deltas = events.filter((e) => e.type === 'response.output_text.delta').map((e) => e.delta).join('');
  const last = events.at(-1);
  expect(events[0].type === 'response.created' && ['response.completed', 'response.incomplete'].includes(last.type)
    && events.every((e, i) => e.sequence_number === i), events.map((e) => e.type));
  // output_text is the SDK's, added to create()'s answer, not to a raw stream's events.
  const final = last.response.output.filter((o) => o.type === 'message').flatMap((o) => o.content).map((c) => c.text).join('');
  expect(deltas === plainText && final === plainText, { deltas, final, plainText });
  return `${events.length} events`;
});
await check('responses.stream events, finalResponse()', async () => {
  const s = client.responses.stream(ask);
  let deltas = '';
  let done = '';
  s.on('response.output_text.delta', (e) => { deltas += e.delta; });
  s.on('response.output_text.done', (e) => { done = e.text; });
  const f = await s.finalResponse();
  expect(f.output_text === plainText && deltas === plainText && done === plainText, { f, deltas, done });
});
await check('responses.parse + zodTextFormat (+ stream)', async () => {
  const r = await client.responses.parse({ model: M, input: 'Name an event with its year.', max_output_tokens: 80, temperature: 0,
    text: { format: zodTextFormat(Event, 'event') } });
  expect(Event.safeParse(r.output_parsed).success, r);
  const s = client.responses.stream({ model: M, input: 'Name an event with its year.', max_output_tokens: 80, temperature: 0,
    text: { format: zodTextFormat(Event, 'event') } });
  const f = await s.finalResponse();
  expect(JSON.stringify(f.output_parsed) === JSON.stringify(r.output_parsed), f);
  return JSON.stringify(r.output_parsed);
});
await check('responses function tool, function_call_output back', async () => {
  const r = await client.responses.create({ model: M, input: question, tools: rtools, tool_choice: 'required', parallel_tool_calls: false, max_output_tokens: 60, temperature: 0 });
  const fc = r.output.find((o) => o.type === 'function_call');
  expect(fc?.name === 'get_weather' && typeof JSON.parse(fc.arguments).city === 'string' && fc.call_id, r.output);
  const back = await client.responses.create({ model: M, tools: rtools, max_output_tokens: 10,
    input: [...question, ...r.output, { type: 'function_call_output', call_id: fc.call_id, output: 'sunny' }] });
  expect(['completed', 'incomplete'].includes(back.status), back);
  return fc.arguments;
});
await check('responses.stream function call arguments, zodResponsesFunction + parse', async () => {
  const s = client.responses.stream({ model: M, input: question, tools: rtools, tool_choice: 'required', parallel_tool_calls: false, max_output_tokens: 60, temperature: 0 });
  let args = '';
  s.on('response.function_call_arguments.delta', (e) => { args += e.delta; });
  const fc = (await s.finalResponse()).output.find((o) => o.type === 'function_call');
  expect(fc && fc.arguments === args && JSON.parse(args).city, { fc, args });
  const p = await client.responses.parse({ model: M, input: 'Record an event.', max_output_tokens: 80, temperature: 0,
    tools: [zodResponsesFunction({ name: 'record', parameters: Event })], tool_choice: { type: 'function', name: 'record' } });
  const call = p.output.find((o) => o.type === 'function_call');
  expect(Event.safeParse(call?.parsed_arguments).success, p.output);
  return JSON.stringify(call.parsed_arguments);
});
await check('responses errors (400 with param, context, 401)', async () => {
  const a = await raises(() => client.responses.create({ model: M, input: 'x', previous_response_id: 'resp_x' }), OpenAI.BadRequestError, "Previous response with id 'resp_x' not found");
  const b = await raises(() => client.responses.create({ model: M, input: 'x', max_output_tokens: 100000 }), OpenAI.BadRequestError, 'maximum context length');
  const c = await raises(() => new OpenAI({ baseURL: BASE, apiKey: 'wrong', maxRetries: 0 }).responses.create({ model: M, input: 'x' }), OpenAI.AuthenticationError, 'Incorrect API key');
  return [a, b, c].join(', ');
});
await check('responses stored: retrieve, previous_response_id, input_items, delete', async () => {
  const first = await client.responses.create({ model: M, input: 'My name is Ada.', max_output_tokens: 8, temperature: 0 });
  const got = await client.responses.retrieve(first.id);
  expect(JSON.stringify(got) === JSON.stringify(first), { got, first });
  const second = await client.responses.create({ model: M, input: 'What is my name?', previous_response_id: first.id, max_output_tokens: 8, temperature: 0 });
  expect(second.previous_response_id === first.id && second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens, second);
  const items = [];
  for await (const item of client.responses.inputItems.list(second.id)) items.push(item);
  expect(items.length === 1 && items[0].content[0].text === 'What is my name?', items);
  await client.responses.delete(first.id);
  const gone = await raises(() => client.responses.retrieve(first.id), OpenAI.NotFoundError, 'not found');
  return `chained (${second.usage.input_tokens} in), ${gone}`;
});
await check('responses background stream: dropped, resumed (retrieve starting_after), replayed (stream response_id)', async () => {
  const first = [];
  for await (const e of await client.responses.create({ model: M, input: 'Count to 10.', background: true, stream: true, max_output_tokens: 100, temperature: 0 })) {
    first.push(e);
    if (first.filter((x) => x.type === 'response.output_text.delta').length >= 3) break;
  }
  const id = first[0].response.id;
  const last = first.at(-1).sequence_number;
  const rest = [];
  for await (const e of await client.responses.retrieve(id, { stream: true, starting_after: last })) rest.push(e);
  const all = [...first, ...rest];
  expect(all.every((e, i) => e.sequence_number === i), all.map((e) => e.sequence_number));
  const text = all.filter((e) => e.type === 'response.output_text.delta').map((e) => e.delta).join('');
  const replayed = await client.responses.stream({ response_id: id }).finalResponse();
  expect(replayed.output_text === text && replayed.id === id, { text, replayed });
  const fg = await client.responses.create({ model: M, input: 'Hi', max_output_tokens: 2 });
  const refused = await raises(async () => { for await (const _ of await client.responses.retrieve(fg.id, { stream: true })); }, OpenAI.BadRequestError, 'only a background response');
  return `${all.length} events, resumed after ${last}, foreground ${refused}`;
});
await check('embeddings.create (default base64, float)', async () => {
  // Without encodingFormat the SDK asks for base64 and decodes it itself.
  const input = ['The capital of France is Paris.', 'Bananas are yellow.'];
  const b64 = await client.embeddings.create({ model: M, input });
  const floats = await client.embeddings.create({ model: M, input, encoding_format: 'float' });
  const f32 = (v) => Array.from(Float32Array.from(v));
  expect(b64.data.length === 2 && b64.data.every((d, i) => d.index === i), b64);
  b64.data.forEach((d, i) => {
    const norm = Math.sqrt(d.embedding.reduce((s, x) => s + x * x, 0));
    expect(Math.abs(norm - 1) < 1e-5 && JSON.stringify(f32(d.embedding)) === JSON.stringify(f32(floats.data[i].embedding)), `vector ${i}`);
  });
  expect(b64.usage.prompt_tokens === floats.usage.prompt_tokens && b64.usage.prompt_tokens > 0, b64.usage);
  const bad = await raises(() => client.embeddings.create({ model: M, input, dimensions: 8 }), OpenAI.BadRequestError, 'Matryoshka');
  return `${b64.data[0].embedding.length} dims, ${b64.usage.prompt_tokens} tokens, dimensions ${bad}`;
});
console.log(`node openai SDK: ${failures.length} failed${failures.length ? ': ' + failures.join(', ') : ''}`);
process.exit(failures.length ? 1 : 0);
