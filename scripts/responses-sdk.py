"""The OpenAI Python SDK against a running Switchyard's /v1/responses: `python scripts/responses-sdk.py PORT`
(needs `openai` and `pydantic`): create, create(stream=True), stream(), parse(text_format=...), a
tool round trip, a streamed call, json_object, an incomplete answer and the refusals."""
import json, sys
from openai import OpenAI, BadRequestError
from pydantic import BaseModel

port = sys.argv[1]
client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
model = client.models.list().data[0].id

r = client.responses.create(model=model, instructions="Answer in one sentence.",
                            input="What is the capital of France?", max_output_tokens=40,
                            temperature=0, metadata={"k": "v"})
print("create:", r.id, r.status, repr(r.output_text), r.usage)
assert r.output_text and r.object == "response" and r.metadata == {"k": "v"}

# create(stream=True): the events in order, the deltas making the text.
deltas, kinds = [], []
for event in client.responses.create(model=model, input="What is the capital of France?",
                                     instructions="Answer in one sentence.",
                                     max_output_tokens=40, temperature=0, stream=True):
    kinds.append(event.type)
    if event.type == "response.output_text.delta":
        deltas.append(event.delta)
    final = event
print("create(stream=True):", kinds[:4], "...", kinds[-4:])
assert "".join(deltas) == r.output_text, ("".join(deltas), r.output_text)
assert final.type in ("response.completed", "response.incomplete")

# responses.stream(): the helper's accumulated final response.
with client.responses.stream(model=model, input="What is the capital of France?",
                             instructions="Answer in one sentence.",
                             max_output_tokens=40, temperature=0) as stream:
    text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
    done = stream.get_final_response()
print("stream():", repr(done.output_text), done.status)
assert done.output_text == text == r.output_text

# parse(text_format=...): the SDK sends a strict json_schema and parses output_parsed.
class City(BaseModel):
    city: str
    country: str

p = client.responses.parse(model=model, input="Describe Paris.", text_format=City,
                           max_output_tokens=60, temperature=0)
print("parse:", p.output_parsed, p.status)
assert isinstance(p.output_parsed, City)

# A tool round trip: a function_call item out, its output in.
tools = [{"type": "function", "name": "get_weather", "description": "Weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"], "additionalProperties": False},
          "strict": True}]
question = {"role": "user", "content": "What is the weather in Paris?"}
t = client.responses.create(model=model, input=[question], tools=tools, tool_choice="required",
                            max_output_tokens=60, temperature=0)
call = next(i for i in t.output if i.type == "function_call")
print("call:", call.name, call.arguments, call.call_id)
args = json.loads(call.arguments)
assert call.name == "get_weather" and isinstance(args["city"], str)
back = client.responses.create(model=model, tools=tools, max_output_tokens=30, temperature=0,
                               input=[question, call, {"type": "function_call_output",
                                                       "call_id": call.call_id,
                                                       "output": "sunny, 21 C"}])
print("after the result:", back.status, repr(back.output_text))

# The refusals the SDK raises.
for kwargs, param in [({"previous_response_id": "resp_x"}, "previous_response_id"),
                      ({"tools": [{"type": "web_search"}]}, "tools[0].type")]:
    try:
        client.responses.create(model=model, input="x", **kwargs)
        raise AssertionError("accepted")
    except BadRequestError as e:
        print("refused:", e.status_code, e.body.get("param"))
        assert e.body.get("param") == param
try:
    client.responses.retrieve("resp_x")
    raise AssertionError("accepted")
except BadRequestError as e:
    print("retrieve refused:", e.status_code, e.body.get("param"))
print("ALL OK")

# A streamed call through the SDK's accumulator.
with client.responses.stream(model=model, input=[question], tools=tools, tool_choice="required", parallel_tool_calls=False,
                             max_output_tokens=60, temperature=0) as stream:
    arg_deltas = "".join(e.delta for e in stream
                         if e.type == "response.function_call_arguments.delta")
    final = stream.get_final_response()
fc = next(i for i in final.output if i.type == "function_call")
print("streamed call:", fc.name, fc.arguments, final.status)
assert fc.arguments == arg_deltas and json.loads(fc.arguments)["city"]

# json_object, and an incomplete answer.
j = client.responses.create(model=model, input="Give a JSON object describing Paris.",
                            text={"format": {"type": "json_object"}}, max_output_tokens=80,
                            temperature=0)
print("json_object:", j.status, j.output_text[:80])
if j.status == "completed":
    assert isinstance(json.loads(j.output_text), dict)
inc = client.responses.create(model=model, input="Tell me a long story.", max_output_tokens=4)
print("incomplete:", inc.status, inc.incomplete_details, inc.usage.output_tokens)
assert inc.status == "incomplete" and inc.incomplete_details.reason == "max_output_tokens"
print("ALL OK 2")
