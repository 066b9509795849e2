"""The real `openai` Python client against a running mference server (driven by openai_client.rs).

Environment: MFERENCE_BASE_URL (http://127.0.0.1:PORT), MFERENCE_MODEL (the served id). The server
must force a get_weather(city="London", days=3) call when tools are declared (the test's
ToolCaller wrapper; the demo model never writes tool calls on its own), have queue limit 1, and
generate slowly enough that six simultaneous requests overflow the queue.

Exits non-zero with the failing assertion; prints one JSON summary line on success.
"""

import json
import os
import sys
import threading

import openai
from openai import OpenAI

BASE = os.environ["MFERENCE_BASE_URL"]
MODEL = os.environ["MFERENCE_MODEL"]
client = OpenAI(base_url=BASE + "/v1", api_key="not-needed", max_retries=0, timeout=120)
summary = {}


def expect_error(cls, status, **kwargs):
    try:
        client.chat.completions.create(**kwargs)
    except cls as e:
        assert e.status_code == status, (e.status_code, e)
        assert isinstance(e.body, dict) and e.body.get("message"), e.body
        return e
    raise AssertionError(f"expected {cls.__name__} for {kwargs}")


# Models.
ids = [m.id for m in client.models.list()]
assert ids == [MODEL], ids

# Chat, non-streaming.
user = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me about the sea."}]
r = client.chat.completions.create(model=MODEL, messages=user, temperature=0, max_tokens=16)
msg = r.choices[0].message
assert msg.role == "assistant" and isinstance(msg.content, str) and msg.content, r
assert r.choices[0].finish_reason in ("stop", "length"), r
assert r.usage.completion_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
summary["chat"] = msg.content

# The same request streamed, with usage: the same text; the KV prefix of the first is reused.
stream = client.chat.completions.create(
    model=MODEL, messages=user, temperature=0, max_tokens=16, stream=True, stream_options={"include_usage": True}
)
parts, usage, finish = [], None, None
for chunk in stream:
    if chunk.choices:
        if chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        finish = chunk.choices[0].finish_reason or finish
    if chunk.usage:
        usage = chunk.usage
assert "".join(parts) == msg.content, (parts, msg.content)
assert finish == r.choices[0].finish_reason
assert usage is not None and usage.completion_tokens == r.usage.completion_tokens, usage
assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1, usage
summary["stream_chunks"] = len(parts)

# Logprobs.
r = client.chat.completions.create(model=MODEL, messages=user, temperature=0, max_tokens=5, logprobs=True, top_logprobs=3)
lps = r.choices[0].logprobs.content
assert len(lps) == r.usage.completion_tokens, (len(lps), r.usage)
for t in lps:
    assert t.logprob <= 0 and len(t.top_logprobs) == 3
    tops = [x.logprob for x in t.top_logprobs]
    assert tops == sorted(tops, reverse=True)
    # Greedy: the chosen token is the most likely one.
    assert abs(t.logprob - tops[0]) < 1e-6, (t.logprob, tops)
assert "".join(t.token for t in lps) == r.choices[0].message.content

# Tool call round trip.
tools = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                       "required": ["city"]},
    },
}]
conv = [{"role": "user", "content": "What is the weather in London?"}]
r = client.chat.completions.create(model=MODEL, messages=conv, tools=tools, max_tokens=64)
assert r.choices[0].finish_reason == "tool_calls", r
calls = r.choices[0].message.tool_calls
assert len(calls) == 1 and calls[0].type == "function" and calls[0].function.name == "get_weather", calls
assert json.loads(calls[0].function.arguments) == {"city": "London", "days": 3}
conv.append(r.choices[0].message.model_dump(exclude_none=True))
conv.append({"role": "tool", "tool_call_id": calls[0].id, "content": json.dumps({"temperature_c": 14, "sky": "rain"})})
r2 = client.chat.completions.create(model=MODEL, messages=conv, tools=tools, max_tokens=16, temperature=0)
assert r2.choices[0].finish_reason in ("stop", "length"), r2
assert isinstance(r2.choices[0].message.content, str)
summary["after_tool"] = r2.choices[0].message.content
# A tool result for a call that was never made.
bad = conv[:-1] + [{"role": "tool", "tool_call_id": "call_nope", "content": "x"}]
expect_error(openai.BadRequestError, 400, model=MODEL, messages=bad, tools=tools)

# Streamed tool call.
stream = client.chat.completions.create(model=MODEL, messages=conv[:1], tools=tools, max_tokens=64, stream=True)
names, args, finish, text = [], "", None, ""
for chunk in stream:
    d = chunk.choices[0].delta
    text += d.content or ""
    for tc in d.tool_calls or []:
        if tc.function.name:
            names.append(tc.function.name)
        args += tc.function.arguments or ""
    finish = chunk.choices[0].finish_reason or finish
assert names == ["get_weather"] and json.loads(args) == {"city": "London", "days": 3}, (names, args)
assert finish == "tool_calls" and "<|tool_call>" not in text

# Legacy completions with logprobs.
c = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0, logprobs=2)
assert c.object == "text_completion" and c.choices[0].text, c
assert len(c.choices[0].logprobs.tokens) == c.usage.completion_tokens
assert "".join(c.choices[0].logprobs.tokens) == c.choices[0].text
summary["completion"] = c.choices[0].text

# Error statuses.
e = expect_error(openai.NotFoundError, 404, model="gpt-4o", messages=user)
assert e.code == "model_not_found", e.code
expect_error(openai.BadRequestError, 400, model=MODEL, messages=user, n=2)
expect_error(openai.BadRequestError, 400, model=MODEL, messages=user, presence_penalty=1.0)
expect_error(openai.BadRequestError, 400, model=MODEL, messages=user, tools=tools, tool_choice="required")
expect_error(openai.BadRequestError, 400, model=MODEL, messages=[{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])
e = expect_error(openai.BadRequestError, 400, model=MODEL,
                 messages=[{"role": "user", "content": "the quick brown fox " * 2000}])
assert e.code == "context_length_exceeded", e.code

# 429: six simultaneous requests against queue limit 1.
statuses = []
lock = threading.Lock()


def one():
    try:
        client.chat.completions.create(model=MODEL, messages=user, max_tokens=30)
        s = 200
    except openai.RateLimitError as e:
        s = e.status_code
    with lock:
        statuses.append(s)


threads = [threading.Thread(target=one) for _ in range(6)]
for t in threads:
    t.start()
for t in threads:
    t.join()
assert set(statuses) <= {200, 429} and statuses.count(429) >= 1 and statuses.count(200) >= 1, statuses
summary["burst"] = sorted(statuses)

print(json.dumps(summary))
sys.exit(0)
