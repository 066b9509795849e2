use std::collections::BTreeSet;
use std::path::Path;

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, Rest, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind};

use crate::pyjson::{self, DumpOptions};
use crate::tokenizer::{read_tokenizer_config, special_token};
use crate::TextError;

const TEMPLATE_NAME: &str = "chat_template";

/// The special-token keys of `tokenizer_config.json` that transformers passes to every template
/// (`special_tokens_map`), when they are set.
const SPECIAL_TOKEN_KEYS: [&str; 4] = ["bos_token", "eos_token", "unk_token", "pad_token"];

/// The install's Jinja chat template, rendered with HF `apply_chat_template` semantics.
///
/// The minijinja environment is set up like transformers' `_compile_jinja_template`
/// (`transformers/utils/chat_template_utils.py`): `trim_blocks` and `lstrip_blocks`, loop controls,
/// `tojson` as Python `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`, `raise_exception(msg)`, `strftime_now(fmt)`; plus Python string/dict methods
/// (minijinja-contrib pycompat), Python `str()` printing (`None`, `True`, `1e+16`), and llama.cpp's
/// `from_json` filter that the DeepSeek-V4 template uses for string tool arguments.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    special_tokens: Vec<(String, Value)>,
    variables: BTreeSet<String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source_len", &self.source.len())
            .field("special_tokens", &self.special_tokens)
            .finish()
    }
}

impl ChatTemplate {
    /// Loads `dir/chat_template.jinja`, or else the `chat_template` of `dir/tokenizer_config.json`
    /// (a string, or the list form `[{name, template}]`, where `default` is taken). The special
    /// tokens (`bos_token`, `eos_token`, `unk_token`, `pad_token`, `additional_special_tokens`) come
    /// from `tokenizer_config.json` when it exists.
    ///
    /// Errors: [`TextError::NoChatTemplate`] when neither source exists, [`TextError::TemplateSyntax`]
    /// when the template does not compile, I/O and JSON errors of the files.
    pub fn from_dir(dir: &Path) -> Result<Self, TextError> {
        let config = read_tokenizer_config(dir)?;
        let jinja_path = dir.join("chat_template.jinja");
        let source = match std::fs::read_to_string(&jinja_path) {
            Ok(s) => s,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => config
                .as_ref()
                .and_then(template_from_config)
                .ok_or_else(|| TextError::NoChatTemplate(dir.to_path_buf()))?,
            Err(source) => {
                return Err(TextError::Io {
                    path: jinja_path,
                    source,
                })
            }
        };
        let mut special = serde_json::Map::new();
        if let Some(config) = &config {
            for key in SPECIAL_TOKEN_KEYS {
                if let Some(tok) = special_token(config, key) {
                    special.insert(key.to_string(), tok.into());
                }
            }
            if let Some(list @ serde_json::Value::Array(_)) =
                config.get("additional_special_tokens")
            {
                let list: Vec<serde_json::Value> = list
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|t| match t {
                        serde_json::Value::String(s) => Some(s.clone().into()),
                        serde_json::Value::Object(o) => o.get("content").cloned(),
                        _ => None,
                    })
                    .collect();
                special.insert("additional_special_tokens".into(), list.into());
            }
        }
        Self::from_source(source, &special)
    }

    /// Compiles a template from its source. `special_tokens` (`bos_token`, `eos_token`, ...) are
    /// passed to every render, as transformers passes `special_tokens_map`.
    pub fn from_source(
        source: String,
        special_tokens: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<Self, TextError> {
        let mut env = Environment::new();
        env.set_syntax(
            SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .map_err(|e| TextError::TemplateSyntax(e.to_string()))?,
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(|out, _state, value| {
            out.write_str(&pyjson::py_str(value))
                .map_err(|_| Error::new(ErrorKind::WriteFailure, "cannot write template output"))
        });
        env.add_filter("tojson", tojson);
        env.add_filter("string", |v: &Value| pyjson::py_str(v));
        env.add_filter("from_json", from_json);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(TEMPLATE_NAME, source.clone())
            .map_err(|e| TextError::TemplateSyntax(describe(&e)))?;
        let special_tokens = special_tokens
            .iter()
            .map(|(k, v)| (k.clone(), json_to_value(v)))
            .collect();
        let globals: BTreeSet<&str> = env.globals().map(|(k, _)| k).collect();
        let variables = env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| TextError::TemplateSyntax(describe(&e)))?
            .undeclared_variables(false)
            .into_iter()
            .filter(|v| !globals.contains(v.as_str()) && !RESERVED.contains(&v.as_str()))
            .collect();
        Ok(ChatTemplate {
            env,
            source,
            special_tokens,
            variables,
        })
    }

    /// The variables the template reads besides the render arguments (`messages`, `tools`, ...):
    /// the keys that [`render`](Self::render)'s `extra` can change (Qwen 3.6: `enable_thinking`,
    /// `add_vision_id`; DeepSeek-V4 also `thinking`, `drop_thinking`, `reasoning_effort`), found
    /// by minijinja's `undeclared_variables`.
    pub fn variables(&self) -> &BTreeSet<String> {
        &self.variables
    }

    /// Refuses an `extra` key the template never reads, which would change nothing
    /// ([`TextError::TemplateVariable`]), and the render arguments.
    pub fn check_extra(
        &self,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<(), TextError> {
        reserved_key(extra)?;
        match extra.keys().find(|k| !self.variables.contains(*k)) {
            None => Ok(()),
            Some(key) => Err(TextError::TemplateVariable {
                name: key.clone(),
                known: if self.variables.is_empty() {
                    "none".into()
                } else {
                    self.variables
                        .iter()
                        .map(String::as_str)
                        .collect::<Vec<_>>()
                        .join(", ")
                },
            }),
        }
    }

    /// The template source, e.g. to hash it into a prompt-cache key.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders a conversation as transformers' `apply_chat_template(..., tokenize=False)`.
    ///
    /// - `messages`: OpenAI-style message objects (`role`, `content`, `tool_calls` with
    ///   `function.arguments` as a JSON object, `tool_call_id`, `reasoning_content`, ...), passed to
    ///   the template unchanged.
    /// - `tools`: JSON-schema tool list (`[{"type":"function","function":{...}}]`); `None` renders
    ///   with `tools` = none, as transformers does.
    /// - `add_generation_prompt`: append the header of the assistant turn to generate.
    /// - `extra`: further template variables (`enable_thinking`, `reasoning_effort`, ...); they
    ///   override the special tokens, as in transformers. `messages`, `tools`, `documents` and
    ///   `add_generation_prompt` cannot be passed here.
    ///
    /// Errors: [`TextError::TemplateRender`] for a template error or a `raise_exception` of the
    /// template (its message is kept), and for a reserved key in `extra`.
    pub fn render(
        &self,
        messages: &[serde_json::Value],
        tools: Option<&[serde_json::Value]>,
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, TextError> {
        reserved_key(extra)?;
        let mut ctx: Vec<(String, Value)> = self.special_tokens.clone();
        ctx.extend(extra.iter().map(|(k, v)| (k.clone(), json_to_value(v))));
        ctx.push((
            "messages".into(),
            Value::from(messages.iter().map(json_to_value).collect::<Vec<_>>()),
        ));
        ctx.push((
            "tools".into(),
            match tools {
                Some(t) => Value::from(t.iter().map(json_to_value).collect::<Vec<_>>()),
                None => Value::from(()),
            },
        ));
        ctx.push(("documents".into(), Value::from(())));
        ctx.push((
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        ));
        let ctx = Value::from_pairs(ctx);
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| TextError::TemplateSyntax(describe(&e)))?;
        template
            .render(ctx)
            .map_err(|e| TextError::TemplateRender(describe(&e)))
    }
}

/// The variables every render sets itself.
const RESERVED: [&str; 4] = ["messages", "tools", "documents", "add_generation_prompt"];

fn reserved_key(extra: &serde_json::Map<String, serde_json::Value>) -> Result<(), TextError> {
    match RESERVED.iter().find(|k| extra.contains_key(**k)) {
        Some(key) => Err(TextError::TemplateRender(format!(
            "`{key}` is a render argument, not an extra template variable"
        ))),
        None => Ok(()),
    }
}

fn template_from_config(config: &serde_json::Map<String, serde_json::Value>) -> Option<String> {
    match config.get("chat_template")? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Array(list) => list.iter().find_map(|t| {
            (t.get("name")?.as_str()? == "default")
                .then(|| t.get("template")?.as_str().map(str::to_string))
                .flatten()
        }),
        _ => None,
    }
}

/// The error text with its cause chain, without minijinja's debug dump.
fn describe(e: &Error) -> String {
    let mut s = match e.detail() {
        Some(detail) if e.kind() == ErrorKind::InvalidOperation => detail.to_string(),
        _ => e.to_string(),
    };
    if let (Some(name), Some(line)) = (e.name(), e.line()) {
        s.push_str(&format!(" ({name} line {line})"));
    }
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        s.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    s
}

/// Converts JSON to a minijinja value, keeping object key order.
pub(crate) fn json_to_value(v: &serde_json::Value) -> Value {
    match v {
        serde_json::Value::Null => Value::from(()),
        serde_json::Value::Bool(b) => Value::from(*b),
        serde_json::Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                Value::from(i)
            } else if let Some(u) = n.as_u64() {
                Value::from(u)
            } else {
                Value::from(n.as_f64().unwrap_or(f64::NAN))
            }
        }
        serde_json::Value::String(s) => Value::from(s.as_str()),
        serde_json::Value::Array(a) => Value::from(a.iter().map(json_to_value).collect::<Vec<_>>()),
        serde_json::Value::Object(o) => {
            Value::from_pairs(o.iter().map(|(k, v)| (k.as_str(), json_to_value(v))))
        }
    }
}

/// `json.loads`, as a filter (llama.cpp's extension; transformers has none).
fn from_json(s: &str) -> Result<Value, Error> {
    serde_json::from_str::<serde_json::Value>(s)
        .map(|v| json_to_value(&v))
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("from_json: {e}")))
}

/// transformers' `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`.
fn tojson(value: &Value, args: Rest<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let names = ["ensure_ascii", "indent", "separators", "sort_keys"];
    if args.len() > names.len() {
        return Err(Error::new(
            ErrorKind::TooManyArguments,
            "tojson takes at most 4 arguments",
        ));
    }
    let mut given: Vec<Option<Value>> = vec![None; names.len()];
    for (slot, arg) in given.iter_mut().zip(args.iter()) {
        *slot = Some(arg.clone());
    }
    for (i, name) in names.iter().enumerate() {
        if let Some(v) = kwargs.get::<Option<Value>>(name)? {
            given[i] = Some(v);
        }
    }
    kwargs.assert_all_used()?;
    let mut opts = DumpOptions::default();
    if let Some(v) = &given[0] {
        opts.ensure_ascii = v.is_true();
    }
    if let Some(v) = given[1].as_ref().filter(|v| !v.is_none()) {
        opts.indent = Some(match v.kind() {
            ValueKind::String => v.as_str().unwrap_or_default().to_string(),
            ValueKind::Number => " ".repeat(v.as_usize().unwrap_or(0)),
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "indent must be int or str",
                ))
            }
        });
        opts.item_sep = ",".into();
    }
    if let Some(v) = given[2].as_ref().filter(|v| !v.is_none()) {
        let parts: Vec<Value> = v.try_iter()?.collect();
        match parts.as_slice() {
            [item, key] if item.as_str().is_some() && key.as_str().is_some() => {
                opts.item_sep = item.as_str().unwrap_or_default().to_string();
                opts.key_sep = key.as_str().unwrap_or_default().to_string();
            }
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "separators must be a pair of strings",
                ))
            }
        }
    }
    if let Some(v) = &given[3] {
        opts.sort_keys = v.is_true();
    }
    Ok(Value::from_safe_string(pyjson::dumps(value, &opts)?))
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `datetime.now().strftime(fmt)`, in UTC (the time zone of our servers; transformers uses the
/// local time).
fn strftime_now(format: &str) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    strftime(format, secs)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// C `strftime` for a UTC Unix time, for the directives chat templates use (`%Y %m %d %H %M %S %y
/// %B %b %A %a %j %I %p %e %%`); other directives are copied through unchanged.
pub(crate) fn strftime(format: &str, unix_secs: i64) -> String {
    let days = unix_secs.div_euclid(86_400);
    let secs_of_day = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (secs_of_day / 3600, secs_of_day / 60 % 60, secs_of_day % 60);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday; 0 = Monday
    let yday = days - days_from_civil(year, 1, 1) + 1;
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('e') => out.push_str(&format!("{day:2}")),
            Some('H') => out.push_str(&format!("{hour:02}")),
            Some('I') => out.push_str(&format!("{:02}", (hour + 11) % 12 + 1)),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('M') => out.push_str(&format!("{minute:02}")),
            Some('S') => out.push_str(&format!("{second:02}")),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('B') => out.push_str(MONTHS[month as usize - 1]),
            Some('b') => out.push_str(&MONTHS[month as usize - 1][..3]),
            Some('A') => out.push_str(WEEKDAYS[weekday]),
            Some('a') => out.push_str(&WEEKDAYS[weekday][..3]),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Days since 1970-01-01 → (year, month, day), proleptic Gregorian (H. Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let m = i64::from(m);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(src: &str, extra: serde_json::Value) -> Result<String, TextError> {
        let t = ChatTemplate::from_source(src.to_string(), &serde_json::Map::new()).unwrap();
        t.render(&[], None, false, extra.as_object().unwrap())
    }

    #[test]
    fn strftime_known_dates() {
        // 1970-01-01 00:00:00 UTC was a Thursday; 951_782_400 is 2000-02-29 00:00:00 UTC (Tuesday).
        assert_eq!(
            strftime("%Y-%m-%d %H:%M:%S %A %a %j", 0),
            "1970-01-01 00:00:00 Thursday Thu 001"
        );
        assert_eq!(
            strftime("%d %B %Y, %A", 951_782_400),
            "29 February 2000, Tuesday"
        );
        assert_eq!(
            strftime("%j %I%p %%", 951_782_400 + 13 * 3600),
            "060 01PM %"
        );
    }

    #[test]
    fn raise_exception_message_is_kept() {
        let err = render(
            "{{ raise_exception('No user query found in messages.') }}",
            serde_json::json!({}),
        )
        .unwrap_err();
        assert!(
            err.to_string().contains("No user query found in messages."),
            "{err}"
        );
    }

    #[test]
    fn python_printing_and_tojson() {
        let out = render(
            "{{ x }}|{{ n }}|{{ b }}|{{ f }}|{{ d | tojson }}|{{ d | tojson(indent=1) }}|{{ b | string }}",
            serde_json::json!({"x": null, "n": 3, "b": true, "f": 1e20, "d": {"a<b": "é&"}}),
        )
        .unwrap();
        assert_eq!(
            out,
            "None|3|True|1e+20|{\"a<b\": \"é&\"}|{\n \"a<b\": \"é&\"\n}|True"
        );
    }

    #[test]
    fn variables_are_what_the_template_reads() {
        let src = "{% set ns = namespace(x=1) %}{% if enable_thinking is defined %}{{ raise_exception(a) }}\
                   {% endif %}{% for m in messages %}{{ m.content }}{{ bos_token }}{% endfor %}";
        let t = ChatTemplate::from_source(src.into(), &serde_json::Map::new()).unwrap();
        let got: Vec<&str> = t.variables().iter().map(String::as_str).collect();
        assert_eq!(got, ["a", "bos_token", "enable_thinking"]);
        let ok = serde_json::json!({"enable_thinking": true});
        assert!(t.check_extra(ok.as_object().unwrap()).is_ok());
        let bad = serde_json::json!({"enable_thinkin": true});
        let e = t.check_extra(bad.as_object().unwrap()).unwrap_err();
        assert!(
            e.to_string().contains("`enable_thinkin`")
                && e.to_string().contains("a, bos_token, enable_thinking"),
            "{e}"
        );
    }

    #[test]
    fn reserved_extra_keys_are_rejected() {
        assert!(matches!(
            render("x", serde_json::json!({"messages": []})),
            Err(TextError::TemplateRender(_))
        ));
    }
}
