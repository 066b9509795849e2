//! Tool-call parsers, one file per syntax ([`mference_format::ToolCallSyntax`], named after the
//! family that introduced it). Each one fails closed: output with a call block that
//! does not parse is rejected as a whole ([`TextError::MalformedToolCall`]), never passed on as
//! content or as a half-parsed call (as in the original system,
//! github.com/NeelM0906/Mference).

mod deepseek_v4;
mod gemma4;
mod qwen3_5_moe;

use crate::{Family, TextError};
use mference_format::ToolCallSyntax;

/// One function call made by the model.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    /// The function name as the model wrote it.
    pub name: String,
    /// The arguments as a JSON object.
    pub arguments: serde_json::Value,
}

/// A generated assistant turn split into its parts.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ParsedOutput {
    /// The visible text: everything outside reasoning and tool-call blocks, trimmed of surrounding
    /// whitespace when anything was taken out.
    pub content: String,
    /// The calls in the order they were written.
    pub tool_calls: Vec<ToolCall>,
    /// Reasoning text (Gemma `<|channel>thought\n…<channel|>`, Qwen/DeepSeek `…</think>`), if the
    /// output has a reasoning block.
    pub reasoning: Option<String>,
}

/// Splits a generated assistant turn (decoded with the family's markers kept: Gemma's
/// `<|tool_call>` and `<|channel>`, Qwen's `<tool_call>`/`</think>` and DeepSeek's `｜DSML｜` are
/// non-special tokens, so `decode(ids, skip_special = true)` keeps them) into content, reasoning
/// and tool calls.
///
/// - Gemma 4: `<|tool_call>call:NAME{key:<|"|>str<|"|>,n:3,flag:true,obj:{k:v},arr:[…]}<tool_call|>`.
/// - Qwen 3.6: `<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call>`
///   (the Qwen 3.6 template's syntax) or `<tool_call>{"name": …, "arguments": {…}}</tool_call>`
///   (Qwen 2.5/3). Parameter values that parse as JSON numbers, booleans, null, arrays or objects
///   become those; anything else stays a string (see [`parse_tool_calls_with_tools`] to use the
///   tool schemas instead).
/// - DeepSeek-V4: `<｜DSML｜tool_calls>` with `<｜DSML｜invoke name="…">` and
///   `<｜DSML｜parameter name="…" string="true|false">` blocks.
///
/// Errors: [`TextError::MalformedToolCall`] for an unclosed or unparsable block, or a stray
/// closing marker.
pub fn parse_tool_calls(family: Family, text: &str) -> Result<ParsedOutput, TextError> {
    parse_tool_calls_with_tools(family, text, None)
}

/// [`parse_tool_calls`] with the request's tool list (`[{"type":"function","function":{…}}]`),
/// which Qwen's XML syntax needs to type parameter values: a parameter declared `"type": "string"`
/// stays a string even when it looks like a number, and a declared number/boolean/object/array
/// that does not parse as one is malformed.
pub fn parse_tool_calls_with_tools(
    family: Family,
    text: &str,
    tools: Option<&[serde_json::Value]>,
) -> Result<ParsedOutput, TextError> {
    match family.tool_call_syntax() {
        ToolCallSyntax::Gemma4 => gemma4::parse(text),
        ToolCallSyntax::Qwen3_5Moe => qwen3_5_moe::parse(text, tools),
        ToolCallSyntax::Dsml => deepseek_v4::parse(text),
        // A template that renders no tools leaves no call syntax in the output to parse.
        ToolCallSyntax::None => Ok(ParsedOutput {
            content: text.to_string(),
            tool_calls: Vec::new(),
            reasoning: None,
        }),
    }
}

/// The declared JSON-schema type of `tool.parameter`, if `tools` declares it.
fn declared_type<'a>(
    tools: Option<&'a [serde_json::Value]>,
    tool: &str,
    parameter: &str,
) -> Option<&'a str> {
    tools?
        .iter()
        .filter_map(|t| t.get("function").or(Some(t)))
        .find(|f| f.get("name").and_then(|n| n.as_str()) == Some(tool))?
        .get("parameters")?
        .get("properties")?
        .get(parameter)?
        .get("type")?
        .as_str()
}

/// How a family marks its call blocks in the output, for [`scan_blocks`].
struct BlockSyntax {
    family: Family,
    /// Opens a call block (`<|tool_call>`, `<tool_call>`, `<｜DSML｜tool_calls>`).
    open: &'static str,
    /// Closes it.
    close: &'static str,
    /// Markers that belong inside a block only (besides `close`): one outside is malformed.
    inner: &'static [&'static str],
    /// A marker dropped when it is all that follows a block (Gemma's `<|tool_response>`, where
    /// generation stops after its calls).
    trailer: Option<&'static str>,
}

/// Splits `text` (already without its reasoning block) into content and tool calls: the body of
/// every `open … close` block goes to `block`, which appends the calls it holds; the text between
/// blocks is content, trimmed when anything was taken out (`reasoning` set or a call found).
///
/// Errors: [`TextError::MalformedToolCall`] for an unclosed block, a closing or inner marker
/// outside a block, or whatever `block` rejects.
fn scan_blocks<'t>(
    syntax: &BlockSyntax,
    text: &'t str,
    reasoning: Option<String>,
    mut block: impl FnMut(&'t str, &mut Vec<ToolCall>) -> Result<(), TextError>,
) -> Result<ParsedOutput, TextError> {
    let BlockSyntax {
        family,
        open,
        close,
        ..
    } = *syntax;
    let no_stray = |text: &str| {
        for marker in std::iter::once(close).chain(syntax.inner.iter().copied()) {
            if let Some(at) = text.find(marker) {
                let relation = if marker == close {
                    "without"
                } else {
                    "outside"
                };
                return Err(malformed(
                    family,
                    format!("{marker} {relation} {open}: {}", excerpt(&text[at..])),
                ));
            }
        }
        Ok(())
    };
    let mut content = String::new();
    let mut tool_calls = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find(open) {
        no_stray(&rest[..start])?;
        content.push_str(&rest[..start]);
        let body = &rest[start + open.len()..];
        let end = body
            .find(close)
            .ok_or_else(|| malformed(family, format!("unclosed {open}: {}", excerpt(body))))?;
        block(&body[..end], &mut tool_calls)?;
        rest = &body[end + close.len()..];
        if let Some(after) = syntax
            .trailer
            .and_then(|t| rest.trim_start().strip_prefix(t))
        {
            if after.trim().is_empty() {
                rest = "";
            }
        }
    }
    no_stray(rest)?;
    content.push_str(rest);
    let changed = reasoning.is_some() || !tool_calls.is_empty();
    Ok(ParsedOutput {
        content: if changed {
            content.trim().to_string()
        } else {
            content
        },
        tool_calls,
        reasoning,
    })
}

/// Splits `reasoning</think>content` (the `<think>` may be in the prompt, not the output).
fn split_think(text: &str) -> (Option<String>, &str) {
    match text.find("</think>") {
        Some(end) => {
            let reasoning = &text[..end];
            let reasoning = match reasoning.find("<think>") {
                Some(start) => &reasoning[start + "<think>".len()..],
                None => reasoning,
            };
            (
                Some(reasoning.trim().to_string()),
                &text[end + "</think>".len()..],
            )
        }
        None => (None, text),
    }
}

fn malformed(family: Family, message: impl Into<String>) -> TextError {
    TextError::MalformedToolCall {
        family,
        message: message.into(),
    }
}

/// A short, char-boundary-safe excerpt of model output for error messages.
fn excerpt(s: &str) -> String {
    const MAX: usize = 80;
    match s.char_indices().nth(MAX) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_string(),
    }
}
