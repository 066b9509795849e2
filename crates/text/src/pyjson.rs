//! Python's `json.dumps` and `str()` for minijinja values, so templates render as under transformers.
//!
//! transformers overrides Jinja's `tojson` with
//! `json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`
//! (`transformers/utils/chat_template_utils.py::_compile_jinja_template`), and Jinja prints values
//! with Python's `str()` (`None`, `True`, `1e+16`, `{'a': 1}`). minijinja differs on all of these.

use std::fmt::Write;

use minijinja::value::{Value, ValueKind};
use minijinja::{Error, ErrorKind};

/// `json.dumps` options. `Default` is transformers' `tojson`: no ASCII escaping, no indent,
/// separators `", "` and `": "`, insertion key order.
#[derive(Debug, Clone)]
pub(crate) struct DumpOptions {
    pub ensure_ascii: bool,
    /// The per-level indent string; `None` for a one-line dump.
    pub indent: Option<String>,
    pub item_sep: String,
    pub key_sep: String,
    pub sort_keys: bool,
}

impl Default for DumpOptions {
    fn default() -> Self {
        DumpOptions {
            ensure_ascii: false,
            indent: None,
            item_sep: ", ".into(),
            key_sep: ": ".into(),
            sort_keys: false,
        }
    }
}

/// Serializes `value` as Python's `json.dumps(value, **opts)` would.
pub(crate) fn dumps(value: &Value, opts: &DumpOptions) -> Result<String, Error> {
    let mut out = String::new();
    dump_value(value, opts, 0, &mut out)?;
    Ok(out)
}

fn dump_value(
    value: &Value,
    opts: &DumpOptions,
    level: usize,
    out: &mut String,
) -> Result<(), Error> {
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => out.push_str(&json_number(value)),
        ValueKind::String => dump_str(value.as_str().unwrap_or_default(), opts.ensure_ascii, out),
        ValueKind::Map => {
            let mut entries = Vec::new();
            for key in value.try_iter()? {
                let item = value.get_item(&key)?;
                entries.push((json_key(&key)?, item));
            }
            if opts.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            if entries.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, (key, item)) in entries.iter().enumerate() {
                separator(i, opts, level + 1, out);
                dump_str(key, opts.ensure_ascii, out);
                out.push_str(&opts.key_sep);
                dump_value(item, opts, level + 1, out)?;
            }
            close(opts, level, out);
            out.push('}');
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                separator(i, opts, level + 1, out);
                dump_value(item, opts, level + 1, out)?;
            }
            close(opts, level, out);
            out.push(']');
        }
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("Object of type {} is not JSON serializable", value.kind()),
            ))
        }
    }
    Ok(())
}

/// Writes the separator before item `i` of a container whose items sit at `level`.
fn separator(i: usize, opts: &DumpOptions, level: usize, out: &mut String) {
    match &opts.indent {
        Some(indent) => {
            if i > 0 {
                out.push_str(&opts.item_sep);
            }
            out.push('\n');
            for _ in 0..level {
                out.push_str(indent);
            }
        }
        None => {
            if i > 0 {
                out.push_str(&opts.item_sep);
            }
        }
    }
}

fn close(opts: &DumpOptions, level: usize, out: &mut String) {
    if let Some(indent) = &opts.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(indent);
        }
    }
}

/// Python converts non-string dict keys to strings (`True` → `"true"`, `None` → `"null"`).
fn json_key(key: &Value) -> Result<String, Error> {
    Ok(match key.kind() {
        ValueKind::String => key.as_str().unwrap_or_default().to_string(),
        ValueKind::None => "null".into(),
        ValueKind::Bool => (if key.is_true() { "true" } else { "false" }).into(),
        ValueKind::Number => json_number(key),
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!(
                    "keys must be str, int, float, bool or None, not {}",
                    key.kind()
                ),
            ))
        }
    })
}

fn json_number(value: &Value) -> String {
    if value.is_integer() {
        return value.to_string();
    }
    match f64::try_from(value.clone()) {
        Ok(f) if f.is_nan() => "NaN".into(),
        Ok(f) if f.is_infinite() => (if f > 0.0 { "Infinity" } else { "-Infinity" }).into(),
        Ok(f) => py_float_repr(f),
        Err(_) => value.to_string(),
    }
}

fn dump_str(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && (c as u32) > 0x7e => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{:04x}", unit);
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)`: shortest round-trip digits, scientific notation when the decimal
/// exponent is below -4 or at least 16 (`1e-05`, `1e+16`), otherwise positional with at least one
/// fractional digit (`2.0`).
pub(crate) fn py_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "nan".into();
    }
    if f.is_infinite() {
        return (if f > 0.0 { "inf" } else { "-inf" }).into();
    }
    if f == 0.0 {
        return (if f.is_sign_negative() { "-0.0" } else { "0.0" }).into();
    }
    // `{:e}` gives the shortest round-trip digits: "-1.2345e-7".
    let sci = format!("{:e}", f);
    let (mantissa, exp) = sci
        .split_once('e')
        .expect("LowerExp always has an exponent");
    let exp: i32 = exp.parse().expect("LowerExp exponent is an integer");
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if !(-4..16).contains(&exp) {
        let (first, rest) = digits.split_at(1);
        let mut s = format!("{sign}{first}");
        if !rest.is_empty() {
            s.push('.');
            s.push_str(rest);
        }
        let _ = write!(s, "e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs());
        return s;
    }
    let point = exp + 1; // digits before the decimal point
    let mut s = sign.to_string();
    if point <= 0 {
        s.push_str("0.");
        for _ in 0..(-point) {
            s.push('0');
        }
        s.push_str(&digits);
    } else if point as usize >= digits.len() {
        s.push_str(&digits);
        for _ in digits.len()..point as usize {
            s.push('0');
        }
        s.push_str(".0");
    } else {
        let (int, frac) = digits.split_at(point as usize);
        s.push_str(int);
        s.push('.');
        s.push_str(frac);
    }
    s
}

/// Python's `str(value)` as Jinja prints it: strings as they are, `None`, `True`/`False`, float
/// repr, and `repr()` inside lists and dicts. Undefined prints as nothing.
pub(crate) fn py_str(value: &Value) -> String {
    match value.kind() {
        ValueKind::String => value.as_str().unwrap_or_default().to_string(),
        ValueKind::Undefined => String::new(),
        _ => py_repr(value),
    }
}

/// Python's `repr(value)`.
pub(crate) fn py_repr(value: &Value) -> String {
    match value.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::None => "None".into(),
        ValueKind::Bool => (if value.is_true() { "True" } else { "False" }).into(),
        ValueKind::Number if !value.is_integer() => match f64::try_from(value.clone()) {
            Ok(f) => py_float_repr(f),
            Err(_) => value.to_string(),
        },
        ValueKind::Number => value.to_string(),
        ValueKind::String => py_str_repr(value.as_str().unwrap_or_default()),
        ValueKind::Map => {
            let mut s = String::from("{");
            if let Ok(keys) = value.try_iter() {
                for (i, key) in keys.enumerate() {
                    if i > 0 {
                        s.push_str(", ");
                    }
                    let item = value.get_item(&key).unwrap_or_default();
                    let _ = write!(s, "{}: {}", py_repr(&key), py_repr(&item));
                }
            }
            s.push('}');
            s
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let mut s = String::from("[");
            if let Ok(items) = value.try_iter() {
                for (i, item) in items.enumerate() {
                    if i > 0 {
                        s.push_str(", ");
                    }
                    s.push_str(&py_repr(&item));
                }
            }
            s.push(']');
            s
        }
        _ => value.to_string(),
    }
}

/// Python's `repr(str)`: single quotes unless the text has a `'` and no `"`.
fn py_str_repr(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    // Expected strings are what CPython 3 prints for `repr(x)` / `json.dumps(x)`.
    #[test]
    fn float_repr_matches_python() {
        let cases = [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (-2.5, "-2.5"),
            (1e16, "1e+16"),
            (1.5e16, "1.5e+16"),
            (123456789012345.0, "123456789012345.0"),
            (1e15, "1000000000000000.0"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1.25e-7, "1.25e-07"),
            (1e100, "1e+100"),
            (-0.0, "-0.0"),
        ];
        for (f, want) in cases {
            assert_eq!(py_float_repr(f), want, "{f}");
        }
    }

    #[test]
    fn dumps_matches_python_defaults() {
        let v = Value::from_serialize_json(
            r#"{"a": [1, 2.5, true, null], "é": "x\"y\n\u0001", "e": {}}"#,
        );
        assert_eq!(
            dumps(&v, &DumpOptions::default()).unwrap(),
            "{\"a\": [1, 2.5, true, null], \"é\": \"x\\\"y\\n\\u0001\", \"e\": {}}"
        );
        let opts = DumpOptions {
            ensure_ascii: true,
            ..DumpOptions::default()
        };
        let v = Value::from("é😀");
        assert_eq!(dumps(&v, &opts).unwrap(), "\"\\u00e9\\ud83d\\ude00\"");
    }

    #[test]
    fn dumps_with_indent_matches_python() {
        // json.dumps({"a": [1, {}], "b": {"c": None}}, indent=2)
        let v = Value::from_serialize_json(r#"{"a": [1, {}], "b": {"c": null}}"#);
        let opts = DumpOptions {
            indent: Some("  ".into()),
            item_sep: ",".into(),
            ..DumpOptions::default()
        };
        assert_eq!(
            dumps(&v, &opts).unwrap(),
            "{\n  \"a\": [\n    1,\n    {}\n  ],\n  \"b\": {\n    \"c\": null\n  }\n}"
        );
    }

    #[test]
    fn repr_matches_python() {
        let v =
            Value::from_serialize_json(r#"{"k": "it's", "n": null, "b": false, "l": [1, "a"]}"#);
        assert_eq!(
            py_str(&v),
            "{'k': \"it's\", 'n': None, 'b': False, 'l': [1, 'a']}"
        );
    }

    trait FromJson {
        fn from_serialize_json(s: &str) -> Value;
    }
    impl FromJson for Value {
        fn from_serialize_json(s: &str) -> Value {
            crate::template::json_to_value(&serde_json::from_str(s).unwrap())
        }
    }
}
