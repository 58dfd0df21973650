#!/usr/bin/env python3
"""Closed-loop clients against a running Switchyard server (standard library only).

Each client sends a streamed completion (a prompt of random token ids, `ignore_eos`, so its
lengths are exact), reads it to the end, pauses (`--think`: exponential think times of that
mean, 0 by default) and sends the next, until `--duration` seconds have passed; groups of
clients have their own API key (so tenant and tier), prompt and output lengths. Writes one JSON
line per request (`--out`): client, tier, tenant, its send time and end time (seconds from the
start), TTFT and E2E (s), the times of its chunks, its lengths, or its HTTP status and error.
With `--trace FILE` it also writes the successful requests as a simulator JSONL trace naming
each request's `client`, their send times as `arrival_s` and, after a client's first, its
`think_s`: the time from the end of the client's request before it in the trace (a failed
request in between counts in it) to its sending, so that `switchyard simulate` sends each
client's requests one at a time as the server received them, each its think time after the one
before it ended (README, "What the simulator models").

  scripts/closed-loop-clients.py --port 8000 --duration 20 --out load.jsonl --trace trace.jsonl \\
    --group b:16:BATCH_KEY:batch:initech:256:32 --group p:2:PREMIUM_KEY:premium:acme:128:16

A group is NAME:COUNT:KEY:TIER:TENANT:PROMPT_TOKENS:OUTPUT_TOKENS (COUNT 1..64, lengths
1..8192; TIER and TENANT label the records and the trace: the key decides them on the server);
its clients are NAME followed by their number among all the groups' clients.
"""
import argparse
import http.client
import json
import random
import sys
import threading
import time

ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
ap.add_argument('--host', default='127.0.0.1')
ap.add_argument('--port', type=int, default=8000)
ap.add_argument('--model', default='SmolLM2-135M-Instruct.Q4_1')
ap.add_argument('--duration', type=float, default=20.0, help='seconds during which clients send')
ap.add_argument('--seed', type=int, default=1)
ap.add_argument('--think', type=float, default=0.0,
                help="mean seconds a client pauses after a response (exponential; 0: none)")
ap.add_argument('--out', required=True, help='per-request records (JSON lines)')
ap.add_argument('--trace', help='the successful requests as a simulator JSONL trace')
ap.add_argument('--group', action='append', required=True,
                help='NAME:COUNT:KEY:TIER:TENANT:PROMPT_TOKENS:OUTPUT_TOKENS')
a = ap.parse_args()
if not 0 < a.duration <= 3600:
    sys.exit('--duration must be in (0, 3600] seconds')
if not 0 <= a.think <= 600:
    sys.exit('--think must be in [0, 600] seconds')

groups = []
for g in a.group:
    parts = g.split(':')
    if len(parts) != 7:
        sys.exit(f'--group {g!r}: expected NAME:COUNT:KEY:TIER:TENANT:PROMPT_TOKENS:OUTPUT_TOKENS')
    name, count, key, tier, tenant, plen, olen = parts
    try:
        count, plen, olen = int(count), int(plen), int(olen)
    except ValueError:
        sys.exit(f'--group {g!r}: COUNT and the lengths must be integers')
    if not (1 <= count <= 64 and 1 <= plen <= 8192 and 1 <= olen <= 8192):
        sys.exit(f'--group {g!r}: COUNT 1..64, lengths 1..8192')
    groups.append((name, count, key, tier, tenant, plen, olen))

t0 = 0.0
records = []
lock = threading.Lock()
go = threading.Event()


def client(cid, key, tier, tenant, plen, olen, rng):
    go.wait()
    conn = http.client.HTTPConnection(a.host, a.port, timeout=600)
    while True:
        sent = time.monotonic() - t0
        if sent >= a.duration:
            break
        body = json.dumps({'model': a.model, 'prompt': [rng.randrange(1000, 40000) for _ in range(plen)],
                           'max_tokens': olen, 'ignore_eos': True, 'stream': True, 'temperature': 0})
        rec = {'client': cid, 'tier': tier, 'tenant': tenant, 'send': sent, 'prompt_len': plen,
               'output_len': olen}
        try:
            conn.request('POST', '/v1/completions', body,
                         {'authorization': 'Bearer ' + key, 'content-type': 'application/json'})
            r = conn.getresponse()
            if r.status != 200:
                rec.update(status=r.status, err=r.read()[:300].decode('utf-8', 'replace'))
            else:
                chunks = []
                while True:
                    line = r.readline()
                    if not line:
                        break
                    line = line.strip()
                    if not line.startswith(b'data:'):
                        continue
                    data = line[5:].strip()
                    if data == b'[DONE]':
                        r.read()
                        break
                    if json.loads(data).get('choices'):
                        chunks.append(time.monotonic() - t0 - sent)
                rec.update(status=200, ttft=chunks[0] if chunks else None,
                           e2e=time.monotonic() - t0 - sent, chunks=chunks)
        except (OSError, http.client.HTTPException, ValueError) as e:
            rec.update(status=-1, err=str(e))
            conn.close()
            conn = http.client.HTTPConnection(a.host, a.port, timeout=600)
        rec['end'] = time.monotonic() - t0
        with lock:
            records.append(rec)
        if a.think > 0:
            time.sleep(rng.expovariate(1.0 / a.think))


seeds = random.Random(a.seed)
threads = []
# Clients are numbered across the groups (b0..b15, p16, p17), so that no two share a name.
for name, count, key, tier, tenant, plen, olen in groups:
    for _ in range(count):
        th = threading.Thread(target=client, daemon=True,
                              args=(f'{name}{len(threads)}', key, tier, tenant, plen, olen,
                                    random.Random(seeds.random())))
        th.start()
        threads.append(th)
t0 = time.monotonic()
go.set()
for th in threads:
    th.join()
records.sort(key=lambda r: r['send'])
with open(a.out, 'w') as f:
    for r in records:
        f.write(json.dumps(r) + '\n')
if a.trace:
    ended = {}  # client -> when its request before, in the trace, ended
    with open(a.trace, 'w') as f:
        for r in records:
            if r['status'] == 200:
                row = {'arrival_s': round(r['send'], 6), 'prompt_len': r['prompt_len'],
                       'output_len': r['output_len'], 'tenant': r['tenant'], 'tier': r['tier'],
                       'client': r['client']}
                if r['client'] in ended:
                    row['think_s'] = round(max(0.0, r['send'] - ended[r['client']]), 6)
                ended[r['client']] = r['end']
                f.write(json.dumps(row) + '\n')
failed = sum(r['status'] != 200 for r in records)
print(f'{len(records)} requests, {failed} failed', file=sys.stderr)
