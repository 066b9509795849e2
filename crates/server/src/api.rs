//! Request parsing and validation (the original Mference's rules, github.com/NeelM0906/Mference): every check that can fail
//! runs here, before the request is queued and before any byte of the response is written.

use serde_json::{Map, Value};

use crate::error::ApiError;
use mference_session::ResponseFormat;
use mference_text::Family;

/// Sampling and stopping options shared by both endpoints.
#[derive(Debug, Clone)]
pub(crate) struct Sampling {
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: usize,
    pub repetition_penalty: f32,
    pub seed: Option<u64>,
    pub stop: Vec<String>,
    /// New-token budget (`max_tokens` / `max_completion_tokens`, default 4096 as the original).
    pub max_tokens: usize,
}

/// The options every generation request carries.
#[derive(Debug, Clone)]
pub(crate) struct Common {
    pub stream: bool,
    pub include_usage: bool,
    pub sampling: Sampling,
    /// `Some(n)`: return the chosen token's log-probability and the `n` most likely alternatives.
    pub logprobs: Option<usize>,
    /// `response_format` other than text: the reply is constrained to it.
    pub response_format: Option<ResponseFormat>,
}

/// A validated `/v1/chat/completions` body.
#[derive(Debug)]
pub(crate) struct ChatRequest {
    pub common: Common,
    /// Messages ready for the chat template (roles merged, arguments as JSON objects).
    pub messages: Vec<Value>,
    /// Tools to render, `None` when there are none or `tool_choice` is `none`.
    pub tools: Option<Vec<Value>>,
    /// Extra chat-template variables: `chat_template_kwargs` and `reasoning_effort`.
    pub template_kwargs: Map<String, Value>,
}

/// The prompt of a `/v1/completions` body.
#[derive(Debug)]
pub(crate) enum CompletionPrompt {
    Text(String),
    Tokens(Vec<u32>),
}

/// A validated `/v1/completions` body.
#[derive(Debug)]
pub(crate) struct CompletionRequest {
    pub common: Common,
    pub prompt: CompletionPrompt,
}

/// The default `max_tokens` when neither `max_tokens` nor `max_completion_tokens` is set.
const DEFAULT_MAX_TOKENS: usize = 4096;

fn obj(body: &Value) -> Result<&Map<String, Value>, ApiError> {
    body.as_object()
        .ok_or_else(|| ApiError::invalid("the request body must be a JSON object"))
}

/// A field that is present and not `null`.
fn field<'a>(o: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    o.get(key).filter(|v| !v.is_null())
}

fn number(o: &Map<String, Value>, key: &str) -> Result<Option<f64>, ApiError> {
    match field(o, key) {
        None => Ok(None),
        Some(v) => v
            .as_f64()
            .filter(|x| x.is_finite())
            .map(Some)
            .ok_or_else(|| ApiError::param(key, format!("`{key}` must be a number"))),
    }
}

fn integer(o: &Map<String, Value>, key: &str) -> Result<Option<i64>, ApiError> {
    match field(o, key) {
        None => Ok(None),
        Some(v) => v
            .as_i64()
            .map(Some)
            .ok_or_else(|| ApiError::param(key, format!("`{key}` must be an integer"))),
    }
}

/// `seed`: any integer from 0 to 2^64 - 1 (the sampler's seed is a `u64`); a negative or larger
/// number, a fraction or a string is refused with the range.
fn seed(o: &Map<String, Value>) -> Result<Option<u64>, ApiError> {
    match field(o, "seed") {
        None => Ok(None),
        Some(v) => v.as_u64().map(Some).ok_or_else(|| {
            ApiError::param(
                "seed",
                format!("`seed` must be an integer from 0 to {}, got {v}", u64::MAX),
            )
        }),
    }
}

fn boolean(o: &Map<String, Value>, key: &str) -> Result<Option<bool>, ApiError> {
    match field(o, key) {
        None => Ok(None),
        Some(v) => v
            .as_bool()
            .map(Some)
            .ok_or_else(|| ApiError::param(key, format!("`{key}` must be true or false"))),
    }
}

/// Checks `model` against the served id: missing → 400, another id → 404.
fn check_model(o: &Map<String, Value>, model_id: &str) -> Result<(), ApiError> {
    let m = field(o, "model")
        .ok_or_else(|| ApiError::param("model", "`model` is required"))?
        .as_str()
        .ok_or_else(|| ApiError::param("model", "`model` must be a string"))?;
    if m != model_id {
        let mut e = ApiError::new(
            axum::http::StatusCode::NOT_FOUND,
            format!(
                "the model `{m}` does not exist; this server serves `{model_id}` (GET /v1/models)"
            ),
        )
        .with_code("model_not_found");
        e.param = Some("model".into());
        return Err(e);
    }
    Ok(())
}

/// Options both endpoints share; `logprobs` is parsed by the caller (its type differs).
fn common(o: &Map<String, Value>, logprobs: Option<usize>) -> Result<Common, ApiError> {
    let stream = boolean(o, "stream")?.unwrap_or(false);
    let mut include_usage = false;
    if let Some(so) = field(o, "stream_options") {
        if !stream {
            return Err(ApiError::param(
                "stream_options",
                "`stream_options` is only allowed with `stream: true`",
            ));
        }
        let so = so.as_object().ok_or_else(|| {
            ApiError::param("stream_options", "`stream_options` must be an object")
        })?;
        include_usage = boolean(so, "include_usage")?.unwrap_or(false);
    }
    if let Some(n) = integer(o, "n")? {
        if n != 1 {
            return Err(ApiError::param(
                "n",
                format!("`n` must be 1 (one choice per request), got {n}"),
            ));
        }
    }
    for key in ["presence_penalty", "frequency_penalty"] {
        if let Some(p) = number(o, key)? {
            if p != 0.0 {
                return Err(ApiError::param(
                    key,
                    format!("`{key}` is not supported (must be 0); use `repetition_penalty`"),
                ));
            }
        }
    }
    if let Some(lb) = field(o, "logit_bias") {
        if lb.as_object().is_none_or(|m| !m.is_empty()) {
            return Err(ApiError::param(
                "logit_bias",
                "`logit_bias` is not supported",
            ));
        }
    }
    let temperature = number(o, "temperature")?.unwrap_or(0.2);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::param(
            "temperature",
            format!("`temperature` must be between 0 and 2, got {temperature}"),
        ));
    }
    let top_p = number(o, "top_p")?.unwrap_or(0.95);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::param(
            "top_p",
            format!("`top_p` must be in (0, 1], got {top_p}"),
        ));
    }
    // 0 turns top-k off, as `mference run --top-k 0` does.
    let top_k = integer(o, "top_k")?.unwrap_or(64);
    if !(0..=256).contains(&top_k) {
        return Err(ApiError::param(
            "top_k",
            format!("`top_k` must be between 0 and 256 (0 = off), got {top_k}"),
        ));
    }
    let repetition_penalty = number(o, "repetition_penalty")?.unwrap_or(1.0);
    if repetition_penalty <= 0.0 {
        return Err(ApiError::param(
            "repetition_penalty",
            format!("`repetition_penalty` must be > 0, got {repetition_penalty}"),
        ));
    }
    let seed = seed(o)?;
    let stop = match field(o, "stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => {
            let v: Option<Vec<String>> = a.iter().map(|s| s.as_str().map(str::to_string)).collect();
            let v = v.ok_or_else(|| {
                ApiError::param("stop", "`stop` must be a string or a list of strings")
            })?;
            if v.len() > 16 {
                return Err(ApiError::param("stop", "`stop` allows at most 16 strings"));
            }
            v
        }
        Some(_) => {
            return Err(ApiError::param(
                "stop",
                "`stop` must be a string or a list of strings",
            ))
        }
    };
    let max_tokens = match (
        integer(o, "max_completion_tokens")?,
        integer(o, "max_tokens")?,
    ) {
        (Some(n), _) | (None, Some(n)) if n >= 1 => n as usize,
        (None, None) => DEFAULT_MAX_TOKENS,
        (Some(n), _) | (None, Some(n)) => {
            return Err(ApiError::param(
                "max_tokens",
                format!("`max_tokens` must be at least 1, got {n}"),
            ))
        }
    };
    let response_format = response_format(o)?;
    if response_format.is_some() && !stop.iter().all(String::is_empty) {
        // A stop string can match inside the JSON and end the reply with `stop` on text that
        // does not parse; the grammar already ends the reply when the JSON is complete.
        return Err(ApiError::param(
            "stop",
            "`stop` cannot be combined with `response_format`: a stop string could cut the JSON; \
             the reply already ends when the JSON is complete",
        ));
    }
    Ok(Common {
        stream,
        include_usage,
        response_format,
        sampling: Sampling {
            temperature: temperature as f32,
            top_p: top_p as f32,
            top_k: top_k as usize,
            repetition_penalty: repetition_penalty as f32,
            seed,
            stop,
            max_tokens,
        },
        logprobs,
    })
}

/// `response_format` (OpenAI's structured outputs): `text` (or absent) → `None`; `json_object`;
/// `json_schema` with a `json_schema` object holding `name` (1-64 letters, digits, `_`, `-`),
/// an object `schema` and an optional boolean `strict`. Whether the schema compiles is checked
/// later, when it is compiled for the tokenizer.
fn response_format(o: &Map<String, Value>) -> Result<Option<ResponseFormat>, ApiError> {
    const P: &str = "response_format";
    let Some(rf) = field(o, P) else {
        return Ok(None);
    };
    let rf = rf
        .as_object()
        .ok_or_else(|| ApiError::param(P, "`response_format` must be an object"))?;
    match rf.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(ResponseFormat::JsonObject)),
        Some("json_schema") => {
            let js = field(rf, "json_schema")
                .and_then(Value::as_object)
                .ok_or_else(|| {
                    ApiError::param(
                        P,
                        "`response_format.json_schema` must be an object with `name` and `schema`",
                    )
                })?;
            let name = js.get("name").and_then(Value::as_str).unwrap_or("");
            if name.is_empty()
                || name.len() > 64
                || !name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
            {
                return Err(ApiError::param(
                    P,
                    "`response_format.json_schema.name` must be 1-64 letters, digits, `_` or `-`",
                ));
            }
            let schema = field(js, "schema")
                .filter(|v| v.is_object())
                .ok_or_else(|| {
                    ApiError::param(
                        P,
                        "`response_format.json_schema.schema` must be a JSON Schema object",
                    )
                })?;
            let strict = boolean(js, "strict")
                .map_err(|_| {
                    ApiError::param(
                        P,
                        "`response_format.json_schema.strict` must be true or false",
                    )
                })?
                .unwrap_or(false);
            Ok(Some(ResponseFormat::JsonSchema {
                schema: schema.clone(),
                strict,
            }))
        }
        other => Err(ApiError::param(
            P,
            format!(
                "`response_format.type` must be text, json_object or json_schema, got {}",
                other.map_or("(missing)".to_string(), |t| format!("`{t}`"))
            ),
        )),
    }
}

/// Parses and validates a chat completion body for `family`'s template.
pub(crate) fn parse_chat(
    body: &Value,
    model_id: &str,
    family: Family,
) -> Result<ChatRequest, ApiError> {
    let o = obj(body)?;
    check_model(o, model_id)?;
    let logprobs = match (boolean(o, "logprobs")?, integer(o, "top_logprobs")?) {
        (Some(true), top) => {
            let top = top.unwrap_or(0);
            if !(0..=20).contains(&top) {
                return Err(ApiError::param(
                    "top_logprobs",
                    format!("`top_logprobs` must be between 0 and 20, got {top}"),
                ));
            }
            Some(top as usize)
        }
        (_, Some(_)) => {
            return Err(ApiError::param(
                "top_logprobs",
                "`top_logprobs` requires `logprobs: true`",
            ))
        }
        _ => None,
    };
    let common = common(o, logprobs)?;
    for legacy in ["functions", "function_call"] {
        if field(o, legacy).is_some() {
            return Err(ApiError::param(
                legacy,
                format!("`{legacy}` (the legacy function-calling API) is not supported; send `tools` (and `tool_choice`)"),
            ));
        }
    }
    if boolean(o, "parallel_tool_calls")? == Some(false) {
        return Err(ApiError::param(
            "parallel_tool_calls",
            "`parallel_tool_calls: false` is not supported",
        ));
    }
    let tools = parse_tools(o)?;
    let choice_none = match field(o, "tool_choice") {
        None => false,
        Some(Value::String(s)) if s == "auto" => false,
        Some(Value::String(s)) if s == "none" => true,
        Some(_) => {
            return Err(ApiError::param(
                "tool_choice",
                "`tool_choice` must be \"auto\" or \"none\" (required and named tools are not supported)",
            ))
        }
    };
    let messages = field(o, "messages")
        .ok_or_else(|| ApiError::param("messages", "`messages` is required"))?
        .as_array()
        .ok_or_else(|| ApiError::param("messages", "`messages` must be an array"))?;
    let messages = mference_session::normalize_messages(messages, family)
        .map_err(|e| ApiError::param(e.param, e.message))?;
    Ok(ChatRequest {
        common,
        messages,
        tools: if choice_none { None } else { tools },
        template_kwargs: template_kwargs(o)?,
    })
}

/// `chat_template_kwargs` (an object: any keys, passed to the chat template as vLLM and
/// llama-server pass them, e.g. `enable_thinking`) and `reasoning_effort` (a string, passed as
/// the template variable of that name). Whether the template reads them is checked when it is
/// rendered.
fn template_kwargs(o: &Map<String, Value>) -> Result<Map<String, Value>, ApiError> {
    const KW: &str = "chat_template_kwargs";
    let mut kwargs = match field(o, KW) {
        None => Map::new(),
        Some(Value::Object(m)) => m.clone(),
        Some(_) => {
            return Err(ApiError::param(
                KW,
                "`chat_template_kwargs` must be an object of template variables, e.g. {\"enable_thinking\": true}",
            ))
        }
    };
    // The thinking switches are booleans: a template tests them for truth, so the string
    // "false" would turn thinking on.
    for switch in ["enable_thinking", "thinking"] {
        if let Some(v) = kwargs
            .get(switch)
            .filter(|v| !v.is_boolean() && !v.is_null())
        {
            return Err(ApiError::param(
                KW,
                format!("`chat_template_kwargs.{switch}` must be true or false, got {v}"),
            ));
        }
    }
    if let Some(effort) = field(o, "reasoning_effort") {
        let effort = effort.as_str().ok_or_else(|| {
            ApiError::param("reasoning_effort", "`reasoning_effort` must be a string")
        })?;
        if kwargs.contains_key("reasoning_effort") {
            return Err(ApiError::param(
                "reasoning_effort",
                "`reasoning_effort` is given both at the top level and in `chat_template_kwargs`; give it once",
            ));
        }
        kwargs.insert("reasoning_effort".into(), effort.into());
    }
    Ok(kwargs)
}

/// `tools`: function tools only, each with a name.
fn parse_tools(o: &Map<String, Value>) -> Result<Option<Vec<Value>>, ApiError> {
    let Some(t) = field(o, "tools") else {
        return Ok(None);
    };
    let list = t
        .as_array()
        .ok_or_else(|| ApiError::param("tools", "`tools` must be an array"))?;
    for (i, tool) in list.iter().enumerate() {
        let p = format!("tools[{i}]");
        if tool.get("type").and_then(Value::as_str) != Some("function") {
            return Err(ApiError::param(
                p,
                "only function tools are supported (`\"type\": \"function\"`)",
            ));
        }
        let f = tool
            .get("function")
            .and_then(Value::as_object)
            .ok_or_else(|| ApiError::param(&p, "a function tool needs a `function` object"))?;
        if f.get("name")
            .and_then(Value::as_str)
            .is_none_or(str::is_empty)
        {
            return Err(ApiError::param(
                format!("{p}.function.name"),
                "a function tool needs a non-empty `name`",
            ));
        }
        if let Some(params) = f.get("parameters").filter(|v| !v.is_null()) {
            if !params.is_object() {
                return Err(ApiError::param(
                    format!("{p}.function.parameters"),
                    "`parameters` must be a JSON-schema object",
                ));
            }
        }
    }
    Ok((!list.is_empty()).then(|| list.clone()))
}

/// Parses and validates a legacy completion body.
pub(crate) fn parse_completion(
    body: &Value,
    model_id: &str,
) -> Result<CompletionRequest, ApiError> {
    let o = obj(body)?;
    check_model(o, model_id)?;
    let logprobs = match integer(o, "logprobs")? {
        None => None,
        Some(n) if (0..=5).contains(&n) => Some(n as usize),
        Some(n) => {
            return Err(ApiError::param(
                "logprobs",
                format!("`logprobs` must be between 0 and 5, got {n}"),
            ))
        }
    };
    let common = common(o, logprobs)?;
    if boolean(o, "echo")? == Some(true) {
        return Err(ApiError::param("echo", "`echo: true` is not supported"));
    }
    if field(o, "suffix").is_some() {
        return Err(ApiError::param("suffix", "`suffix` is not supported"));
    }
    if let Some(b) = integer(o, "best_of")? {
        if b != 1 {
            return Err(ApiError::param("best_of", "`best_of` must be 1"));
        }
    }
    let bad = || {
        ApiError::param(
            "prompt",
            "`prompt` must be a non-empty string, a list of one string, or a list of token ids",
        )
    };
    let prompt = match field(o, "prompt")
        .ok_or_else(|| ApiError::param("prompt", "`prompt` is required"))?
    {
        Value::String(s) if !s.is_empty() => CompletionPrompt::Text(s.clone()),
        Value::Array(a) if a.len() == 1 && a[0].is_string() => {
            let s = a[0].as_str().unwrap_or_default();
            if s.is_empty() {
                return Err(bad());
            }
            CompletionPrompt::Text(s.to_string())
        }
        Value::Array(a) if !a.is_empty() && a.iter().all(Value::is_u64) => {
            CompletionPrompt::Tokens(
                a.iter()
                    .map(|v| {
                        v.as_u64()
                            .and_then(|x| u32::try_from(x).ok())
                            .ok_or_else(bad)
                    })
                    .collect::<Result<_, _>>()?,
            )
        }
        Value::Array(a) if a.len() > 1 && a.iter().all(|v| v.is_string() || v.is_array()) => {
            return Err(ApiError::param(
                "prompt",
                "batched prompts are not supported: send one prompt per request",
            ))
        }
        _ => return Err(bad()),
    };
    Ok(CompletionRequest { common, prompt })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn chat(extra: Value) -> Result<ChatRequest, ApiError> {
        let mut body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        parse_chat(&body, "m", Family::Gemma4)
    }

    #[test]
    fn template_kwargs_take_any_keys_and_reasoning_effort() {
        let kw = |extra: Value| chat(extra).map(|r| Value::Object(r.template_kwargs));
        assert_eq!(kw(json!({})).unwrap(), json!({}));
        assert_eq!(
            kw(json!({"chat_template_kwargs": {"enable_thinking": true, "x": [1]}, "reasoning_effort": "high"}))
                .unwrap(),
            json!({"enable_thinking": true, "x": [1], "reasoning_effort": "high"})
        );
        for (bad, param) in [
            (json!({"chat_template_kwargs": [1]}), "chat_template_kwargs"),
            (json!({"reasoning_effort": 1}), "reasoning_effort"),
            (
                json!({"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}}),
                "reasoning_effort",
            ),
            // A string switch would be true to the template whatever it says.
            (
                json!({"chat_template_kwargs": {"enable_thinking": "false"}}),
                "chat_template_kwargs",
            ),
            (
                json!({"chat_template_kwargs": {"thinking": 0}}),
                "chat_template_kwargs",
            ),
        ] {
            let e = chat(bad.clone()).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{bad}");
        }
    }

    #[test]
    fn top_k_zero_is_off_and_out_of_range_values_are_refused() {
        let top_k = |v: Value| chat(json!({"top_k": v})).map(|r| r.common.sampling.top_k);
        assert_eq!(
            top_k(json!(0)).unwrap(),
            0,
            "0 must reach the sampler as off"
        );
        assert_eq!(top_k(json!(1)).unwrap(), 1);
        assert_eq!(top_k(json!(256)).unwrap(), 256);
        assert_eq!(top_k(Value::Null).unwrap(), 64, "null takes the default");
        for bad in [json!(-1), json!(257), json!(1.5), json!("8")] {
            let e = top_k(bad.clone()).unwrap_err();
            assert_eq!(e.status.as_u16(), 400, "{bad}");
            assert_eq!(e.param.as_deref(), Some("top_k"), "{bad}");
        }
    }

    /// The sampler's seed is a u64: its whole range reaches it unchanged (2^64 - 1 was refused as
    /// "must be an integer", and -1 became 2^64 - 1 without a word).
    #[test]
    fn seed_takes_the_whole_u64_range_and_refuses_the_rest_with_it() {
        let seed = |v: Value| chat(json!({ "seed": v })).map(|r| r.common.sampling.seed);
        assert_eq!(seed(json!(0)).unwrap(), Some(0));
        assert_eq!(seed(json!(u64::MAX)).unwrap(), Some(u64::MAX));
        assert_eq!(seed(Value::Null).unwrap(), None, "null: no seed");
        let body = r#"{"model": "m", "messages": [{"role": "user", "content": "hi"}], "seed": 18446744073709551615}"#;
        let parsed = parse_chat(&serde_json::from_str(body).unwrap(), "m", Family::Gemma4);
        assert_eq!(parsed.unwrap().common.sampling.seed, Some(u64::MAX));
        let too_big: Value = serde_json::from_str("18446744073709551616").unwrap();
        for bad in [json!(-1), json!(1.5), json!("7"), too_big] {
            let e = seed(bad.clone()).unwrap_err();
            assert_eq!(e.status.as_u16(), 400, "{bad}");
            assert_eq!(e.param.as_deref(), Some("seed"), "{bad}");
            assert!(e.message.contains("18446744073709551615"), "{}", e.message);
        }
    }
}
