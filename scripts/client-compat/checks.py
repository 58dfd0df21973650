"""Framework checks for scripts/client-compat.sh: LangChain (langchain-openai), LiteLLM and
LlamaIndex (llama-index-llms-openai-like) against a running Switchyard server, judged on the
protocol (what each framework parses out of our responses), not on the small model's answers.

usage: python checks.py BASE_URL KEY TINY_KEY
(KEY: an API key; TINY_KEY: a key whose tier admits one request at a time, for the 503 checks)
Exits 1 if any check fails; prints one line per check.
"""
import asyncio
import sys
import threading
import time

import httpx
import litellm
import openai
from langchain_core.callbacks import get_usage_metadata_callback
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI, OpenAI
from llama_index.core.callbacks import CallbackManager, TokenCountingHandler
from llama_index.core.llms import ChatMessage
from llama_index.core.prompts import PromptTemplate
from llama_index.core.tools import FunctionTool
from llama_index.llms.openai_like import OpenAILike
from pydantic import BaseModel

BASE, KEY, TINY = sys.argv[1], sys.argv[2], sys.argv[3]
MODEL = "smollm2"
litellm.suppress_debug_info = True
failures = []


def check(name, f):
    try:
        detail = f()
        print(f"ok   {name}" + (f": {detail}" if detail else ""))
    except Exception as e:  # noqa: BLE001 - every failure is reported, then the run goes on
        failures.append(name)
        print(f"FAIL {name}: {type(e).__name__}: {str(e)[:300]}")


def expect(cond, what):
    if not cond:
        raise AssertionError(what)


def raises(f, cls, needle):
    try:
        f()
    except cls as e:
        expect(needle in str(e), f"{type(e).__name__} without {needle!r}: {e}")
        return f"{type(e).__name__}"
    raise AssertionError(f"no {cls.__name__}")


def hogged(f):
    """Runs f while another request holds the tiny tier's only seat; returns f's result and
    the seconds it took."""
    def hog():
        httpx.post(f"{BASE}/completions", headers={"authorization": f"Bearer {TINY}"},
                   json={"prompt": "hi", "max_tokens": 40, "ignore_eos": True}, timeout=60)
    th = threading.Thread(target=hog)
    th.start()
    time.sleep(0.3)
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
check("langchain async", lambda: asyncio.run(lc_async_run()))
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
        r, chunks = asyncio.run(run())
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


# ---------------------------------------------------------------- LlamaIndex
def li(**kw):
    args = dict(model=MODEL, api_base=BASE, api_key=KEY, is_chat_model=True, is_function_calling_model=True,
                context_window=8192, max_tokens=20, temperature=0, max_retries=0)
    args.update(kw)
    return OpenAILike(**args)


def li_complete():
    text = li(is_chat_model=False, max_tokens=6).complete("The capital of France is").text
    deltas = [r.delta for r in li(max_tokens=6).stream_chat([ChatMessage(role="user", content="hi")])]
    expect(text and "".join(d or "" for d in deltas), f"{text!r} {deltas}")


def li_tokens():
    counter = TokenCountingHandler(tokenizer=lambda s: s.split())
    llm = li(max_tokens=7, callback_manager=CallbackManager([counter]))
    raw = llm.chat([ChatMessage(role="user", content="hi")]).raw
    expect(counter.prompt_llm_token_count == raw.usage.prompt_tokens
           and counter.completion_llm_token_count == raw.usage.completion_tokens, f"{counter.llm_token_counts}")


def weather(city: str) -> str:
    """Get the weather for a city."""
    return "sunny"


def li_tools():
    t = FunctionTool.from_defaults(fn=weather, name="get_weather")
    llm = li(max_tokens=60)
    r = llm.chat_with_tools([t], user_msg="Weather in Paris?", tool_required=True)
    calls = llm.get_tool_calls_from_response(r, error_on_no_tool_call=False)
    expect(calls and calls[0].tool_name == "get_weather", f"{calls}")
    last = None
    for last in llm.stream_chat_with_tools([t], user_msg="Weather in Paris?", tool_required=True):
        pass
    calls = llm.get_tool_calls_from_response(last, error_on_no_tool_call=False)
    expect(calls and calls[0].tool_name == "get_weather", f"{calls}")
    return f"{calls[0].tool_kwargs}"


def li_structured():
    r = li(max_tokens=80).structured_predict(Event, PromptTemplate("Name an event with its year."))
    expect(isinstance(r, Event), f"{r!r}")
    return repr(r)


def li_async():
    async def run():
        llm = li(max_tokens=5)
        r = await llm.achat([ChatMessage(role="user", content="hi")])
        g = await llm.astream_chat([ChatMessage(role="user", content="hi")])
        return r, [x async for x in g]
    r, chunks = asyncio.run(run())
    expect(r.message.content and len(chunks) > 1, f"{r} {len(chunks)}")


check("llamaindex complete, stream_chat", li_complete)
check("llamaindex TokenCountingHandler reads the server's usage", li_tokens)
check("llamaindex chat_with_tools (+ stream)", li_tools)
check("llamaindex structured_predict", li_structured)
check("llamaindex async", li_async)

print(f"python clients: {len(failures)} failed" + (f": {', '.join(failures)}" if failures else ""))
sys.exit(1 if failures else 0)
