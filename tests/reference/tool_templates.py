"""Golden prompts for chat templates that write tools themselves (`model.tool_prompt: template`).

The reference is Jinja2 configured as Hugging Face transformers' `apply_chat_template`
configures it (transformers/utils/chat_template_utils.py: a sandboxed environment with
`trim_blocks`, `lstrip_blocks` and loop controls; `tojson` as `json.dumps(ensure_ascii=False)`;
`raise_exception`), rendering each OpenAI chat request the way vLLM hands one to a template:
`tools` is the list of tool dictionaries as the client wrote them (`None` without tools), an
assistant message's `tool_calls` keep their shape with each call's `arguments` string parsed to
an object, a `tool` message keeps `tool_call_id`, a null `content` is the empty string; for
Mistral's templates, which take only 9-character ids, vLLM keeps an id's last 9 characters.

`tools` is every tool of the request whatever `tool_choice` names, and none with
`tool_choice: "none"`, as vLLM gives them with `--exclude-tools-when-tool-choice-none`.

The templates are the models' own, unmodified but where noted, in tests/fixtures:
- qwen3.jinja: `chat_template` of Qwen/Qwen3-8B's tokenizer_config.json.
- llama3.1.jinja: `chat_template` of meta-llama/Llama-3.1-8B-Instruct's tokenizer_config.json
  (the July 2024 release, whose default date is "26 Jul 2024").
- mistral-v3.jinja: Mistral's "v3" template of Mistral-Large-Instruct-2407, as llama.cpp's
  chat-template tests (tests/test-chat-template.cpp) carry it.
- mistral-v11.jinja: the template of Ministral-3-8B-Instruct-2512 (Mistral's v11+ call format,
  `[TOOL_CALLS]name[ARGS]{...}`) as Unsloth ships it, with one change: its long default system
  message is cut to its first sentence.

Run from the repository root (needs only jinja2):

    python3 tests/reference/tool_templates.py > tests/fixtures/tool_templates_golden.json

tests/server_tools.rs (`templates_write_tools_calls_and_results_as_transformers_renders_them`)
sends each request to `/tokenize` on a server with that template and compares the detokenized
prompt with the text here.
"""

import copy
import json
import sys

import jinja2
import jinja2.ext
import jinja2.sandbox

# SmolLM2's special-token texts: the end-to-end server runs these templates on SmolLM2.
BOS = "<|im_start|>"
EOS = "<|im_end|>"


def environment():
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env


def template_messages(messages, mistral):
    out = []
    for m in messages:
        m = copy.deepcopy(m)
        if m.get("content") is None:
            m["content"] = ""
        for call in m.get("tool_calls") or []:
            args = call["function"].get("arguments")
            if isinstance(args, str):
                call["function"]["arguments"] = json.loads(args)
            if mistral and "id" in call:
                call["id"] = call["id"][-9:]
        if mistral and "tool_call_id" in m:
            m["tool_call_id"] = m["tool_call_id"][-9:]
        out.append(m)
    return out


def offered_tools(request):
    tools = request.get("tools")
    choice = request.get("tool_choice", "auto")
    if not tools or choice == "none":
        return None
    return tools


def render(env, fixture, template, request):
    kwargs = dict(request.get("chat_template_kwargs") or {})
    return env.from_string(template).render(
        messages=template_messages(request["messages"], fixture.startswith("mistral")),
        tools=offered_tools(request),
        add_generation_prompt=request.get("add_generation_prompt", True),
        bos_token=BOS,
        eos_token=EOS,
        **kwargs,
    )


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "local_time", "parameters": {"type": "object", "properties": {}}},
}
CALLS = [
    {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Zürich", "unit": "celsius"}'},
    },
    {"id": "call_2", "type": "function", "function": {"name": "local_time", "arguments": "{}"}},
]

CASES = [
    (
        "qwen3 offers the tools in its system turn",
        "qwen3.jinja",
        {
            "messages": [{"role": "user", "content": "What is the weather like in Paris?"}],
            "tools": [WEATHER, TIME],
        },
    ),
    (
        "qwen3 writes a conversation's calls and results",
        "qwen3.jinja",
        {
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Weather in Zürich, and the time?"},
                {"role": "assistant", "content": None, "tool_calls": CALLS},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 18}'},
                {"role": "tool", "tool_call_id": "call_2", "content": "09:30"},
            ],
            "tools": [WEATHER, TIME],
        },
    ),
    (
        "qwen3 writes calls beside text without tools offered",
        "qwen3.jinja",
        {
            "messages": [
                {"role": "user", "content": "Weather in Zürich?"},
                {"role": "assistant", "content": "Let me look.", "tool_calls": CALLS[:1]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                {"role": "assistant", "content": "It is sunny."},
                {"role": "user", "content": "Thanks."},
            ],
        },
    ),
    (
        "qwen3 offers every tool with a named choice",
        "qwen3.jinja",
        {
            "messages": [{"role": "user", "content": "Time?"}],
            "tools": [WEATHER, TIME],
            "tool_choice": {"type": "function", "function": {"name": "local_time"}},
        },
    ),
    (
        "qwen3 offers no tool with tool_choice none",
        "qwen3.jinja",
        {
            "messages": [{"role": "user", "content": "Hi"}],
            "tools": [WEATHER],
            "tool_choice": "none",
            "chat_template_kwargs": {"enable_thinking": False},
        },
    ),
    (
        "llama 3.1 puts the tools in the first user message",
        "llama3.1.jinja",
        {
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "What is the weather like in Paris?"},
            ],
            "tools": [WEATHER],
        },
    ),
    (
        "llama 3.1 writes a call and its result in the ipython turn",
        "llama3.1.jinja",
        {
            "messages": [
                {"role": "user", "content": "Weather in Zürich?"},
                {"role": "assistant", "content": None, "tool_calls": CALLS[:1]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 18}'},
            ],
            "tools": [WEATHER, TIME],
            "chat_template_kwargs": {"date_string": "03 Dec 2026"},
        },
    ),
]


MISTRAL_CALLS = [
    {
        "id": "call_abc123def",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Zürich", "unit": "celsius"}'},
    },
    {"id": "call_xyz987uvw", "type": "function", "function": {"name": "local_time", "arguments": "{}"}},
]
CASES += [
    (
        "mistral v3 offers the tools before the last user turn",
        "mistral-v3.jinja",
        {
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "What is the weather like in Paris?"},
            ],
            "tools": [WEATHER, TIME],
        },
    ),
    (
        "mistral v3 writes calls and results with their ids",
        "mistral-v3.jinja",
        {
            "messages": [
                {"role": "user", "content": "Weather in Zürich, and the time?"},
                {"role": "assistant", "content": None, "tool_calls": MISTRAL_CALLS},
                {"role": "tool", "tool_call_id": "call_abc123def", "content": '{"temperature": 18}'},
                {"role": "tool", "tool_call_id": "call_xyz987uvw", "content": "09:30"},
                {"role": "assistant", "content": "18 C at 09:30."},
                {"role": "user", "content": "Thanks."},
            ],
            "tools": [WEATHER, TIME],
        },
    ),
]

CASES += [
    (
        "mistral v11 offers the tools after the system prompt",
        "mistral-v11.jinja",
        {
            "messages": [{"role": "user", "content": "What is the weather like in Paris?"}],
            "tools": [WEATHER, TIME],
        },
    ),
    (
        "mistral v11 writes text, calls and results",
        "mistral-v11.jinja",
        {
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Weather in Zürich, and the time?"},
                {"role": "assistant", "content": "Let me look.", "tool_calls": MISTRAL_CALLS},
                {"role": "tool", "tool_call_id": "call_abc123def", "content": '{"temperature": 18}'},
                {"role": "tool", "tool_call_id": "call_xyz987uvw", "content": "09:30"},
                {"role": "assistant", "content": "18 C at 09:30."},
                {"role": "user", "content": "Thanks."},
            ],
            "tools": [WEATHER, TIME],
        },
    ),
]


def main():
    env = environment()
    out = []
    for name, fixture, request in CASES:
        with open(f"tests/fixtures/{fixture}", encoding="utf-8") as f:
            template = f.read()
        out.append(
            {
                "name": name,
                "template": fixture,
                "request": request,
                "prompt": render(env, fixture, template, request),
            }
        )
    json.dump(out, sys.stdout, ensure_ascii=False, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
