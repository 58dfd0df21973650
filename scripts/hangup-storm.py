#!/usr/bin/env python3
"""Hang-up storm against a running Switchyard server (any backend).

Sends rounds of 1-6 concurrent requests of eleven kinds (streamed and not, n=3, two prompts,
echo with logprobs, chat with logprobs, JSON mode, tool calls (required, auto, a named
function), a long prompt, stop strings) and hangs each
up at a random moment (some after reading a little, some half-closing first). Then waits until
the engine is idle with every KV block back (exit 1 if it is not within 60 s) and checks that a
plain request is still served. Standard library only.

With --seats N (the server's server.max_pending_requests, at most 32) it then checks that
every admission seat came back: one request of two prompts x N/2 choices takes them all.

usage: scripts/hangup-storm.py [--port 8000] [--rounds 40] [--api-key KEY] [--seats N]
(the key defaults to $SWITCHYARD_API_KEY; none for a server without keys)
The tests' version of this is tests/server_lifecycle.rs
(hang_ups_of_every_request_kind_leave_the_engine_idle_and_serving).
"""
import argparse
import json
import os
import random
import socket
import sys
import threading
import time
import urllib.error
import urllib.request

KINDS = [
    ("/v1/completions", {"prompt": "Tell me a story", "max_tokens": 300, "ignore_eos": True, "stream": True}),
    ("/v1/completions", {"prompt": "Tell me a story", "max_tokens": 300, "ignore_eos": True, "n": 3,
                         "stream": True, "temperature": 1.0}),
    ("/v1/completions", {"prompt": ["one two", "three four"], "max_tokens": 200, "ignore_eos": True}),
    ("/v1/completions", {"prompt": "Count: 1 2 3", "max_tokens": 100, "echo": True, "logprobs": 3,
                         "ignore_eos": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 200,
                              "stream": True, "logprobs": True, "top_logprobs": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Give JSON"}], "max_tokens": 200,
                              "response_format": {"type": "json_object"}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Weather in Rome?"}], "max_tokens": 200,
                              "stream": True, "tool_choice": "required",
                              "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
                                  "type": "object", "properties": {"city": {"type": "string"}}}}}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Weather in Oslo, then the time?"}],
                              "max_tokens": 200, "stream": True, "tool_choice": "auto",
                              "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
                                  "type": "object", "properties": {"city": {"type": "string"}}}}},
                                        {"type": "function", "function": {"name": "now"}}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Time?"}], "max_tokens": 100,
                              "parallel_tool_calls": False,
                              "tool_choice": {"type": "function", "function": {"name": "now"}},
                              "tools": [{"type": "function", "function": {"name": "now"}}]}),
    ("/v1/completions", {"prompt": "x " * 300, "max_tokens": 50, "stream": True}),
    ("/v1/completions", {"prompt": "Say hello", "max_tokens": 200, "stop": ["\n\n", "zz"], "stream": True,
                         "ignore_eos": True}),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--api-key", default=os.environ.get("SWITCHYARD_API_KEY"),
                    help="bearer key for a server with API keys (default: $SWITCHYARD_API_KEY)")
    ap.add_argument("--seats", type=int, default=0,
                    help="the server's server.max_pending_requests (even, at most 32): check "
                         "that every seat is free after the storm")
    args = ap.parse_args()
    base = f"http://127.0.0.1:{args.port}"
    auth = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    auth_line = f"Authorization: Bearer {args.api_key}\r\n" if args.api_key else ""

    def metric(name):
        """The sum of every series of `name` (per-tier labels split some), None if absent."""
        body = urllib.request.urlopen(f"{base}/metrics").read().decode()
        values = [float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
                  if line.startswith(name + " ") or line.startswith(name + "{")]
        return sum(values) if values else None

    models = urllib.request.Request(f"{base}/v1/models", headers=auth)
    model = json.loads(urllib.request.urlopen(models).read())["data"][0]["id"]

    def client(seed):
        r = random.Random(seed)
        path, body = r.choice(KINDS)
        body = dict(body, model=model)
        b = json.dumps(body).encode()
        s = socket.create_connection(("127.0.0.1", args.port))
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                  f"{auth_line}Content-Type: application/json\r\nContent-Length: {len(b)}\r\n\r\n".encode() + b)
        time.sleep(r.choice([0, 0.002, 0.01, 0.03, 0.1, 0.3, 0.6]))
        if r.random() < 0.3:
            s.settimeout(0.5)
            try:
                s.recv(200)
            except OSError:
                pass
        if r.random() < 0.2:
            s.shutdown(socket.SHUT_WR)
            time.sleep(0.02)
        s.close()

    for k in range(args.rounds):
        threads = [threading.Thread(target=client, args=(k * 10 + i,))
                   for i in range(random.Random(k).randint(1, 6))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    t0 = time.time()
    names = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "http_requests_in_flight"]
    while True:
        state = {n: metric("switchyard:" + n) for n in names}
        if all((v or 0) == 0 for v in state.values()):
            break
        if time.time() - t0 > 60:
            print(f"not idle after 60 s: {state}")
            sys.exit(1)
        time.sleep(0.2)
    print(f"idle after {time.time() - t0:.1f} s; aborted {metric('switchyard:request_aborted_total')}, "
          f"finished {metric('switchyard:request_success_total')}")
    req = urllib.request.Request(f"{base}/v1/completions", headers={"Content-Type": "application/json", **auth},
                                 data=json.dumps({"model": model, "prompt": "Hi", "max_tokens": 4,
                                                  "ignore_eos": True}).encode())
    usage = json.loads(urllib.request.urlopen(req).read())["usage"]
    print(f"a plain request after it: {usage}")
    if usage["completion_tokens"] != 4:
        sys.exit(1)
    if args.seats:
        req = urllib.request.Request(
            f"{base}/v1/completions", headers={"Content-Type": "application/json", **auth},
            data=json.dumps({"model": model, "prompt": ["Hi", "Ho"], "n": args.seats // 2,
                             "max_tokens": 1}).encode())
        try:
            choices = len(json.loads(urllib.request.urlopen(req).read())["choices"])
        except urllib.error.HTTPError as e:
            print(f"seats not all back: a request for {args.seats} was refused: {e.read().decode()}")
            sys.exit(1)
        print(f"all {args.seats} admission seats back: {choices} choices served")


if __name__ == "__main__":
    main()
