"""Framework checks for scripts/client-compat.sh: LangChain (langchain-openai), LiteLLM and the
OpenAI Python SDK against a running Switchyard server, on chat/completions, /v1/responses and
/v1/embeddings, judged on the protocol (what each client parses out of our responses), not on the
small model's answers. LlamaIndex's checks are checks_llamaindex.py (it requires openai<3).

usage: python checks.py BASE_URL KEY TINY_KEY RATE_KEY [LORA_KEY]
(KEY: an API key; TINY_KEY: a key whose tier admits one request at a time, for the 503 checks;
RATE_KEY: a key whose tier allows two requests a minute, for the 429 checks; LORA_KEY: a key
that may name the adapters compat-* only, of a server that finds compat-tuned and other-tuned
in its lora.adapter_dirs)
Exits 1 if any check fails; prints one line per check.
"""
import base64
import json
import math
import struct
import sys
import threading
import time
import urllib.request

import litellm
import openai
from langchain_core.callbacks import get_usage_metadata_callback
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI, OpenAI, OpenAIEmbeddings
from pydantic import BaseModel

from check_harness import check, expect, finish, raises, run_async

BASE, KEY, TINY, RATE = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
LORA = sys.argv[5] if len(sys.argv) > 5 else None
MODEL = "smollm2"
litellm.suppress_debug_info = True

def hogged(f):
    """Runs f while another request holds the tiny tier's only seat (a stream of 100 tokens; f
    starts once its first chunk is out, so it is surely being served); returns f's result and
    the seconds it took."""
    serving = threading.Event()

    def hog():
        # The standard library's HTTP client: openai 3 no longer brings httpx along.
        request = urllib.request.Request(
            f"{BASE}/completions", method="POST",
            headers={"authorization": f"Bearer {TINY}", "content-type": "application/json"},
            data=json.dumps({"prompt": "hi", "max_tokens": 100, "ignore_eos": True, "stream": True}).encode())
        try:
            with urllib.request.urlopen(request, timeout=60) as r:
                for _ in r:
                    serving.set()
        finally:
            serving.set()
    th = threading.Thread(target=hog)
    th.start()
    serving.wait(30)
    t0 = time.monotonic()
    try:
        return f(), time.monotonic() - t0
    finally:
        th.join()


class Event(BaseModel):
    """An event."""
    name: str
    year: int


@tool
def get_weather(city: str) -> str:
    """Get the weather for a city."""
    return "sunny"


WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def chat(**kw):
    args = dict(model=MODEL, base_url=BASE, api_key=KEY, max_retries=0, temperature=0, max_tokens=20)
    args.update(kw)
    return ChatOpenAI(**args)


# ---------------------------------------------------------------- LangChain
def lc_invoke():
    r = chat().invoke("Say hi")
    u = r.usage_metadata
    expect(r.content and u["input_tokens"] > 0 and u["output_tokens"] > 0, f"{r}")
    expect(r.response_metadata["finish_reason"] in ("stop", "length"), r.response_metadata)
    return f"{u}"


def lc_stream_usage():
    acc = None
    for c in chat(stream_usage=True, max_tokens=8).stream("Say hi"):
        acc = c if acc is None else acc + c
    expect(acc.usage_metadata and acc.usage_metadata["output_tokens"] > 0, f"{acc}")
    return f"{acc.usage_metadata['input_tokens']} in, {acc.usage_metadata['output_tokens']} out"


def lc_usage_callback():
    with get_usage_metadata_callback() as cb:
        a = chat(max_tokens=5).invoke("hi").usage_metadata
        b = None
        for c in chat(max_tokens=5, stream_usage=True).stream("hi"):
            b = c if b is None else b + c
        total = cb.usage_metadata[MODEL]
    expect(total["input_tokens"] == a["input_tokens"] + b.usage_metadata["input_tokens"], f"{total}")
    expect(total["output_tokens"] == a["output_tokens"] + b.usage_metadata["output_tokens"], f"{total}")
    return f"{total['total_tokens']} tokens over 2 calls"


def lc_n_stop_logprobs():
    gens = chat(n=2, max_tokens=8, temperature=1).generate([[HumanMessage("hi")]]).generations[0]
    expect(len(gens) == 2, f"{len(gens)} generations")
    r = chat(max_completion_tokens=30).invoke("Count: 1, 2, 3,", stop=[","])
    expect("," not in r.content, r.content)
    lp = chat(max_tokens=3).bind(logprobs=True, top_logprobs=2).invoke("hi").response_metadata["logprobs"]
    expect(len(lp["content"]) == 3 and len(lp["content"][0]["top_logprobs"]) == 2, f"{lp}")


def lc_tools():
    msgs = [HumanMessage("What is the weather in Paris?")]
    ai = chat(max_tokens=60).bind_tools([get_weather], tool_choice="get_weather").invoke(msgs)
    expect(len(ai.tool_calls) == 1 and ai.tool_calls[0]["name"] == "get_weather"
           and isinstance(ai.tool_calls[0]["args"].get("city"), str), f"{ai}")
    msgs += [ai, ToolMessage(content="sunny", tool_call_id=ai.tool_calls[0]["id"])]
    after = chat(max_tokens=10).bind_tools([get_weather]).invoke(msgs)
    expect(after.response_metadata["finish_reason"] in ("stop", "length", "tool_calls"), f"{after}")
    return f"{ai.tool_calls[0]['args']}"


def lc_tools_stream():
    acc = None
    for c in chat(max_tokens=60).bind_tools([get_weather], tool_choice="required").stream("Weather in Paris?"):
        acc = c if acc is None else acc + c
    expect(acc.tool_calls and all(t["name"] == "get_weather" for t in acc.tool_calls), f"{acc}")
    return f"{len(acc.tool_calls)} call(s)"


def lc_structured(method):
    def run():
        r = chat(max_tokens=80).with_structured_output(Event, method=method).invoke("Name an event with its year.")
        expect(isinstance(r, Event), f"{r!r}")
        return f"{r!r}"
    return run


async def lc_async_run():
    r = await chat(max_tokens=5).ainvoke("hi")
    chunks = [c async for c in chat(max_tokens=5).astream("hi")]
    expect(r.content and len(chunks) > 1, f"{r} {len(chunks)}")


def lc_errors():
    a = raises(lambda: chat(n=100).invoke("hi"), openai.BadRequestError, "n must be in [1, 16]")
    b = raises(lambda: chat(max_tokens=100000).invoke("hi"), openai.BadRequestError, "maximum context length")
    c = raises(lambda: chat(api_key="wrong").invoke("hi"), openai.AuthenticationError, "Incorrect API key")
    return f"{a}, {b}, {c}"


def lc_retry_503():
    (r, secs) = hogged(lambda: chat(api_key=TINY, max_retries=3, max_tokens=2).invoke("x"))
    expect(r.content is not None and secs >= 0.9, f"{secs:.2f}s")
    return f"retried after Retry-After, {secs:.2f}s"


def lc_legacy():
    r = OpenAI(model=MODEL, base_url=BASE, api_key=KEY, max_tokens=4, logprobs=1, max_retries=0).generate(
        ["The capital of France is"])
    info = r.generations[0][0].generation_info
    expect(len(info["logprobs"]["tokens"]) >= 1, f"{info}")
    return repr(r.generations[0][0].text)


check("langchain invoke", lc_invoke)
check("langchain stream_usage", lc_stream_usage)
check("langchain usage callback", lc_usage_callback)
check("langchain n, stop, logprobs, max_completion_tokens", lc_n_stop_logprobs)
check("langchain bind_tools + ToolMessage back", lc_tools)
check("langchain bind_tools stream", lc_tools_stream)
check("langchain with_structured_output json_schema", lc_structured("json_schema"))
check("langchain with_structured_output function_calling", lc_structured("function_calling"))
check("langchain async", lambda: run_async(lc_async_run()))
check("langchain errors (400, context, 401)", lc_errors)
check("langchain retry on 503", lc_retry_503)
check("langchain legacy OpenAI (completions)", lc_legacy)


# ---------------------------------------------------------------- LiteLLM
def ll(prefix, **kw):
    args = dict(model=f"{prefix}/{MODEL}", api_base=BASE, api_key=KEY, num_retries=0, max_retries=0,
                temperature=0, max_tokens=20, messages=[{"role": "user", "content": "hi"}])
    args.update(kw)
    return litellm.completion(**args)


for prefix in ("openai", "hosted_vllm"):
    def ll_chat(p=prefix):
        r = ll(p, n=2, temperature=1, stop=["\n"], logprobs=True, top_logprobs=1)
        expect(len(r.choices) == 2 and r.usage.completion_tokens > 0, f"{r}")
        expect(r.choices[0].logprobs is not None, f"{r.choices[0]}")

    def ll_stream(p=prefix):
        chunks = list(ll(p, stream=True, stream_options={"include_usage": True}, max_tokens=6))
        usage = litellm.stream_chunk_builder(chunks).usage
        expect(usage.completion_tokens == 6 and usage.prompt_tokens > 0, f"{usage}")

    def ll_tools(p=prefix):
        msgs = [{"role": "user", "content": "Weather in Paris?"}]
        r = ll(p, messages=msgs, tools=WEATHER, tool_choice="required", parallel_tool_calls=False, max_tokens=60)
        m = r.choices[0].message
        expect(m.tool_calls and m.tool_calls[0].function.name == "get_weather", f"{m}")
        back = msgs + [m.model_dump(), {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "sunny"}]
        ll(p, messages=back, tools=WEATHER, max_tokens=5)
        chunks = list(ll(p, messages=msgs, tools=WEATHER, tool_choice="required", max_tokens=60, stream=True))
        calls = litellm.stream_chunk_builder(chunks).choices[0].message.tool_calls
        expect(calls and calls[0].function.name == "get_weather", f"{calls}")
        return m.tool_calls[0].function.arguments

    def ll_json_schema(p=prefix):
        schema = Event.model_json_schema()
        r = ll(p, max_tokens=80, messages=[{"role": "user", "content": "Name an event with its year."}],
               response_format={"type": "json_schema", "json_schema": {"name": "event", "schema": schema}})
        return repr(Event.model_validate_json(r.choices[0].message.content))

    def ll_async(p=prefix):
        async def run():
            r = await litellm.acompletion(model=f"{p}/{MODEL}", api_base=BASE, api_key=KEY, max_tokens=5,
                                          messages=[{"role": "user", "content": "hi"}])
            s = await litellm.acompletion(model=f"{p}/{MODEL}", api_base=BASE, api_key=KEY, max_tokens=5,
                                          messages=[{"role": "user", "content": "hi"}], stream=True)
            return r, [c async for c in s]
        r, chunks = run_async(run())
        expect(r.choices[0].message.content and len(chunks) > 1, f"{r} {len(chunks)}")

    def ll_errors(p=prefix):
        a = raises(lambda: ll(p, n=100), litellm.BadRequestError, "n must be in [1, 16]")
        b = raises(lambda: ll(p, max_tokens=100000), litellm.ContextWindowExceededError, "maximum context length")
        c = raises(lambda: ll(p, api_key="wrong"), litellm.AuthenticationError, "Incorrect API key")
        d, _ = hogged(lambda: raises(lambda: ll(p, api_key=TINY), litellm.ServiceUnavailableError, "retry shortly"))
        return f"{a}, {b}, {c}, {d}"

    check(f"litellm {prefix}/ chat n, stop, logprobs", ll_chat)
    check(f"litellm {prefix}/ stream include_usage", ll_stream)
    check(f"litellm {prefix}/ tools (+ stream, + tool message back)", ll_tools)
    check(f"litellm {prefix}/ json_schema", ll_json_schema)
    check(f"litellm {prefix}/ async", ll_async)
    check(f"litellm {prefix}/ errors (400, context, 401, 503)", ll_errors)


# ---------------------------------------------------------------- Responses API (/v1/responses)
# LangChain's ChatOpenAI(use_responses_api=True): what it sends by default (input items,
# max_output_tokens, temperature, stream; tools in the Responses shape, text.format for
# json_schema) is read; it sends include/reasoning/previous_response_id only when asked.
def rchat(**kw):
    return chat(use_responses_api=True, **kw)


def text_of(msg):
    return msg.text if isinstance(msg.text, str) else msg.text()


def lcr_invoke():
    r = rchat().invoke("Say hi")
    u = r.usage_metadata
    expect(text_of(r) and u["input_tokens"] > 0 and u["output_tokens"] > 0
           and u["total_tokens"] == u["input_tokens"] + u["output_tokens"], f"{r}")
    expect(r.response_metadata["id"].startswith("resp_")
           and r.response_metadata["status"] in ("completed", "incomplete"), r.response_metadata)
    again = rchat(max_tokens=5).invoke([HumanMessage("Say hi"), r, HumanMessage("Again")])
    expect(text_of(again), f"{again}")
    return f"{u['input_tokens']} in, {u['output_tokens']} out; its answer sent back as history"


def lcr_stream():
    acc = None
    for c in rchat(max_tokens=8).stream("Say hi"):
        acc = c if acc is None else acc + c
    expect(text_of(acc) and acc.usage_metadata["output_tokens"] == 8, f"{acc}")
    return f"{acc.usage_metadata['input_tokens']} in, {acc.usage_metadata['output_tokens']} out"


def lcr_tools():
    msgs = [HumanMessage("What is the weather in Paris?")]
    ai = rchat(max_tokens=60).bind_tools([get_weather], tool_choice="get_weather").invoke(msgs)
    expect(len(ai.tool_calls) >= 1 and ai.tool_calls[0]["name"] == "get_weather"
           and isinstance(ai.tool_calls[0]["args"].get("city"), str), f"{ai}")
    msgs += [ai] + [ToolMessage(content="sunny", tool_call_id=t["id"]) for t in ai.tool_calls]
    after = rchat(max_tokens=10).bind_tools([get_weather]).invoke(msgs)
    expect(after.response_metadata["status"] in ("completed", "incomplete"), f"{after}")
    acc = None
    for c in rchat(max_tokens=60).bind_tools([get_weather], tool_choice="required").stream("Weather in Paris?"):
        acc = c if acc is None else acc + c
    expect(acc.tool_calls and acc.tool_calls[0]["name"] == "get_weather", f"{acc}")
    return f"{ai.tool_calls[0]['args']}"


def lcr_structured(method):
    def run():
        r = rchat(max_tokens=80).with_structured_output(Event, method=method).invoke("Name an event with its year.")
        expect(isinstance(r, Event), f"{r!r}")
        return f"{r!r}"
    return run


def lcr_async():
    async def run():
        r = await rchat(max_tokens=5).ainvoke("hi")
        return r, [c async for c in rchat(max_tokens=5).astream("hi")]
    r, chunks = run_async(run())
    expect(text_of(r) and len(chunks) > 1, f"{r} {len(chunks)}")


def lcr_errors():
    a = raises(lambda: rchat(max_tokens=100000).invoke("hi"), openai.BadRequestError, "maximum context length")
    b = raises(lambda: rchat(use_previous_response_id=True).invoke(
        [HumanMessage("hi"), AIMessage("hello", response_metadata={"id": "resp_x"}), HumanMessage("more")]),
        openai.BadRequestError, "Previous response with id 'resp_x' not found",
        code="previous_response_not_found", param="previous_response_id")
    c = raises(lambda: rchat(api_key="wrong").invoke("hi"), openai.AuthenticationError, "Incorrect API key")
    return f"{a}, {b} (unknown previous_response_id), {c}"


def lcr_previous():
    # use_previous_response_id: LangChain sends only the messages after the last AI message,
    # with that message's response id; the server supplies the rest from its store.
    llm = rchat(use_previous_response_id=True, max_tokens=8)
    first = llm.invoke("My name is Ada.")
    expect(first.response_metadata.get("id", "").startswith("resp_"), f"{first.response_metadata}")
    second = llm.invoke([HumanMessage("My name is Ada."), first, HumanMessage("What is my name?")])
    u1, u2 = first.usage_metadata, second.usage_metadata
    expect(u2["input_tokens"] > u1["input_tokens"] + u1["output_tokens"], f"{u1} {u2}")
    return f"{u1['input_tokens']} then {u2['input_tokens']} input tokens"


check("langchain responses invoke (+ history)", lcr_invoke)
check("langchain responses stream", lcr_stream)
check("langchain responses bind_tools + ToolMessage back (+ stream)", lcr_tools)
check("langchain responses with_structured_output json_schema", lcr_structured("json_schema"))
check("langchain responses with_structured_output function_calling", lcr_structured("function_calling"))
check("langchain responses async", lcr_async)
check("langchain responses errors (context, previous_response_id, 401)", lcr_errors)
check("langchain responses use_previous_response_id", lcr_previous)

RTOOLS = [{"type": "function", "name": "get_weather", "description": "Get the weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"], "additionalProperties": False}, "strict": True}]
QUESTION = {"role": "user", "content": "What is the weather in Paris?"}


for prefix in ("openai", "hosted_vllm"):
    def lr(p=prefix, **kw):
        args = dict(model=f"{p}/{MODEL}", api_base=BASE, api_key=KEY, num_retries=0, temperature=0,
                    max_output_tokens=16, input="Say hi")
        args.update(kw)
        return litellm.responses(**args)

    def lr_create(p=prefix):
        r = lr(p, instructions="Answer briefly.")
        text = "".join(c.text for o in r.output if o.type == "message" for c in o.content)
        expect(r.status in ("completed", "incomplete") and text and r.usage.output_tokens > 0, f"{r}")
        # LiteLLM wraps the server's id (base64 of "litellm:...;response_id:resp_..."): ours
        # shows the call went to /v1/responses, not through LiteLLM's bridge to chat.
        inner = base64.b64decode(r.id.removeprefix("resp_")).decode()
        expect(f"custom_llm_provider:{p};" in inner and "response_id:resp_" in inner, inner)
        return f"{r.status}, {r.usage.input_tokens} in, {r.usage.output_tokens} out"

    def lr_stream(p=prefix):
        events = list(lr(p, stream=True))
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        last = events[-1].response
        text = "".join(c.text for o in last.output if o.type == "message" for c in o.content)
        expect(deltas and deltas == text and last.usage.output_tokens == 16, f"{deltas!r} {last}")
        return f"{len(events)} events, {last.status}"

    def lr_tools(p=prefix):
        r = lr(p, input=[QUESTION], tools=RTOOLS, tool_choice="required", parallel_tool_calls=False,
               max_output_tokens=60)
        fc = next(o for o in r.output if o.type == "function_call")
        expect(fc.name == "get_weather" and isinstance(json.loads(fc.arguments)["city"], str), f"{fc}")
        back = lr(p, tools=RTOOLS, max_output_tokens=10, input=[
            QUESTION, {"type": "function_call", "call_id": fc.call_id, "name": fc.name, "arguments": fc.arguments},
            {"type": "function_call_output", "call_id": fc.call_id, "output": "sunny"}])
        expect(back.status in ("completed", "incomplete"), f"{back}")
        return fc.arguments

    def lr_async(p=prefix):
        r = run_async(litellm.aresponses(model=f"{p}/{MODEL}", api_base=BASE, api_key=KEY,
                                           input="hi", max_output_tokens=5))
        expect(r.usage.output_tokens > 0, f"{r}")

    def lr_errors(p=prefix):
        a = raises(lambda: lr(p, max_output_tokens=100000), litellm.BadRequestError, "maximum context length")
        b = raises(lambda: lr(p, api_key="wrong"), litellm.AuthenticationError, "Incorrect API key")
        return f"{a}, {b}"

    check(f"litellm {prefix}/ responses", lr_create)
    check(f"litellm {prefix}/ responses stream", lr_stream)
    check(f"litellm {prefix}/ responses function_call + function_call_output back", lr_tools)
    check(f"litellm {prefix}/ aresponses", lr_async)
    check(f"litellm {prefix}/ responses errors (context, 401)", lr_errors)


# The OpenAI Python SDK's responses.*.
sdk = openai.OpenAI(base_url=BASE, api_key=KEY, max_retries=0)
ASK = dict(model=MODEL, instructions="Answer in one sentence.", input="What is the capital of France?",
           max_output_tokens=40, temperature=0)
plain = {}


def sdk_create():
    r = sdk.responses.create(**ASK, metadata={"k": "v"})
    expect(r.output_text and r.object == "response" and r.metadata == {"k": "v"} and r.id.startswith("resp_"), f"{r}")
    plain["text"] = r.output_text
    return f"{r.status}, {r.usage.input_tokens} in, {r.usage.output_tokens} out"


def sdk_create_stream():
    events = list(sdk.responses.create(**ASK, stream=True))
    kinds = [e.type for e in events]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    expect(kinds[:2] == ["response.created", "response.in_progress"]
           and kinds[-1] in ("response.completed", "response.incomplete")
           and [e.sequence_number for e in events] == list(range(len(events))), kinds)
    expect(deltas == plain["text"] == events[-1].response.output_text, f"{deltas!r} {plain}")
    return f"{len(events)} events"


def sdk_stream_helper():
    with sdk.responses.stream(**ASK) as s:
        text = "".join(e.delta for e in s if e.type == "response.output_text.delta")
        done = s.get_final_response()
    expect(done.output_text == text == plain["text"], f"{text!r} {done}")


def sdk_parse():
    class City(BaseModel):
        city: str
        country: str
    p = sdk.responses.parse(model=MODEL, input="Describe Paris.", text_format=City, max_output_tokens=60, temperature=0)
    expect(isinstance(p.output_parsed, City), f"{p}")
    with sdk.responses.stream(model=MODEL, input="Describe Paris.", text_format=City, max_output_tokens=60,
                              temperature=0) as s:
        streamed = s.get_final_response()
    expect(streamed.output_parsed == p.output_parsed, f"{streamed}")
    return repr(p.output_parsed)


def sdk_tools():
    t = sdk.responses.create(model=MODEL, input=[QUESTION], tools=RTOOLS, tool_choice="required",
                             parallel_tool_calls=False, max_output_tokens=60, temperature=0)
    call = next(i for i in t.output if i.type == "function_call")
    expect(call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str), f"{call}")
    back = sdk.responses.create(model=MODEL, tools=RTOOLS, max_output_tokens=30, temperature=0, input=[
        QUESTION, *t.output, {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    expect(back.status in ("completed", "incomplete"), f"{back}")
    with sdk.responses.stream(model=MODEL, input=[QUESTION], tools=RTOOLS, tool_choice="required",
                              parallel_tool_calls=False, max_output_tokens=60, temperature=0) as s:
        arg_deltas = "".join(e.delta for e in s if e.type == "response.function_call_arguments.delta")
        final = s.get_final_response()
    fc = next(i for i in final.output if i.type == "function_call")
    expect(fc.arguments == arg_deltas and json.loads(fc.arguments)["city"], f"{fc} {arg_deltas!r}")
    return call.arguments


def sdk_json_incomplete():
    j = sdk.responses.create(model=MODEL, input="Give a JSON object describing Paris.",
                             text={"format": {"type": "json_object"}}, max_output_tokens=80, temperature=0)
    if j.status == "completed":
        expect(isinstance(json.loads(j.output_text), dict), j.output_text)
    inc = sdk.responses.create(model=MODEL, input="Tell me a long story.", max_output_tokens=4)
    expect(inc.status == "incomplete" and inc.incomplete_details.reason == "max_output_tokens"
           and inc.usage.output_tokens == 4, f"{inc}")
    return f"json_object {j.status}, incomplete at 4 tokens"


def sdk_refusals():
    params = []
    for kwargs, param in [({"previous_response_id": "resp_x"}, "previous_response_id"),
                          ({"tools": [{"type": "web_search"}]}, "tools[0].type")]:
        try:
            sdk.responses.create(model=MODEL, input="x", **kwargs)
            raise AssertionError(f"{kwargs} accepted")
        except openai.BadRequestError as e:
            # The SDK's error text shows the body's message (only it, from openai 3 on).
            expect(e.body.get("param") == param == e.param and e.body["message"] in str(e), f"{e.body} {e}")
            params.append(param)
    raises(lambda: sdk.responses.retrieve("resp_x"), openai.NotFoundError, "not found")
    return ", ".join(params) + ", retrieve (404)"


def sdk_stored():
    first = sdk.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=8, temperature=0)
    got = sdk.responses.retrieve(first.id)
    expect(got.model_dump() == first.model_dump(), f"{got} != {first}")
    second = sdk.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                  max_output_tokens=8, temperature=0)
    expect(second.previous_response_id == first.id
           and second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
           and second.usage.input_tokens_details.cached_tokens > 0, f"{first.usage} {second}")
    items = sdk.responses.input_items.list(second.id)
    expect([i.type for i in items.data] == ["message"] and items.data[0].content[0].text == "What is my name?",
           f"{items}")
    sdk.responses.delete(first.id)
    raises(lambda: sdk.responses.retrieve(first.id), openai.NotFoundError, "not found")
    raises(lambda: sdk.responses.create(model=MODEL, input="x", previous_response_id=first.id),
           openai.BadRequestError, "not found", code="previous_response_not_found",
           param="previous_response_id")
    return f"chained ({second.usage.input_tokens} in, {second.usage.input_tokens_details.cached_tokens} cached), retrieved, listed, deleted"


check("openai-python responses.create", sdk_create)
check("openai-python responses.create(stream=True)", sdk_create_stream)
check("openai-python responses.stream + get_final_response", sdk_stream_helper)
check("openai-python responses.parse(text_format) (+ stream)", sdk_parse)
check("openai-python function_call + output back (+ stream)", sdk_tools)
check("openai-python json_object, incomplete", sdk_json_incomplete)
check("openai-python refusals (400 with param)", sdk_refusals)
def sdk_logprobs():
    r = sdk.responses.create(model=MODEL, input="Name a color.", max_output_tokens=6, temperature=0,
                             include=["message.output_text.logprobs"], top_logprobs=2)
    part = r.output[0].content[0]
    expect(part.logprobs and "".join(l.token for l in part.logprobs) == part.text
           and all(len(l.top_logprobs) == 2 for l in part.logprobs), f"{part}")
    with sdk.responses.stream(model=MODEL, input="Name a color.", max_output_tokens=6, temperature=0,
                              include=["message.output_text.logprobs"], top_logprobs=2) as s:
        streamed = [l.logprob for e in s if e.type == "response.output_text.delta" for l in e.logprobs]
    expect(streamed == [l.logprob for l in part.logprobs], f"{streamed} {part.logprobs}")
    return f"{len(part.logprobs)} tokens"


def sdk_background():
    r = sdk.responses.create(model=MODEL, input="Say hello.", background=True, max_output_tokens=8)
    expect(r.status == "queued" and r.background, f"{r}")
    deadline = time.time() + 60
    while r.status in ("queued", "in_progress") and time.time() < deadline:
        time.sleep(0.1)
        r = sdk.responses.retrieve(r.id)
    expect(r.status in ("completed", "incomplete") and r.output_text, f"{r}")
    long = sdk.responses.create(model=MODEL, input="Count to 1000.", background=True, max_output_tokens=2000)
    c = sdk.responses.cancel(long.id)
    expect(c.status == "cancelled" and sdk.responses.retrieve(long.id).status == "cancelled", f"{c}")
    return f"polled to {r.status}, cancelled another"


def sdk_background_stream():
    first = []
    for e in sdk.responses.create(model=MODEL, input="Count to 10.", background=True, stream=True,
                                  max_output_tokens=100, temperature=0):
        first.append(e)
        if sum(1 for x in first if x.type == "response.output_text.delta") >= 3:
            break  # the client hangs up; the response runs on
    rid, last = first[0].response.id, first[-1].sequence_number
    rest = list(sdk.responses.retrieve(rid, stream=True, starting_after=last))
    seqs = [e.sequence_number for e in first + rest]
    expect(seqs == list(range(len(seqs))), f"{seqs}")
    text = "".join(e.delta for e in first + rest if e.type == "response.output_text.delta")
    with sdk.responses.stream(response_id=rid) as s:  # the helper replays from the start
        final = s.get_final_response()
    expect(final.id == rid and final.output_text == text, f"{final} {text!r}")
    fg = sdk.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    raises(lambda: list(sdk.responses.retrieve(fg.id, stream=True)), openai.BadRequestError,
           "only a background response")
    return f"{len(seqs)} events, resumed after {last}, foreground refused"


check("openai-python include output_text.logprobs (+ stream)", sdk_logprobs)
check("openai-python background: poll retrieve, cancel", sdk_background)
check("openai-python background stream: dropped, resumed (starting_after), replayed (response_id)",
      sdk_background_stream)
check("openai-python stored: retrieve, previous_response_id, input_items, delete", sdk_stored)


def sdk_async_streams():
    # One AsyncOpenAI for all (its HTTPX2 pool from openai 3 on, which reads an HTTP/1.1 body
    # on after [DONE] for the connection's reuse): a chat stream read to its end, one left
    # after its first chunk by AsyncStream.aclose() (openai 3), then a Responses stream; each
    # must come whole after the one before.
    async def run():
        client = openai.AsyncOpenAI(base_url=BASE, api_key=KEY, max_retries=0)
        try:
            msgs = [{"role": "user", "content": "Say hi"}]
            full = await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, stream=True,
                                                        stream_options={"include_usage": True})
            chunks = [c async for c in full]
            left = await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=50, stream=True)
            first = await anext(aiter(left))
            await left.aclose()
            events = [e async for e in await client.responses.create(**ASK, stream=True)]
            return chunks, first, events
        finally:
            await client.close()
    chunks, first, events = run_async(run())
    expect(chunks[-1].usage.completion_tokens == 6 and chunks[-1].choices == [], f"{chunks[-1]}")
    expect(first.choices[0].delta.role == "assistant", f"{first}")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    expect(events[-1].type in ("response.completed", "response.incomplete") and deltas == plain["text"],
           f"{[e.type for e in events]} {deltas!r}")
    return f"{len(chunks)} chunks, one closed after its first, {len(events)} events"


check("openai-python AsyncOpenAI streams on one client (chat, aclose, responses)", sdk_async_streams)


# ---------------------------------------------------------------- Embeddings (/v1/embeddings)
TEXTS = ["The capital of France is Paris.", "Bananas are yellow."]


def f32(x):
    """x as the f32 it was written from (JSON floats read back as doubles)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def unit(v):
    return abs(math.sqrt(sum(x * x for x in v)) - 1.0) < 1e-5


def sdk_embeddings():
    # Without encoding_format the SDK asks for base64 and decodes it itself (numpy if installed,
    # else the array module): it must read the same f32s as the float answer.
    b64 = sdk.embeddings.create(model=MODEL, input=TEXTS)
    floats = sdk.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    expect([d.index for d in b64.data] == [0, 1] and [d.index for d in floats.data] == [0, 1], f"{b64}")
    for d, f in zip(b64.data, floats.data):
        expect(len(d.embedding) == len(f.embedding) > 0 and unit(d.embedding), f"{len(d.embedding)}")
        expect([f32(x) for x in d.embedding] == [f32(x) for x in f.embedding], "base64 != float")
    expect(b64.usage.prompt_tokens == floats.usage.prompt_tokens == b64.usage.total_tokens > 0, f"{b64.usage}")
    raw = sdk.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="base64").data[0].embedding
    expect(isinstance(raw, str) and len(base64.b64decode(raw)) == 4 * len(floats.data[0].embedding), raw[:40])
    a = raises(lambda: sdk.embeddings.create(model=MODEL, input=TEXTS, dimensions=8), openai.BadRequestError,
               "Matryoshka")
    b = raises(lambda: sdk.embeddings.create(model=MODEL, input=""), openai.BadRequestError, "must not be empty")
    return f"{len(floats.data[0].embedding)} dims, {b64.usage.prompt_tokens} tokens; dimensions {a}, empty {b}"


def lc_embeddings():
    # check_embedding_ctx_length=False: by default LangChain sends tiktoken's token ids, which
    # only OpenAI's models read (as for any OpenAI-compatible server).
    e = OpenAIEmbeddings(model=MODEL, base_url=BASE, api_key=KEY, max_retries=0, check_embedding_ctx_length=False)
    docs = e.embed_documents(TEXTS)
    query = e.embed_query(TEXTS[0])
    expect(len(docs) == 2 and all(unit(v) for v in docs) and docs[0] != docs[1], f"{len(docs)}")
    expect(max(abs(x - y) for x, y in zip(docs[0], query)) < 1e-5, "query != its document")
    return f"{len(docs)} documents of {len(docs[0])} dims"


check("openai-python embeddings.create (default base64, float, 400s)", sdk_embeddings)
check("langchain OpenAIEmbeddings embed_documents, embed_query", lc_embeddings)


# ---------------------------------------------------------------- Beam search (vLLM's fields)
def sdk_beam_search():
    # vLLM's fields go through the SDK's extra_body, as clients of vLLM send them.
    c = sdk.completions.create(model=MODEL, prompt="The capital of France is", n=3, max_tokens=8, logprobs=1,
                               extra_body={"use_beam_search": True, "length_penalty": 0.5})
    expect([x.index for x in c.choices] == [0, 1, 2] and len({x.text for x in c.choices}) == 3, f"{c}")
    expect(all(x.finish_reason in ("stop", "length") for x in c.choices), f"{c}")
    tokens = sum(len(x.logprobs.tokens) + (x.finish_reason == "stop") for x in c.choices)
    expect(c.usage.completion_tokens == tokens, f"{c.usage} vs {tokens}")
    chat = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a fruit."}], n=2,
                                       max_tokens=6, extra_body={"use_beam_search": True})
    expect(len(chat.choices) == 2 and all(x.message.content for x in chat.choices), f"{chat}")
    e = raises(lambda: sdk.completions.create(model=MODEL, prompt="x", top_p=0.5,
                                              extra_body={"use_beam_search": True}),
               openai.BadRequestError, "top_p")
    return f"{c.choices[0].text!r} first of 3, chat {len(chat.choices)} beams, top_p {e}"


check("openai-python beam search (extra_body use_beam_search: completions, chat, a 400)", sdk_beam_search)


def rate_limited():
    # Two requests a minute: both answered with OpenAI's headers, then every client's 429.
    rated = openai.OpenAI(base_url=BASE, api_key=RATE, max_retries=0)
    left = []
    for _ in range(2):
        raw = rated.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        expect(raw.parse().choices, f"{raw}")
        expect(raw.headers["x-ratelimit-limit-requests"] == "2", f"{raw.headers}")
        left.append(raw.headers["x-ratelimit-remaining-requests"])
    expect(left == ["1", "0"], f"{left}")
    try:
        rated.completions.create(model=MODEL, prompt="x", max_tokens=1)
        raise AssertionError("no RateLimitError")
    except openai.RateLimitError as e:
        expect(e.status_code == 429 and e.code == "rate_limit_exceeded", f"{e}")
        wait = int(e.response.headers["retry-after"])
        expect(1 <= wait <= 30, f"{e.response.headers}")
    lc = raises(lambda: ChatOpenAI(base_url=BASE, api_key=RATE, model=MODEL, max_retries=0).invoke("Hi"),
                openai.RateLimitError, "Rate limit reached")
    lite = raises(lambda: litellm.completion(model=f"openai/{MODEL}", api_base=BASE, api_key=RATE,
                                             messages=[{"role": "user", "content": "Hi"}], num_retries=0),
                  litellm.RateLimitError, "Rate limit reached")
    return f"remaining {left}, then 429 with Retry-After {wait}s; langchain {lc}, litellm {lite}"


check("rate limits: 429 as RateLimitError (openai-python, langchain, litellm), x-ratelimit-* headers",
      rate_limited)


# ---------------------------------------------------------------- Prompt logprobs (vLLM's field)
def sdk_prompt_logprobs():
    # vLLM's prompt_logprobs through extra_body; the SDK keeps the field it does not know among
    # the model's extras. Completions: per choice, each its own prompt's; chat: at the top.
    c = sdk.completions.create(model=MODEL, prompt=["The capital of France is", "Hi there"], n=2,
                               max_tokens=2, extra_body={"prompt_logprobs": 1})
    lists = [x.model_extra.get("prompt_logprobs") for x in c.choices]
    expect(all(lp and lp[0] is None and all(1 <= len(p) <= 2 for p in lp[1:]) for lp in lists), f"{lists}")
    expect(lists[0] == lists[1] and lists[2] == lists[3] and lists[0] != lists[2], f"{lists}")
    first = next(iter(lists[0][1].values()))
    expect(set(first) == {"logprob", "rank", "decoded_token"} and first["rank"] >= 1, f"{first}")
    chat = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                       extra_body={"prompt_logprobs": 0})
    top = chat.model_extra.get("prompt_logprobs")
    expect(top and top[0] is None and all(len(p) == 1 for p in top[1:]), f"{chat}")
    e = raises(lambda: sdk.completions.create(model=MODEL, prompt="x", stream=True,
                                              extra_body={"prompt_logprobs": 1}),
               openai.BadRequestError, "prompt_logprobs")
    return f"{len(lists[0])} and {len(lists[2])} prompt tokens, chat {len(top)}, streamed {e}"


check("openai-python prompt_logprobs (extra_body: completions n=2 two prompts, chat, a streamed 400)",
      sdk_prompt_logprobs)


# ---------------------------------------------------------------- LoRA adapters per key
def lora_per_key():
    # The server lists the adapters in lora.adapter_dirs (compat-tuned, other-tuned) before a
    # request names them and finds them on the first request naming them; LORA's key may name
    # only compat-*.
    mine = openai.OpenAI(base_url=BASE, api_key=LORA, max_retries=0)
    before = [m.id for m in mine.models.list()]
    expect(before == [MODEL, "compat-tuned"], f"listed before a request named it: {before}")
    card = mine.models.retrieve("compat-tuned")
    expect(card.id == "compat-tuned" and card.model_extra.get("parent") == MODEL, f"{card}")
    c = mine.chat.completions.create(model="compat-tuned", messages=[{"role": "user", "content": "Hi"}],
                                     max_tokens=2)
    expect(c.model == "compat-tuned" and c.choices[0].message.content is not None, f"{c}")
    # The unrestricted key finds the other adapter; to LORA's key it stays a model not found.
    expect(sdk.models.retrieve("other-tuned").id == "other-tuned", "other-tuned not found")
    e = raises(lambda: mine.chat.completions.create(model="other-tuned", max_tokens=2,
                                                    messages=[{"role": "user", "content": "Hi"}]),
               openai.NotFoundError, "other-tuned")
    raises(lambda: mine.models.retrieve("other-tuned"), openai.NotFoundError, "other-tuned")
    ids = [m.id for m in mine.models.list()]
    expect(ids == [MODEL, "compat-tuned"], f"{ids}")
    everyone = sorted(m.id for m in sdk.models.list())
    expect(everyone == sorted([MODEL, "compat-tuned", "other-tuned"]), f"{everyone}")
    lc = ChatOpenAI(base_url=BASE, api_key=LORA, model="compat-tuned", max_tokens=2, max_retries=0).invoke("Hi")
    expect(lc.response_metadata.get("model_name") == "compat-tuned", f"{lc.response_metadata}")
    lite = raises(lambda: litellm.completion(model="openai/other-tuned", api_base=BASE, api_key=LORA,
                                             messages=[{"role": "user", "content": "Hi"}], num_retries=0),
                  litellm.NotFoundError, "other-tuned")
    return f"listed {ids}; another tenant's adapter: openai {e}, litellm {lite}"


if LORA:
    check("LoRA per key: an adapter found on demand (models.retrieve, chat, langchain), another's "
          "NotFoundError (openai-python, litellm), models.list per key", lora_per_key)


finish("python clients")
