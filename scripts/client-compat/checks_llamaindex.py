"""LlamaIndex checks for scripts/client-compat.sh (llama-index-llms-openai-like) against a running
Switchyard server, judged on the protocol (what LlamaIndex parses out of our responses), not on
the small model's answers. Run in a virtual environment of its own: llama-index-llms-openai
requires openai<3, while the other Python clients are checked with openai 3.

usage: python checks_llamaindex.py BASE_URL KEY
Exits 1 if any check fails; prints one line per check.
"""
import sys

from llama_index.core.callbacks import CallbackManager, TokenCountingHandler
from llama_index.core.llms import ChatMessage
from llama_index.core.prompts import PromptTemplate
from llama_index.core.tools import FunctionTool
from llama_index.llms.openai_like import OpenAILike
from pydantic import BaseModel

from check_harness import check, expect, finish, run_async

BASE, KEY = sys.argv[1], sys.argv[2]
MODEL = "smollm2"


class Event(BaseModel):
    """An event."""
    name: str
    year: int


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
    r, chunks = run_async(run())
    expect(r.message.content and len(chunks) > 1, f"{r} {len(chunks)}")


check("llamaindex complete, stream_chat", li_complete)
check("llamaindex TokenCountingHandler reads the server's usage", li_tokens)
check("llamaindex chat_with_tools (+ stream)", li_tools)
check("llamaindex structured_predict", li_structured)
check("llamaindex async", li_async)
finish("llamaindex")
