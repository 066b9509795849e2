//! Gemma 4 tool calls: `<|tool_call>call:NAME{ARGS}<tool_call|>`, where ARGS uses the template's
//! `format_argument` syntax: bare keys, strings wrapped in `<|"|>`, `true`/`false`, numbers,
//! nested `{…}` and `[…]` (the Gemma 4 checkpoint's `chat_template.jinja`).

use serde_json::{Map, Value};

use super::{excerpt, malformed, scan_blocks, BlockSyntax, ParsedOutput, ToolCall};
use crate::{Family, TextError};

const OPEN: &str = "<|tool_call>";
const CLOSE: &str = "<tool_call|>";
const QUOTE: &str = "<|\"|>";
const CHANNEL_OPEN: &str = "<|channel>";
const CHANNEL_CLOSE: &str = "<channel|>";
/// Generation stops on `<|tool_response>` after the calls; drop it if the caller kept it.
const TOOL_RESPONSE: &str = "<|tool_response>";

const SYNTAX: BlockSyntax = BlockSyntax {
    family: Family::Gemma4,
    open: OPEN,
    close: CLOSE,
    inner: &[],
    trailer: Some(TOOL_RESPONSE),
};

pub(super) fn parse(text: &str) -> Result<ParsedOutput, TextError> {
    let (reasoning, text) = split_channel(text)?;
    scan_blocks(&SYNTAX, text, reasoning, |block, calls| {
        calls.push(parse_call(block)?);
        Ok(())
    })
}

/// Takes a leading `<|channel>thought\n…<channel|>` block out as reasoning.
fn split_channel(text: &str) -> Result<(Option<String>, &str), TextError> {
    let trimmed = text.trim_start();
    let Some(after) = trimmed.strip_prefix(CHANNEL_OPEN) else {
        return Ok((None, text));
    };
    let end = after.find(CHANNEL_CLOSE).ok_or_else(|| {
        malformed(
            Family::Gemma4,
            format!("unclosed {CHANNEL_OPEN}: {}", excerpt(after)),
        )
    })?;
    let thought = &after[..end];
    let thought = thought.strip_prefix("thought").unwrap_or(thought);
    Ok((
        Some(thought.trim().to_string()),
        &after[end + CHANNEL_CLOSE.len()..],
    ))
}

fn parse_call(block: &str) -> Result<ToolCall, TextError> {
    let err = |what: &str| {
        malformed(
            Family::Gemma4,
            format!("{what} in {OPEN}{}{CLOSE}", excerpt(block)),
        )
    };
    let call = block
        .trim()
        .strip_prefix("call:")
        .ok_or_else(|| err("missing `call:`"))?;
    let brace = call
        .find('{')
        .ok_or_else(|| err("missing `{` after the name"))?;
    let name = call[..brace].trim();
    let valid_name = !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_alphanumeric() || matches!(c, '_' | '-' | '.' | ':'));
    if !valid_name {
        return Err(err("invalid function name"));
    }
    let mut p = Parser {
        s: &call[brace..],
        pos: 0,
    };
    let arguments = p.object().map_err(|e| err(&e))?;
    p.skip_ws();
    if p.pos != p.s.len() {
        return Err(err("text after the arguments"));
    }
    Ok(ToolCall {
        name: name.to_string(),
        arguments,
    })
}

struct Parser<'a> {
    s: &'a str,
    pos: usize,
}

impl<'a> Parser<'a> {
    fn rest(&self) -> &'a str {
        &self.s[self.pos..]
    }

    fn skip_ws(&mut self) {
        let rest = self.rest();
        self.pos += rest.len() - rest.trim_start().len();
    }

    fn eat(&mut self, token: &str) -> bool {
        self.skip_ws();
        if self.rest().starts_with(token) {
            self.pos += token.len();
            true
        } else {
            false
        }
    }

    fn expect(&mut self, token: &str) -> Result<(), String> {
        if self.eat(token) {
            Ok(())
        } else {
            Err(format!("expected `{token}` at `{}`", excerpt(self.rest())))
        }
    }

    fn value(&mut self) -> Result<Value, String> {
        self.skip_ws();
        let rest = self.rest();
        if rest.starts_with(QUOTE) {
            self.string().map(Value::String)
        } else if rest.starts_with('{') {
            self.object()
        } else if rest.starts_with('[') {
            self.array()
        } else {
            self.literal()
        }
    }

    fn string(&mut self) -> Result<String, String> {
        self.expect(QUOTE)?;
        let rest = self.rest();
        let end = rest.find(QUOTE).ok_or("unclosed string")?;
        self.pos += end + QUOTE.len();
        Ok(rest[..end].to_string())
    }

    fn object(&mut self) -> Result<Value, String> {
        self.expect("{")?;
        let mut map = Map::new();
        if self.eat("}") {
            return Ok(Value::Object(map));
        }
        loop {
            let key = self.key()?;
            self.expect(":")?;
            let value = self.value()?;
            if map.insert(key.clone(), value).is_some() {
                return Err(format!("duplicate key `{key}`"));
            }
            if self.eat("}") {
                return Ok(Value::Object(map));
            }
            self.expect(",")?;
        }
    }

    fn key(&mut self) -> Result<String, String> {
        self.skip_ws();
        if self.rest().starts_with(QUOTE) {
            return self.string();
        }
        let rest = self.rest();
        let end = rest
            .find(|c: char| matches!(c, ':' | ',' | '{' | '}' | '[' | ']') || c.is_whitespace())
            .unwrap_or(rest.len());
        if end == 0 {
            return Err(format!("expected a key at `{}`", excerpt(rest)));
        }
        self.pos += end;
        Ok(rest[..end].to_string())
    }

    fn array(&mut self) -> Result<Value, String> {
        self.expect("[")?;
        let mut items = Vec::new();
        if self.eat("]") {
            return Ok(Value::Array(items));
        }
        loop {
            items.push(self.value()?);
            if self.eat("]") {
                return Ok(Value::Array(items));
            }
            self.expect(",")?;
        }
    }

    /// `true`, `false`, `null`/`None` (the template prints Python's None), or a JSON number.
    fn literal(&mut self) -> Result<Value, String> {
        let rest = self.rest();
        let end = rest.find([',', '}', ']']).unwrap_or(rest.len());
        let lit = rest[..end].trim();
        let value = match lit {
            "true" => Value::Bool(true),
            "false" => Value::Bool(false),
            "null" | "None" => Value::Null,
            _ => match serde_json::from_str::<Value>(lit) {
                Ok(n @ Value::Number(_)) => n,
                _ => return Err(format!("unquoted value `{}`", excerpt(lit))),
            },
        };
        self.pos += end;
        Ok(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn nested_values() {
        let out = parse(
            "<|tool_call>call:f{a:<|\"|>x, y: {z}<|\"|>,n:-3,f:2.5e3,b:false,o:{k:[1,<|\"|>v<|\"|>,{}],<|\"|>q k<|\"|>:None},e:[]}<tool_call|>",
        )
        .unwrap();
        assert_eq!(
            out.tool_calls[0].arguments,
            json!({"a": "x, y: {z}", "n": -3, "f": 2500.0, "b": false, "o": {"k": [1, "v", {}], "q k": null}, "e": []})
        );
    }

    #[test]
    fn bad_literals_fail() {
        for bad in [
            "{a:maybe}",
            "{a:1 2}",
            "{a:}",
            "{:1}",
            "{a:1,}",
            "{a:1",
            "{a:[1}",
            "{a:1,a:2}",
        ] {
            let text = format!("{OPEN}call:f{bad}{CLOSE}");
            assert!(parse(&text).is_err(), "{bad}");
        }
    }
}
