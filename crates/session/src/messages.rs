//! Chat messages → template input (one parser for `serve`'s `messages` and `run
//! --messages-file`), with the original's rules (the original Mference's server, github.com/NeelM0906/Mference):
//! roles system, developer, user, assistant and tool; guidance (system/developer) only at the
//! start, consecutive guidance messages of the same role merged with a blank line; `developer` a
//! distinct role only for Gemma (other families map it to system); tool-call arguments passed to
//! the template as JSON objects; a tool message's `tool_call_id` must match an unresolved earlier
//! call.

use std::collections::HashMap;

use serde_json::{json, Value};

use mference_text::Family;

/// A message list that cannot be rendered: the field at fault (`messages[2].tool_call_id`) and
/// what was wrong. The server answers it as a 400 naming the field; `run --messages-file`
/// prints it with the file's name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{param}: {message}")]
pub struct MessageError {
    /// The field at fault, in the request's JSON (`messages[0].content[1]`).
    pub param: String,
    /// What was wrong and, where there is one, what to do.
    pub message: String,
}

impl MessageError {
    fn new(param: impl Into<String>, message: impl Into<String>) -> Self {
        MessageError {
            param: param.into(),
            message: message.into(),
        }
    }
}

/// The text of a `content` field: a string, or a list of `{"type": "text", "text": …}` parts
/// (joined with newlines). `null`/missing gives `None`; other part types are refused.
fn text_content(m: &Value, at: &str) -> Result<Option<String>, MessageError> {
    match m.get("content") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (j, p) in parts.iter().enumerate() {
                match (
                    p.get("type").and_then(Value::as_str),
                    p.get("text").and_then(Value::as_str),
                ) {
                    (Some("text"), Some(t)) => texts.push(t),
                    (Some("text"), None) => {
                        return Err(MessageError::new(
                            format!("{at}.content[{j}].text"),
                            "a text part needs a string `text`",
                        ))
                    }
                    (t, _) => {
                        return Err(MessageError::new(
                            format!("{at}.content[{j}]"),
                            format!(
                                "content part type {} is not supported: only text (no multimodal input)",
                                t.unwrap_or("(missing)")
                            ),
                        ))
                    }
                }
            }
            Ok(Some(texts.join("\n")))
        }
        Some(_) => Err(MessageError::new(
            format!("{at}.content"),
            "`content` must be a string or a list of text parts",
        )),
    }
}

/// Validates `messages` (OpenAI chat messages: `content` a string or a list of text parts) and
/// returns the list to hand to `family`'s chat template.
///
/// Errors: [`MessageError`] naming the first field at fault.
pub fn normalize_messages(messages: &[Value], family: Family) -> Result<Vec<Value>, MessageError> {
    if messages.is_empty() {
        return Err(MessageError::new(
            "messages",
            "`messages` must hold at least one message",
        ));
    }
    let mut out: Vec<Value> = Vec::with_capacity(messages.len());
    // Calls made by earlier assistant turns that no tool message has answered yet: id → name.
    let mut unresolved: HashMap<String, String> = HashMap::new();
    let mut seen_turn = false;
    for (i, m) in messages.iter().enumerate() {
        let at = format!("messages[{i}]");
        let role = m.get("role").and_then(Value::as_str).ok_or_else(|| {
            MessageError::new(format!("{at}.role"), "every message needs a string `role`")
        })?;
        match role {
            "system" | "developer" => {
                if seen_turn {
                    return Err(MessageError::new(
                        format!("{at}.role"),
                        format!("a {role} message must come before every user, assistant and tool message"),
                    ));
                }
                let role = if role == "developer" && family != Family::Gemma4 {
                    "system"
                } else {
                    role
                };
                let content = text_content(m, &at)?.ok_or_else(|| {
                    MessageError::new(
                        format!("{at}.content"),
                        format!("a {role} message needs `content`"),
                    )
                })?;
                match out.last_mut() {
                    Some(prev) if prev["role"] == role => {
                        let merged =
                            format!("{}\n\n{content}", prev["content"].as_str().unwrap_or(""));
                        prev["content"] = Value::String(merged);
                    }
                    _ => out.push(json!({"role": role, "content": content})),
                }
            }
            "user" => {
                seen_turn = true;
                let content = text_content(m, &at)?.ok_or_else(|| {
                    MessageError::new(format!("{at}.content"), "a user message needs `content`")
                })?;
                out.push(json!({"role": "user", "content": content}));
            }
            "assistant" => {
                seen_turn = true;
                let content = text_content(m, &at)?;
                let mut msg =
                    json!({"role": "assistant", "content": content.clone().unwrap_or_default()});
                if let Some(calls) = m.get("tool_calls").filter(|v| !v.is_null()) {
                    let calls = calls.as_array().ok_or_else(|| {
                        MessageError::new(
                            format!("{at}.tool_calls"),
                            "`tool_calls` must be an array",
                        )
                    })?;
                    let mut rendered = Vec::with_capacity(calls.len());
                    for (j, c) in calls.iter().enumerate() {
                        let cat = format!("{at}.tool_calls[{j}]");
                        rendered.push(tool_call(c, &cat, &mut unresolved)?);
                    }
                    if !rendered.is_empty() {
                        msg["tool_calls"] = Value::Array(rendered);
                    }
                } else if content.is_none() {
                    return Err(MessageError::new(
                        format!("{at}.content"),
                        "an assistant message needs `content` or `tool_calls`",
                    ));
                }
                out.push(msg);
            }
            "tool" => {
                seen_turn = true;
                let id = m
                    .get("tool_call_id")
                    .and_then(Value::as_str)
                    .ok_or_else(|| {
                        MessageError::new(
                            format!("{at}.tool_call_id"),
                            "a tool message needs a string `tool_call_id`",
                        )
                    })?;
                let name = unresolved.remove(id).ok_or_else(|| {
                    MessageError::new(
                        format!("{at}.tool_call_id"),
                        format!("tool_call_id `{id}` does not match an unanswered tool call of an earlier assistant message"),
                    )
                })?;
                let content = text_content(m, &at)?.unwrap_or_default();
                out.push(
                    json!({"role": "tool", "tool_call_id": id, "name": name, "content": content}),
                );
            }
            other => {
                return Err(MessageError::new(
                    format!("{at}.role"),
                    format!(
                    "unknown role `{other}` (allowed: system, developer, user, assistant, tool)"
                ),
                ))
            }
        }
    }
    Ok(out)
}

/// One assistant tool call, with `arguments` turned from a JSON string into an object.
fn tool_call(
    c: &Value,
    at: &str,
    unresolved: &mut HashMap<String, String>,
) -> Result<Value, MessageError> {
    let id = c
        .get("id")
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
        .ok_or_else(|| MessageError::new(format!("{at}.id"), "a tool call needs a string `id`"))?;
    if let Some(t) = c.get("type").and_then(Value::as_str) {
        if t != "function" {
            return Err(MessageError::new(
                format!("{at}.type"),
                "only function tool calls are supported",
            ));
        }
    }
    let f = c.get("function").ok_or_else(|| {
        MessageError::new(format!("{at}.function"), "a tool call needs `function`")
    })?;
    let name = f.get("name").and_then(Value::as_str).ok_or_else(|| {
        MessageError::new(format!("{at}.function.name"), "a tool call needs a `name`")
    })?;
    let arguments = match f.get("arguments") {
        None | Some(Value::Null) => json!({}),
        Some(Value::String(s)) if s.trim().is_empty() => json!({}),
        Some(Value::String(s)) => serde_json::from_str::<Value>(s)
            .ok()
            .filter(Value::is_object)
            .ok_or_else(|| {
                MessageError::new(
                    format!("{at}.function.arguments"),
                    "`arguments` must be a JSON object encoded as a string",
                )
            })?,
        Some(v @ Value::Object(_)) => v.clone(),
        Some(_) => {
            return Err(MessageError::new(
                format!("{at}.function.arguments"),
                "`arguments` must be a JSON object encoded as a string",
            ))
        }
    };
    if unresolved
        .insert(id.to_string(), name.to_string())
        .is_some()
    {
        return Err(MessageError::new(
            format!("{at}.id"),
            format!("tool call id `{id}` is used twice"),
        ));
    }
    Ok(json!({"id": id, "type": "function", "function": {"name": name, "arguments": arguments}}))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roles(v: &[Value]) -> Vec<&str> {
        v.iter().map(|m| m["role"].as_str().unwrap()).collect()
    }

    #[test]
    fn guidance_merges_and_developer_maps_per_family() {
        let msgs = vec![
            json!({"role": "system", "content": "a"}),
            json!({"role": "system", "content": [{"type": "text", "text": "b"}]}),
            json!({"role": "developer", "content": "c"}),
            json!({"role": "user", "content": "hi"}),
        ];
        let g = normalize_messages(&msgs, Family::Gemma4).unwrap();
        assert_eq!(roles(&g), ["system", "developer", "user"]);
        assert_eq!(g[0]["content"], "a\n\nb");
        let q = normalize_messages(&msgs, Family::Qwen3_5Moe).unwrap();
        assert_eq!(roles(&q), ["system", "user"]);
        assert_eq!(q[0]["content"], "a\n\nb\n\nc");
    }

    #[test]
    fn guidance_after_a_turn_is_refused() {
        let msgs = vec![
            json!({"role": "user", "content": "hi"}),
            json!({"role": "system", "content": "late"}),
        ];
        let e = normalize_messages(&msgs, Family::Gemma4).unwrap_err();
        assert_eq!(e.param, "messages[1].role");
    }

    #[test]
    fn tool_messages_must_answer_an_open_call() {
        let call = json!({"role": "assistant", "content": null, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]});
        let ok = normalize_messages(
            &[
                json!({"role": "user", "content": "q"}),
                call.clone(),
                json!({"role": "tool", "tool_call_id": "call_1", "content": "42"}),
            ],
            Family::Gemma4,
        )
        .unwrap();
        assert_eq!(
            ok[1]["tool_calls"][0]["function"]["arguments"],
            json!({"x": 1})
        );
        assert_eq!(ok[2]["name"], "f");
        // Unknown id, and a second answer to the same call.
        for bad in [
            vec![
                json!({"role": "user", "content": "q"}),
                call.clone(),
                json!({"role": "tool", "tool_call_id": "call_2", "content": "42"}),
            ],
            vec![
                json!({"role": "user", "content": "q"}),
                call.clone(),
                json!({"role": "tool", "tool_call_id": "call_1", "content": "42"}),
                json!({"role": "tool", "tool_call_id": "call_1", "content": "43"}),
            ],
        ] {
            let e = normalize_messages(&bad, Family::Gemma4).unwrap_err();
            assert!(e.param.ends_with("tool_call_id"));
        }
    }

    #[test]
    fn bad_arguments_and_multimodal_parts_are_refused() {
        let call = json!({"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]});
        assert!(normalize_messages(&[call], Family::Gemma4).is_err());
        let img =
            json!({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]});
        assert!(normalize_messages(&[img], Family::Gemma4).is_err());
        assert!(normalize_messages(
            &[json!({"role": "function", "content": "x"})],
            Family::Gemma4
        )
        .is_err());
    }
}
