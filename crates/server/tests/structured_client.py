"""The official `openai` client's structured-output helpers against a running mference server
(driven by structured.rs): `client.beta.chat.completions.parse` and `client.chat.completions.parse`
with a Pydantic model, the streaming helper, JSON mode, the `length` cut-off and a refused schema.
Pydantic validates every parsed reply independently of the server.

Environment: MFERENCE_BASE_URL (http://127.0.0.1:PORT), MFERENCE_MODEL (the served id).
Exits non-zero with the failing assertion; prints one JSON summary line on success.
"""

import json
import os
import sys
from typing import Annotated, Literal

import openai
from openai import OpenAI
from pydantic import BaseModel, Field

BASE = os.environ["MFERENCE_BASE_URL"]
MODEL = os.environ["MFERENCE_MODEL"]
client = OpenAI(base_url=BASE + "/v1", api_key="not-needed", max_retries=0, timeout=300)
summary = {}


class Person(BaseModel):
    # Bounded strings, numbers and lists: the bundled tiny models write weak text, and bounds let
    # every reply complete inside the budget.
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=150)
    member: bool
    role: Literal["reader", "writer", "editor"]
    tags: list[Annotated[str, Field(max_length=8)]] = Field(max_length=3)


messages = [{"role": "user", "content": "Describe Elizabeth Bennet."}]


def check_parsed(r, what):
    choice = r.choices[0]
    assert choice.finish_reason == "stop", (what, r)
    person = choice.message.parsed
    assert isinstance(person, Person), (what, r)
    # Independent of the helper: the raw content validates on its own.
    assert Person.model_validate_json(choice.message.content) == person, (what, choice.message.content)
    summary[what] = choice.message.content
    return person


# The beta helper (openai 1.x), and the same one under chat.completions (newer clients).
greedy = client.beta.chat.completions.parse(
    model=MODEL, messages=messages, response_format=Person, temperature=0, max_tokens=200
)
check_parsed(greedy, "beta_parse")
again = client.chat.completions.parse(
    model=MODEL, messages=messages, response_format=Person, temperature=0, max_tokens=200
)
check_parsed(again, "parse")
assert again.choices[0].message.content == greedy.choices[0].message.content, "greedy replies differ"
sampled = client.chat.completions.parse(
    model=MODEL, messages=messages, response_format=Person, temperature=1.0, seed=3, max_tokens=200
)
check_parsed(sampled, "parse_sampled")

# The streaming helper: deltas, then the parsed final completion.
with client.beta.chat.completions.stream(
    model=MODEL, messages=messages, response_format=Person, temperature=0, max_tokens=200
) as stream:
    deltas = [e.delta for e in stream if e.type == "content.delta"]
    final = stream.get_final_completion()
check_parsed(final, "stream")
assert "".join(deltas) == greedy.choices[0].message.content, deltas

# JSON mode.
r = client.chat.completions.create(
    model=MODEL, messages=messages, response_format={"type": "json_object"}, temperature=0, max_tokens=200
)
# JSON mode bounds nothing: a weak model may fill a string until the budget ends (`length`).
content = r.choices[0].message.content
if r.choices[0].finish_reason == "stop":
    assert isinstance(json.loads(content), dict), r
else:
    assert r.choices[0].finish_reason == "length" and content.startswith("{"), r
summary["json_object"] = [r.choices[0].finish_reason, content[:80]]

# A budget too small: `length`, which the helper reports as LengthFinishReasonError.
try:
    client.chat.completions.parse(model=MODEL, messages=messages, response_format=Person, max_tokens=3)
    raise AssertionError("a 3-token reply was parsed")
except openai.LengthFinishReasonError as e:
    summary["length"] = e.completion.choices[0].message.content

# A schema llguidance cannot compile: 400 on `response_format`.
try:
    client.chat.completions.create(
        model=MODEL,
        messages=messages,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "bad", "schema": {"$ref": "#/$defs/missing"}, "strict": True},
        },
    )
    raise AssertionError("an uncompilable schema was accepted")
except openai.BadRequestError as e:
    assert e.status_code == 400 and e.body.get("param") == "response_format", e.body
    summary["refused"] = e.body["message"]

print(json.dumps(summary))
sys.exit(0)
