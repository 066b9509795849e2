#!/usr/bin/env python3
"""Render the bundled chat templates with Python Jinja2 to golden files for mference-text.

The Jinja2 environment is set up exactly as transformers' `_compile_jinja_template`
(transformers/utils/chat_template_utils.py): ImmutableSandboxedEnvironment(trim_blocks=True,
lstrip_blocks=True, extensions=[AssistantTracker, jinja2.ext.loopcontrols]), `tojson` overridden by
json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False), and the globals
`raise_exception` and `strftime_now`. The render call mirrors `render_jinja_template`:
render(messages=..., tools=..., documents=None, add_generation_prompt=..., **special_tokens, **kwargs),
where the special tokens are tokenizer_config.json's bos/eos/unk/pad tokens and
additional_special_tokens. One addition both sides share: llama.cpp's `from_json` filter (json.loads),
which the DeepSeek-V4 template calls for string tool arguments.

The multi-turn chats of assets/tokenizers/*/verify/chat_vectors.json are rebuilt here and checked
against the rendered text stored there, so those golden cases are tied to an upstream render.

Usage: python3 tools/golden/render_templates.py   (needs Jinja2 >= 3.1; tested with 3.1.6)
Writes crates/text/tests/golden/<family>__<template>.json.
"""

import json
import os
import sys
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
ASSETS = os.path.join(ROOT, "assets", "tokenizers")
OUT = os.path.join(ROOT, "crates", "text", "tests", "golden")

# (family folder, template path relative to it)
TEMPLATES = [
    ("gemma4", "chat_template.jinja"),
    ("gemma4", "templates/gguf-embedded-chat_template.jinja"),
    ("qwen3_6", "chat_template.jinja"),
    ("deepseek_v4", "chat_template.jinja"),
    ("deepseek_v4", "templates/deepseek-ai-DeepSeek-V4-Flash-0731.jinja"),
]
SPECIAL_KEYS = ["bos_token", "eos_token", "unk_token", "pad_token"]


class AssistantTracker(jinja2.ext.Extension):
    """transformers' `{% generation %}` tag; outside training it only renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_generation_support"), [], [], body).set_lineno(lineno)

    def _generation_support(self, caller):
        return caller()


def compile_template(source):
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[AssistantTracker, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.filters["from_json"] = json.loads
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def special_tokens(family):
    with open(os.path.join(ASSETS, family, "tokenizer_config.json"), encoding="utf-8") as f:
        config = json.load(f)
    out = {}
    for key in SPECIAL_KEYS:
        tok = config.get(key)
        if isinstance(tok, dict):
            tok = tok.get("content")
        if isinstance(tok, str):
            out[key] = tok
    extra = config.get("additional_special_tokens")
    if isinstance(extra, list):
        out["additional_special_tokens"] = [t["content"] if isinstance(t, dict) else t for t in extra]
    return out


def render(template, special, case):
    kwargs = {**special, **case["extra"]}
    return template.render(
        messages=case["messages"],
        tools=case["tools"],
        documents=None,
        add_generation_prompt=case["add_generation_prompt"],
        **kwargs,
    )


# ---------------------------------------------------------------------------------------------
# Conversations

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Temperature unit"},
                "days": {"type": "integer", "description": "Forecast days"},
            },
            "required": ["city"],
        },
    },
}

# Nested parameters: objects in objects, arrays of objects, enums, nullable, defaults with floats,
# mixed-case keys (dictsort is case-insensitive in Jinja2), non-ASCII and HTML-ish characters.
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search_flights",
        "description": "Search flights — prices in € <incl. tax> & 'fees'.",
        "parameters": {
            "type": "object",
            "properties": {
                "route": {
                    "type": "object",
                    "description": "Origin and destination",
                    "properties": {
                        "from": {"type": "string", "description": "IATA code, e.g. CDG"},
                        "to": {"type": "string", "description": "IATA code, e.g. NRT (東京)"},
                    },
                    "required": ["from", "to"],
                },
                "passengers": {
                    "type": "array",
                    "description": "Travellers",
                    "items": {
                        "type": "object",
                        "properties": {
                            "name": {"type": "string", "description": "Full name"},
                            "age": {"type": "integer", "description": "Age in years"},
                        },
                        "required": ["name"],
                    },
                },
                "Cabin": {"type": "string", "enum": ["economy", "business", "first"], "description": "Cabin class"},
                "max_price": {"type": "number", "description": "Upper bound", "nullable": True, "default": 1e-07},
                "flexible": {"type": "boolean", "description": "±3 days"},
                "tags": {"type": "array", "items": {"type": "string"}, "description": "Labels"},
            },
            "required": ["route", "passengers"],
        },
    },
}

NO_PARAMS_TOOL = {
    "type": "function",
    "function": {"name": "get_time", "description": "Current UTC time.", "parameters": {"type": "object", "properties": {}}},
}

SYSTEM = {"role": "system", "content": "You are a helpful assistant. Answer briefly."}
USER_WEATHER = {"role": "user", "content": "What's the weather in Paris? Réponds en français aussi. 天气怎么样？"}
TOOL_RESULT = {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 18, "condition": "cloudy"}'}
FINAL = {"role": "assistant", "content": "It is 18 °C and cloudy in Paris. Il fait 18 °C et nuageux."}
FOLLOW_UP = {"role": "user", "content": "Thanks! And tomorrow?"}


def weather_call(reasoning=None):
    msg = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": 2}},
            }
        ],
    }
    if reasoning is not None:
        msg["reasoning_content"] = reasoning
    return msg


def case(name, messages, tools=None, add_generation_prompt=True, extra=None, expect=None):
    return {
        "name": name,
        "messages": messages,
        "tools": tools,
        "add_generation_prompt": add_generation_prompt,
        "extra": extra or {},
        # (family, chat) of verify/chat_vectors.json that this render must equal
        "chat_vector": expect,
    }


def common_cases():
    flights_call = {
        "role": "assistant",
        "content": "Let me search.",
        "tool_calls": [
            {
                "id": "call_a",
                "type": "function",
                "function": {
                    "name": "search_flights",
                    "arguments": {
                        "route": {"from": "CDG", "to": "NRT"},
                        "passengers": [{"name": "Zoë \"Z\" O'Neil", "age": 34}, {"name": "李雷", "age": None}],
                        "Cabin": "business",
                        "max_price": 1250.5,
                        "flexible": True,
                        "tags": [],
                    },
                },
            },
            {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": {}}},
        ],
    }
    flights_results = [
        {"role": "tool", "tool_call_id": "call_a", "content": "[{\"flight\": \"AF276\", \"price\": 1180}]"},
        {"role": "tool", "tool_call_id": "call_b", "content": "2026-11-30T08:00:00Z"},
    ]
    multi_turn = [
        {"role": "user", "content": "Hi! What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "  And times 3?  "},
        {"role": "assistant", "content": "12 — easy. 🎉"},
        {"role": "user", "content": "Danke schön. Ça va? 👍🏽"},
    ]
    return [
        case("system_user", [SYSTEM, {"role": "user", "content": "Hello there."}]),
        case("system_user_no_generation_prompt", [SYSTEM, {"role": "user", "content": "Hello there."}], add_generation_prompt=False),
        case("user_only", [{"role": "user", "content": "Hello there."}]),
        case("multi_turn", multi_turn),
        case("multi_turn_no_generation_prompt", multi_turn[:4], add_generation_prompt=False),
        case("multi_turn_thinking", [SYSTEM] + multi_turn, extra={"enable_thinking": True}),
        case("multi_turn_no_thinking", [SYSTEM] + multi_turn, extra={"enable_thinking": False}),
        case("tools_declared", [SYSTEM, {"role": "user", "content": "Find me a flight."}], tools=[WEATHER_TOOL, SEARCH_TOOL, NO_PARAMS_TOOL]),
        case("tools_no_system", [{"role": "user", "content": "Find me a flight."}], tools=[SEARCH_TOOL]),
        case(
            "tool_calls_and_results",
            [SYSTEM, {"role": "user", "content": "Flights CDG→NRT for two, and the time?"}, flights_call] + flights_results,
            tools=[SEARCH_TOOL, NO_PARAMS_TOOL],
        ),
        case(
            "tool_calls_and_results_then_answer",
            [SYSTEM, {"role": "user", "content": "Flights CDG→NRT for two, and the time?"}, flights_call]
            + flights_results
            + [{"role": "assistant", "content": "AF276 at 1180 €."}, {"role": "user", "content": "Book it."}],
            tools=[SEARCH_TOOL, NO_PARAMS_TOOL],
            extra={"enable_thinking": False},
        ),
        case(
            "tool_call_only_no_generation_prompt",
            [{"role": "user", "content": "Weather?"}, weather_call()],
            tools=[WEATHER_TOOL],
            add_generation_prompt=False,
        ),
        case("reasoning_content_history", [SYSTEM, USER_WEATHER, weather_call("Need the tool."), TOOL_RESULT,
                                           {"role": "assistant", "content": "Cloudy, 18 °C.", "reasoning_content": "Summarize."}],
             tools=[WEATHER_TOOL], add_generation_prompt=False, extra={"enable_thinking": True}),
        case("content_parts", [{"role": "user", "content": [{"type": "text", "text": "Part one. "}, {"type": "text", "text": "Part two."}]}]),
        case("special_characters", [{"role": "user", "content": "Tabs\tand\nnewlines\r\n, quotes \" ' and braces {{ }} {% %} <b>&amp;</b> \\ backslash"}]),
    ]


def chat_vector_cases(family):
    base = [SYSTEM, USER_WEATHER, weather_call(), TOOL_RESULT, FINAL, FOLLOW_UP]
    thinking = [SYSTEM, USER_WEATHER, weather_call("The user wants the weather in Paris; call the tool."), TOOL_RESULT, FINAL, FOLLOW_UP]
    if family == "gemma4":
        return [
            case("chat_vector_tools", base, tools=[WEATHER_TOOL], expect="tools"),
            case("chat_vector_tools_thinking", thinking, tools=[WEATHER_TOOL], extra={"enable_thinking": True}, expect="tools_thinking"),
        ]
    if family == "qwen3_6":
        reasoning = [
            SYSTEM,
            USER_WEATHER,
            weather_call("The user wants the weather in Paris; call the tool."),
            TOOL_RESULT,
            {"role": "assistant", "content": "18 °C, cloudy.", "reasoning_content": "Tool said 18 and cloudy."},
        ]
        return [
            case("chat_vector_tools", base, tools=[WEATHER_TOOL], expect="tools"),
            case("chat_vector_tools_reasoning", reasoning, tools=[WEATHER_TOOL], add_generation_prompt=False, expect="tools_reasoning"),
        ]
    if family == "deepseek_v4":
        return [
            case("chat_vector_tools", base, tools=[WEATHER_TOOL], expect="tools"),
            case("chat_vector_tools_thinking", thinking, tools=[WEATHER_TOOL], extra={"thinking": True}, expect="tools_thinking"),
        ]
    raise ValueError(family)


def family_cases(family):
    cases = common_cases() + chat_vector_cases(family)
    string_args = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}],
    }
    if family == "qwen3_6":
        cases += [
            case("error_system_not_first", [{"role": "user", "content": "Hi"}, SYSTEM]),
            case("error_no_user_query", [SYSTEM]),
            case("multi_step_tool_last_query", [USER_WEATHER, weather_call("r1"), TOOL_RESULT, weather_call("r2"), TOOL_RESULT], tools=[WEATHER_TOOL]),
        ]
    if family == "deepseek_v4":
        cases += [
            case("string_arguments_from_json", [USER_WEATHER, string_args, TOOL_RESULT], tools=[WEATHER_TOOL]),
            case("reasoning_effort_max", [SYSTEM, USER_WEATHER], extra={"thinking": True, "reasoning_effort": "max"}),
            case("developer_and_drop_thinking", [{"role": "developer", "content": "Be terse."}, USER_WEATHER,
                                                 {"role": "assistant", "content": "OK", "reasoning_content": "hm"}, FOLLOW_UP],
                 extra={"thinking": True, "drop_thinking": False}),
        ]
    if family == "gemma4":
        cases += [
            case("developer_role", [{"role": "developer", "content": "  Be terse.  "}, {"role": "user", "content": "Hi"}]),
            case("string_arguments", [USER_WEATHER, string_args, TOOL_RESULT], tools=[WEATHER_TOOL]),
            case("assistant_thinking_stripped", [{"role": "user", "content": "Hi"},
                                                 {"role": "assistant", "content": "<|channel>thought\nsecret<channel|>Hello!"},
                                                 {"role": "user", "content": "Bye"}]),
        ]
    return cases


def main():
    os.makedirs(OUT, exist_ok=True)
    written = 0
    for family, rel in TEMPLATES:
        with open(os.path.join(ASSETS, family, rel), encoding="utf-8") as f:
            source = f.read()
        template = compile_template(source)
        special = special_tokens(family)
        with open(os.path.join(ASSETS, family, "verify", "chat_vectors.json"), encoding="utf-8") as f:
            vectors = json.load(f)
        results = []
        for c in family_cases(family):
            out = dict(c)
            try:
                out["rendered"] = render(template, special, c)
                out["error"] = None
            except Exception as e:  # noqa: BLE001 - any template failure is a golden "error" case
                out["rendered"] = None
                out["error"] = str(e)
                print(f"  {family}/{rel} {c['name']}: {type(e).__name__}: {e}")
            if c["chat_vector"] is not None and rel == "chat_template.jinja":
                want = vectors[c["chat_vector"]]["text"]
                if out["rendered"] != want:
                    sys.exit(f"{family}/{rel} {c['name']}: render differs from chat_vectors.json[{c['chat_vector']}]")
            results.append(out)
        name = f"{family}__{os.path.splitext(os.path.basename(rel))[0]}.json"
        doc = {
            "generator": "tools/golden/render_templates.py",
            "jinja2": jinja2.__version__,
            "family": family,
            "template": rel,
            "special_tokens": special,
            "cases": results,
        }
        with open(os.path.join(OUT, name), "w", encoding="utf-8") as f:
            json.dump(doc, f, ensure_ascii=False, indent=1)
            f.write("\n")
        written += len(results)
        print(f"{name}: {len(results)} cases ({sum(r['error'] is not None for r in results)} errors)")
    print(f"{written} renders written to {os.path.relpath(OUT, ROOT)}")


if __name__ == "__main__":
    main()
