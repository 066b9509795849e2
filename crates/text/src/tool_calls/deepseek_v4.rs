//! DeepSeek-V4 tool calls in DSML, as the V4 chat template writes them:
//! `<｜DSML｜tool_calls>` holding `<｜DSML｜invoke name="NAME">` blocks with
//! `<｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter>` children;
//! `string="false"` values are JSON.

use serde_json::{Map, Value};

use super::{excerpt, malformed, scan_blocks, split_think, BlockSyntax, ParsedOutput, ToolCall};
use crate::{Family, TextError};

const OPEN: &str = "<｜DSML｜tool_calls>";
const CLOSE: &str = "</｜DSML｜tool_calls>";
const INVOKE_OPEN: &str = "<｜DSML｜invoke name=\"";
const INVOKE_CLOSE: &str = "</｜DSML｜invoke>";
const PARAM_OPEN: &str = "<｜DSML｜parameter name=\"";
const PARAM_CLOSE: &str = "</｜DSML｜parameter>";

const SYNTAX: BlockSyntax = BlockSyntax {
    family: Family::DeepseekV4,
    open: OPEN,
    close: CLOSE,
    inner: &[INVOKE_OPEN, INVOKE_CLOSE, PARAM_OPEN, PARAM_CLOSE],
    trailer: None,
};

pub(super) fn parse(text: &str) -> Result<ParsedOutput, TextError> {
    let (reasoning, text) = split_think(text);
    scan_blocks(&SYNTAX, text, reasoning, parse_invokes)
}

fn err(message: String) -> TextError {
    malformed(Family::DeepseekV4, message)
}

fn parse_invokes(block: &str, calls: &mut Vec<ToolCall>) -> Result<(), TextError> {
    let mut rest = block.trim_start();
    if rest.is_empty() {
        return Err(err(format!("empty {OPEN} block")));
    }
    while !rest.is_empty() {
        let after = rest
            .strip_prefix(INVOKE_OPEN)
            .ok_or_else(|| err(format!("expected {INVOKE_OPEN}…\"> at: {}", excerpt(rest))))?;
        let (name, after) = quoted_then(after, "\">")?;
        if name.is_empty() {
            return Err(err("empty invoke name".into()));
        }
        let end = after
            .find(INVOKE_CLOSE)
            .ok_or_else(|| err(format!("unclosed invoke `{name}`")))?;
        let arguments = parse_parameters(&after[..end], name)?;
        calls.push(ToolCall {
            name: name.to_string(),
            arguments,
        });
        rest = after[end + INVOKE_CLOSE.len()..].trim_start();
    }
    Ok(())
}

fn parse_parameters(block: &str, tool: &str) -> Result<Value, TextError> {
    let mut arguments = Map::new();
    let mut rest = block.trim_start();
    while !rest.is_empty() {
        let after = rest.strip_prefix(PARAM_OPEN).ok_or_else(|| {
            err(format!(
                "expected {PARAM_OPEN}…\"> in invoke `{tool}` at: {}",
                excerpt(rest)
            ))
        })?;
        let (key, after) = quoted_then(after, "\" string=\"")?;
        let (is_string, after) = quoted_then(after, "\">")?;
        let end = after
            .find(PARAM_CLOSE)
            .ok_or_else(|| err(format!("unclosed parameter `{key}` of `{tool}`")))?;
        let raw = &after[..end];
        let value = match is_string {
            "true" => Value::String(raw.to_string()),
            "false" => serde_json::from_str(raw).map_err(|e| {
                err(format!(
                    "parameter `{key}` of `{tool}` is not JSON ({e}): {}",
                    excerpt(raw)
                ))
            })?,
            other => return Err(err(format!("string=\"{other}\" is neither true nor false"))),
        };
        if key.is_empty() || arguments.insert(key.to_string(), value).is_some() {
            return Err(err(format!(
                "empty or duplicate parameter `{key}` of `{tool}`"
            )));
        }
        rest = after[end + PARAM_CLOSE.len()..].trim_start();
    }
    Ok(Value::Object(arguments))
}

/// Splits `VALUE<terminator>REST` at the first `terminator`; the value must not hold a newline or `<`.
fn quoted_then<'a>(s: &'a str, terminator: &str) -> Result<(&'a str, &'a str), TextError> {
    let end = s
        .find(terminator)
        .ok_or_else(|| err(format!("expected `{terminator}` in: {}", excerpt(s))))?;
    let value = &s[..end];
    if value.contains(['\n', '<', '"']) {
        return Err(err(format!("bad attribute value: {}", excerpt(value))));
    }
    Ok((value, &s[end + terminator.len()..]))
}
