// A redbatch client in another language, written deliberately from PROTOCOL.md alone:
// it does not read or import any of the project's Python code.
//
//   node submit.mjs REDIS_URL IMAGE_PATH [MODEL] [PREFIX]   submit one image, wait, print result
//   node submit.mjs REDIS_URL TEXT.txt all_minilm_l6_v2      submit the file's text (UTF-8)
//   node submit.mjs REDIS_URL --raw-garbage [MODEL] [PREFIX] submit a `job` that is not msgpack
// Options, anywhere: --admit submits through the admission function of the page's function
// library (FCALL; the library assembled from PROTOCOL.md itself and loaded when Redis lacks
// it), instead of a plain XADD; --rid=ID uses that request id instead of a fresh one;
// --done-only sets the envelope's done_only: the answer then lives in the done list alone,
// awaited without popping (BLMOVE of the list onto itself) and read with LINDEX.
//
//   node submit.mjs REDIS_URL --status --rid=ID [MODEL] [PREFIX]  print where job ID is
//   node submit.mjs REDIS_URL --cancel --rid=ID [MODEL] [PREFIX]  cancel job ID if queued
// Both call the page's functions ("Job status", "Cancelling a job") and print one line of JSON:
// {id, state, worker, deliveries, error_code} or {id, cancel, cancelled}.
//
//   node submit.mjs REDIS_URL --stream TEXT [MODEL] [PREFIX] [--max-new-tokens=N] [--count=N]
// A generation job ("Generation"): the chat [{role: user, content: TEXT}] and max_new_tokens
// (default 12) as the JSON payload, admitted through the admission function (--admit is
// implied); then its token stream, read with XREAD BLOCK and COUNT (N entries a read at
// most, default 64) from 0-0 and on from the last id seen, the text of each entry written to
// stderr as it arrives (stdout keeps its one line of JSON), until the entry with `finish`;
// then the result, awaited as for any job. MODEL defaults to smollm2_135m. The JSON line
// gets `finish_reason` (the result's) and `stream`: {text, finish, entries, reads, tokens,
// prompt_tokens, completion_tokens, cached_tokens, ttft_ms, error}, what the stream held.
//
// Prints one line of JSON: {id, status, label, error_code, result}, or, when the admission
// script refuses the job, {id, admit_error, admit_code} (the job's error element, or the
// error reply to the whole call, as it arrived; admit_code is its first word).
// Exit status: 0 when a result arrived (even an error result), 2 on timeout, 3 when the
// admission script refused the job, 1 on usage error or an admission reply the page does not
// describe.
import { readFileSync } from 'node:fs';
import { randomUUID } from 'node:crypto';
import { extname } from 'node:path';
import { createClient, RESP_TYPES } from 'redis';
import { encode, decode } from '@msgpack/msgpack';

const argv = process.argv.slice(2);
const MODES = ['--admit', '--status', '--cancel', '--done-only', '--stream'];
const VALUED = ['--rid=', '--max-new-tokens=', '--count='];
const options = argv.filter((a) => MODES.includes(a) || VALUED.some((v) => a.startsWith(v)));
const valueOf = (opts, name) => opts.find((a) => a.startsWith(name))?.slice(name.length);
const lookup = options.includes('--status') ? 'status'
  : options.includes('--cancel') ? 'cancel' : null;
const positional = argv.filter((a) => !options.includes(a));
if (lookup) positional.splice(1, 0, `--${lookup}`);   // no input: ID comes from --rid
const streaming = options.includes('--stream');
const [url, input, model = streaming ? 'smollm2_135m' : 'efficientnet_lite0',
  prefix = 'redbatch'] = positional;
const maxNewTokens = Number(valueOf(options, '--max-new-tokens=') ?? 12);
const readCount = Number(valueOf(options, '--count=') ?? 64);
if (!url || !input || (lookup && !ridOptionOf(options))
    || !Number.isInteger(maxNewTokens) || !(Number.isInteger(readCount) && readCount > 0)) {
  console.error('usage: node submit.mjs REDIS_URL (IMAGE_PATH | --raw-garbage) [MODEL] [PREFIX]'
                + ' [--admit] [--rid=ID]\n'
                + '       node submit.mjs REDIS_URL --stream TEXT [MODEL] [PREFIX]'
                + ' [--max-new-tokens=N] [--count=N] [--rid=ID]');
  process.exit(1);
}
function ridOptionOf(opts) { return opts.find((a) => a.startsWith('--rid=')); }
const admit = options.includes('--admit') || streaming;
const doneOnly = options.includes('--done-only');
const ridOption = ridOptionOf(options);

const WAIT_MS = 60_000;        // give up after this long
const BLPOP_SECONDS = 3;       // "a few seconds at a time"
const XREAD_BLOCK_MS = 1_000;  // the longest one XREAD of a token stream blocks
const CONTENT_TYPES = { '.jpg': 'image/jpeg', '.jpeg': 'image/jpeg', '.png': 'image/png',
  '.webp': 'image/webp', '.gif': 'image/gif', '.bmp': 'image/bmp',
  '.txt': 'text/plain; charset=utf-8' };                // a text: its UTF-8 bytes

// Keys: every key of one model carries `{model}` as a Redis Cluster hash tag.
const rid = ridOption ? ridOption.slice('--rid='.length)
  : randomUUID().replaceAll('-', '');                  // UUID4 in hex
const streamKey = `${prefix}:{${model}}:jobs:interactive`;
const resultKey = `${prefix}:{${model}}:result:${rid}`;
const doneKey = `${prefix}:{${model}}:done:${rid}`;
const limitsKey = `${prefix}:{${model}}:limits`;
const chargesKey = `${prefix}:{${model}}:charges:interactive`;
const ownerKey = `${prefix}:{${model}}:owner:${rid}`;
const tokensKey = `${prefix}:{${model}}:tokens:${rid}`;

// Buffer <-> Uint8Array without copying; node-redis sends Buffer arguments as raw bytes.
const asBuffer = (u8) => Buffer.from(u8.buffer, u8.byteOffset, u8.byteLength);

// The page's scripts, each found by its first line, and its function library: the frame
// ("The function library"), each `<the NAME script>` line replaced by that script.
const page = readFileSync(new URL('../../../PROTOCOL.md', import.meta.url), 'utf8');
const blocks = [...page.matchAll(/```lua\n([\s\S]*?)```/g)].map((m) => m[1]);
const pageScript = (name) => {
  const found = blocks.find((text) => text.startsWith(`-- redbatch ${name} script`));
  if (!found) throw new Error(`PROTOCOL.md has no ${name} script`);
  return found;
};
const frame = blocks.find((text) => text.startsWith('#!lua name='));
if (!frame) throw new Error('PROTOCOL.md has no function library');
const library = frame.replace(/^<the (\w+) script>/gm, (_, name) => pageScript(name));
const libraryName = /^#!lua name=(\S+)/.exec(library)[1];
// FCALL (or FCALL_RO) of the library's function `name`; when Redis has no such function
// ("Function not found": it ran nothing), load the library and call again.
const fcall = async (conn, command, name, keys, args, options) => {
  const send = () => conn.sendCommand([command, `${libraryName}_${name}`,
    String(keys.length), ...keys, ...args], options);
  try {
    return await send();
  } catch (err) {
    if (!String(err.message).startsWith('Function not found')
        && !String(err.message).startsWith('ERR Function not found')) throw err;
    await conn.sendCommand(['FUNCTION', 'LOAD', 'REPLACE', library]);
    return send();
  }
};

if (lookup) {
  const conn = createClient({ url });
  await conn.connect();
  // Bulk strings as Buffers, inside arrays too (sendCommand takes the mapping per call).
  const asBytes = { typeMapping: { [RESP_TYPES.BLOB_STRING]: Buffer } };
  const base_ = `${prefix}:{${model}}`;
  const lanes = [`${base_}:jobs:interactive`, `${base_}:jobs:bulk`];
  let out;
  if (lookup === 'cancel') {
    // The cancel entry's envelope: the job's id, lane interactive, nothing to run.
    const marker = asBuffer(encode({ v: 1, model, payload: new Uint8Array(0),
      content_type: 'application/octet-stream', submitted_ms: Date.now(), deadline_ms: null,
      lane: 'interactive', params: {} }));
    const reply = String(await fcall(conn, 'FCALL', 'cancel', [...lanes, ownerKey],
      [rid, marker], asBytes));
    out = { id: rid, cancel: reply, cancelled: reply.split(' ')[0] === 'cancelled' };
  } else {
    // Five keys: the done list last, where a done-only job's answer lives.
    const [result, owner, last, consumer, deliveries] = await fcall(conn, 'FCALL_RO', 'status',
      [resultKey, ownerKey, ...lanes, doneKey], [], asBytes);
    out = { id: rid, state: null, worker: null, deliveries: null, error_code: null };
    // The page's table, row by row.
    const entry = owner ? /^(\d+)-(\d+)/.exec(owner.toString()) : null;
    const after = (a, b) => {
      const [am, as] = a.slice(1).map(BigInt);
      const [bm, bs] = b.toString().split('-').map(BigInt);
      return am > bm || (am === bm && as > bs);
    };
    if (result) {
      const envelope = decode(result);
      out.error_code = envelope.error?.code ?? null;
      out.state = envelope.status === 'ok' ? 'done'
        : out.error_code === 'cancelled' ? 'cancelled' : 'failed';
    } else if (!entry) {
      out.state = 'unknown';
    } else if (consumer) {
      Object.assign(out, { state: 'running', worker: consumer.toString(),
        deliveries: Number(deliveries) });
    } else if (!last || after(entry, last)) {
      out.state = owner.toString().endsWith(' cancel') ? 'cancelled' : 'queued';
    } else {
      out.state = 'unknown';
    }
  }
  console.log(JSON.stringify(out));
  await conn.close();
  process.exit(0);
}

let job;
// The job's charge against a token bound ("Admission control"): a generation payload's
// length in bytes plus its max_new_tokens; 0 for any other job.
let charge = 0;
const submitted = Date.now();
const deadline = submitted + WAIT_MS;
if (input === '--raw-garbage') {
  job = Buffer.from('not msgpack at all');
} else if (streaming) {
  // The generation payload: a JSON map, UTF-8, with `messages` and `max_new_tokens`.
  const body = { messages: [{ role: 'user', content: input }], max_new_tokens: maxNewTokens };
  const payload = Buffer.from(JSON.stringify(body), 'utf8');
  charge = payload.length + maxNewTokens;
  job = asBuffer(encode({
    v: 1,
    model,
    payload,
    content_type: 'application/json',
    submitted_ms: submitted,
    deadline_ms: deadline,
    lane: 'interactive',
    params: {},
    ...(doneOnly ? { done_only: true } : {}),
  }));
} else {
  job = asBuffer(encode({
    v: 1,
    model,
    payload: readFileSync(input),                      // a Buffer is encoded as msgpack bin
    content_type: CONTENT_TYPES[extname(input).toLowerCase()] ?? 'application/octet-stream',
    submitted_ms: submitted,
    deadline_ms: deadline,
    lane: 'interactive',
    params: {},
    ...(doneOnly ? { done_only: true } : {}),
  }));
}

const base = createClient({ url });
base.on('error', (err) => console.error(`redis: ${err.message}`));   // it reconnects by itself
await base.connect();
// Replies as Buffers, so the msgpack result reaches the decoder byte for byte.
const client = base.withTypeMapping({ [RESP_TYPES.BLOB_STRING]: Buffer });

if (admit) {
  // The admission function, called as the page says for a call of one job (N = 1): 3 + N
  // keys (the lane's stream, the limits hash, the lane's charges hash, the job's owner key)
  // and 1 + 4N arguments (the lane, then the job's owner TTL, request id, charge and
  // envelope).
  const ownerTtl = Math.max(0, deadline - submitted) + 600000;
  const refused = async (message) => {
    // Every error of the script is "CODE text": the code is the first word.
    console.log(JSON.stringify({ id: rid, admit_error: message,
      admit_code: message.split(' ')[0] }));
    await base.close();
    process.exit(3);
  };
  let reply;
  try {
    reply = await fcall(client, 'FCALL', 'admit', [streamKey, limitsKey, chargesKey, ownerKey],
      ['interactive', String(ownerTtl), rid, String(charge), job]);
  } catch (err) {
    await refused(err.message);         // an error for the whole call (BAD_CALL, NOPERM, ...)
  }
  // An array with one element per job: the new entry id, or an error element
  // (QUEUE_FULL, TOKENS_FULL, DUPLICATE_REQUEST_ID), which node-redis hands over as an
  // Error in the array.
  const [element] = Array.isArray(reply) && reply.length === 1 ? reply : [undefined];
  if (element instanceof Error) await refused(element.message);
  const entryId = Buffer.isBuffer(element) ? element.toString() : element;
  if (typeof entryId !== 'string' || !/^\d+-\d+$/.test(entryId)) {
    console.error(`admission: expected [<entry id>] or [<error>], got ${String(reply)}`);
    await base.close();
    process.exit(1);
  }
} else {
  // Exactly two fields: rid outside the envelope, job the msgpack envelope.
  await client.sendCommand(['XADD', streamKey, '*', 'rid', rid, 'job', job]);
}

// The page's "Reading and resuming": `XREAD BLOCK <ms> STREAMS <tokens key> 0-0`, then on
// from the last id seen, COUNT entries a read at most, every read's block bounded; stop at
// the entry with `finish`. The stream may not exist yet (the job is queued): XREAD blocks
// on a missing key the same way. While a read ends empty, GET the result key (done-only:
// LINDEX the done list): a job answered without a stream (refused as it was read), or whose
// stream stopped without a `finish`, has its result there, and its answer is that result.
// Entry ids are the chunk indexes 0-1, 0-2, ... with no gap; each field is a string.
async function readTokenStream() {
  const got = { text: '', finish: null, entries: [], reads: 0, tokens: [], prompt_tokens: null,
    completion_tokens: null, cached_tokens: null, ttft_ms: null, error: null };
  let last = '0-0';
  let answered = false;                 // the result key held the answer at the last look
  const take = (entries) => {
    for (const [id, flat] of entries) {
      const fields = {};
      for (let i = 0; i + 1 < flat.length; i += 2) fields[flat[i].toString()] = flat[i + 1];
      last = id.toString();
      got.entries.push(last);
      // Never half a character, never part of a stop string: print each as it comes.
      const text = (fields.text ?? Buffer.alloc(0)).toString('utf8');
      got.text += text;
      process.stderr.write(text);
      const tokens = (fields.tokens ?? '').toString();
      if (tokens !== '') got.tokens.push(...tokens.split(' ').map(Number));
      if (fields.finish !== undefined) {
        got.finish = fields.finish.toString();
        for (const name of ['prompt_tokens', 'completion_tokens', 'cached_tokens']) {
          got[name] = Number(fields[name]?.toString());
        }
        const ttft = fields.ttft_ms?.toString() ?? '';
        got.ttft_ms = ttft === '' ? null : Number(ttft);
        got.error = fields.error?.toString() ?? null;
        return;
      }
    }
  };
  while (got.finish === null && Date.now() < giveUpAt) {
    const block = Math.max(1, Math.min(XREAD_BLOCK_MS, giveUpAt - Date.now()));
    // Once the result is there every chunk is written (the result comes after the stream's
    // last entry): read what is left without blocking, and stop there.
    const reply = await client.sendCommand(['XREAD', 'COUNT', String(readCount),
      ...(answered ? [] : ['BLOCK', String(block)]), 'STREAMS', tokensKey, last]);
    if (reply !== null) {
      got.reads += 1;
      take(reply[0][1]);
    } else if (answered) {
      break;                            // no stream, or one that stopped short: the result
    } else {
      answered = (doneOnly ? await client.lIndex(doneKey, 0)
        : await client.get(resultKey)) !== null;
    }
  }
  if (got.text !== '') process.stderr.write('\n');
  return got;
}
const giveUpAt = Date.now() + WAIT_MS;
const stream = streaming ? await readTokenStream() : null;

// Wait (our own job, no reply list): BLPOP the done key for a few seconds; the element it
// pops is the result envelope itself. When a pop ends empty, or pops something that is not
// an envelope of this id (the token `1` of older workers), GET the result key. Until the
// give-up time. A streamed job's result comes after its stream's last entry: wait the same.
const envelopeOf = (bytes) => {
  try {
    const value = decode(bytes);
    return value !== null && typeof value === 'object' && value.id === rid ? bytes : null;
  } catch {
    return null;
  }
};
let raw = null;
while (raw === null && Date.now() < giveUpAt) {
  // Whole seconds: fractional BLPOP timeouts need Redis >= 6.
  const seconds = Math.max(1, Math.min(BLPOP_SECONDS, Math.ceil((giveUpAt - Date.now()) / 1000)));
  if (doneOnly) {
    // The page's done-only steps: wait without popping; the element stays for later readers.
    const first = await client.sendCommand(['BLMOVE', doneKey, doneKey, 'LEFT', 'LEFT',
      String(seconds)]);
    raw = first === null ? null : envelopeOf(first);
    if (raw === null) raw = envelopeOf(await client.lIndex(doneKey, 0) ?? Buffer.alloc(0));
    continue;
  }
  const popped = await client.blPop(doneKey, seconds);
  raw = popped === null ? null : envelopeOf(popped.element);
  if (raw === null) raw = await client.get(resultKey);
}
await base.close();

if (raw === null) {
  console.error(`no result for ${rid} after ${WAIT_MS} ms`);
  process.exit(2);
}
const result = decode(raw);
console.log(JSON.stringify({
  id: result.id,
  status: result.status,
  label: result.output?.label ?? null,
  error_code: result.error?.code ?? null,
  result,
  ...(stream ? { finish_reason: result.output?.finish_reason ?? null, stream } : {}),
}));
