//! Qwen 3.6 (`qwen3_5_moe`) tool calls, also Maple's: `<tool_call>` blocks holding either the Qwen 3.6 template's XML form
//! (`<function=NAME>` with `<parameter=KEY>\nVALUE\n</parameter>` children) or the JSON form
//! `{"name": …, "arguments": {…}}` of earlier Qwen templates.

use serde_json::{Map, Value};

use super::{
    declared_type, excerpt, malformed, scan_blocks, split_think, BlockSyntax, ParsedOutput,
    ToolCall,
};
use crate::{Family, TextError};

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

const SYNTAX: BlockSyntax = BlockSyntax {
    family: Family::Qwen3_5Moe,
    open: OPEN,
    close: CLOSE,
    inner: &[],
    trailer: None,
};

pub(super) fn parse(text: &str, tools: Option<&[Value]>) -> Result<ParsedOutput, TextError> {
    let (reasoning, text) = split_think(text);
    scan_blocks(&SYNTAX, text, reasoning, |block, calls| {
        calls.push(parse_call(block, tools)?);
        Ok(())
    })
}

fn parse_call(block: &str, tools: Option<&[Value]>) -> Result<ToolCall, TextError> {
    let inner = block.trim();
    if inner.starts_with('{') {
        parse_json_call(inner)
    } else if inner.starts_with("<function=") {
        parse_xml_call(inner, tools)
    } else {
        Err(malformed(
            Family::Qwen3_5Moe,
            format!(
                "expected <function=…> or a JSON object in {OPEN}: {}",
                excerpt(inner)
            ),
        ))
    }
}

fn parse_json_call(inner: &str) -> Result<ToolCall, TextError> {
    let err = |what: &str| malformed(Family::Qwen3_5Moe, format!("{what}: {}", excerpt(inner)));
    let value: Value =
        serde_json::from_str(inner).map_err(|e| err(&format!("invalid JSON ({e})")))?;
    let name = value
        .get("name")
        .and_then(Value::as_str)
        .filter(|n| !n.is_empty())
        .ok_or_else(|| err("missing string `name`"))?;
    let arguments = match value.get("arguments").or_else(|| value.get("parameters")) {
        None => Value::Object(Map::new()),
        Some(Value::Object(o)) => Value::Object(o.clone()),
        // Some models write the OpenAI wire form: arguments as a JSON string.
        Some(Value::String(s)) => match serde_json::from_str(s) {
            Ok(Value::Object(o)) => Value::Object(o),
            _ => return Err(err("`arguments` string is not a JSON object")),
        },
        Some(_) => return Err(err("`arguments` is not an object")),
    };
    Ok(ToolCall {
        name: name.to_string(),
        arguments,
    })
}

fn parse_xml_call(inner: &str, tools: Option<&[Value]>) -> Result<ToolCall, TextError> {
    let err = |what: &str| malformed(Family::Qwen3_5Moe, format!("{what}: {}", excerpt(inner)));
    let after = &inner["<function=".len()..];
    let gt = after.find('>').ok_or_else(|| err("unclosed <function="))?;
    let name = after[..gt].trim();
    if name.is_empty() || name.contains(['<', '\n']) {
        return Err(err("invalid function name"));
    }
    let mut rest = &after[gt + 1..];
    let mut arguments = Map::new();
    loop {
        rest = rest.trim_start();
        if let Some(tail) = rest.strip_prefix("</function>") {
            if !tail.trim().is_empty() {
                return Err(err("text after </function>"));
            }
            break;
        }
        let Some(param) = rest.strip_prefix("<parameter=") else {
            return Err(err("expected <parameter=…> or </function>"));
        };
        let gt = param.find('>').ok_or_else(|| err("unclosed <parameter="))?;
        let key = param[..gt].trim();
        if key.is_empty() || key.contains(['<', '\n']) {
            return Err(err("invalid parameter name"));
        }
        let body = &param[gt + 1..];
        let end = body
            .find("</parameter>")
            .ok_or_else(|| err(&format!("unclosed <parameter={key}>")))?;
        let raw = &body[..end];
        // The template writes "<parameter=K>\nVALUE\n</parameter>": one newline each side.
        let raw = raw.strip_prefix('\n').unwrap_or(raw);
        let raw = raw.strip_suffix('\n').unwrap_or(raw);
        let value = typed_value(raw, declared_type(tools, name, key))
            .map_err(|what| err(&format!("parameter `{key}`: {what}")))?;
        if arguments.insert(key.to_string(), value).is_some() {
            return Err(err(&format!("duplicate parameter `{key}`")));
        }
        rest = &body[end + "</parameter>".len()..];
    }
    Ok(ToolCall {
        name: name.to_string(),
        arguments: Value::Object(arguments),
    })
}

/// Types a parameter value written as text: by its declared schema type when known, else JSON
/// literals (numbers, booleans, null, arrays, objects) become JSON and the rest stays a string.
///
/// The template prints non-JSON scalars with Python's `str()` (`True`, `False`, `None`), so for a
/// declared non-string type those spellings are accepted too.
fn typed_value(raw: &str, declared: Option<&str>) -> Result<Value, String> {
    let trimmed = raw.trim();
    let parsed = match trimmed {
        "True" if declared == Some("boolean") => Ok(Value::Bool(true)),
        "False" if declared == Some("boolean") => Ok(Value::Bool(false)),
        _ => serde_json::from_str::<Value>(trimmed),
    };
    if declared.is_some_and(|t| t != "string") && matches!(trimmed, "null" | "None") {
        return Ok(Value::Null);
    }
    match declared {
        Some("string") => Ok(Value::String(raw.to_string())),
        Some("integer") => match parsed {
            Ok(v @ Value::Number(_)) if v.is_i64() || v.is_u64() => Ok(v),
            _ => Err(format!("`{}` is not an integer", excerpt(raw))),
        },
        Some("number") => match parsed {
            Ok(v @ Value::Number(_)) => Ok(v),
            _ => Err(format!("`{}` is not a number", excerpt(raw))),
        },
        Some("boolean") => match parsed {
            Ok(v @ Value::Bool(_)) => Ok(v),
            _ => Err(format!("`{}` is not a boolean", excerpt(raw))),
        },
        Some("object") => match parsed {
            Ok(v @ Value::Object(_)) => Ok(v),
            _ => Err(format!("`{}` is not a JSON object", excerpt(raw))),
        },
        Some("array") => match parsed {
            Ok(v @ Value::Array(_)) => Ok(v),
            _ => Err(format!("`{}` is not a JSON array", excerpt(raw))),
        },
        _ => match parsed {
            Ok(Value::String(_)) | Err(_) => Ok(Value::String(raw.to_string())),
            Ok(v) => Ok(v),
        },
    }
}
