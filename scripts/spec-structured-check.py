#!/usr/bin/env python3
"""Structured output under speculative decoding, through a running server (gpu-check.sh's
`specstruct` section; any backend). 48 concurrent completions whose prompts hold a JSON object
twice, so prompt lookup finds drafts: a third under a JSON schema (greedy: the answer must
parse, match the schema and, for this model, copy the object), a third under a regex (sampled,
seeded: the answer must match it whole), a third free. Prints the counts, any invalid answer
and the server's speculative-decoding and structured-output metrics. Exit status 1 if any
constrained answer is invalid.

usage: spec-structured-check.py BASE_URL   (e.g. http://127.0.0.1:18432)
"""
import concurrent.futures as cf
import json
import re
import sys
import urllib.request

BASE = sys.argv[1].rstrip("/")
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "id": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "id", "tags"],
    "additionalProperties": False,
}
REGEX = r"\{\"name\": \"[a-z0-9 ]{1,60}\", \"id\": [0-9]{1,6}"
ITEMS = [
    {"name": f"item number {i} of the catalogue", "id": 1000 + i,
     "tags": ["alpha", "beta", "gamma", "delta"][: (i % 4) + 1]}
    for i in range(48)
]


def post(path, body):
    req = urllib.request.Request(BASE + path, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as f:
        return json.loads(f.read())


def job(i):
    src = json.dumps(ITEMS[i])
    body = {"prompt": f"Copy this JSON object exactly, with nothing else:\n{src}\n{src}\n",
            "max_tokens": 96, "temperature": 0}
    if i % 3 == 0:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "item", "schema": SCHEMA}}
        text = post("/v1/completions", body)["choices"][0]["text"]
        try:
            o = json.loads(text)
        except ValueError:
            return ("schema", False, False, text)
        ok = (isinstance(o, dict) and set(o) == {"name", "id", "tags"}
              and isinstance(o["name"], str) and isinstance(o["id"], int)
              and isinstance(o["tags"], list) and all(isinstance(t, str) for t in o["tags"]))
        return ("schema", ok, o == ITEMS[i], text)
    if i % 3 == 1:
        body.update({"temperature": 0.7, "seed": i, "structured_outputs": {"regex": REGEX}})
        text = post("/v1/completions", body)["choices"][0]["text"]
        return ("regex", re.fullmatch(REGEX, text) is not None, False, text)
    return ("free", True, False, post("/v1/completions", body)["choices"][0]["text"])


with cf.ThreadPoolExecutor(48) as ex:
    results = list(ex.map(job, range(48)))
for kind in ("schema", "regex", "free"):
    rs = [r for r in results if r[0] == kind]
    print(f"{kind}: {len(rs)} answers, {sum(r[1] for r in rs)} valid, "
          f"{sum(r[2] for r in rs)} exact copies")
bad = [r for r in results if not r[1]]
print("invalid:", bad)
metrics = urllib.request.urlopen(BASE + "/metrics").read().decode()
for line in metrics.splitlines():
    if not line.startswith("#") and ("spec_decode" in line or "structured_output_requests" in line
                                     or "structured_output_failures" in line):
        print(line)
sys.exit(1 if bad else 0)
