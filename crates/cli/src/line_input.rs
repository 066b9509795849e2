//! The input of `run --chat`: at a terminal, a line editor (rustyline) in raw mode, so a
//! message has no length limit (a terminal's cooked mode cuts a line at ~4 KiB without a
//! word), pasted text arrives whole as one message (bracketed paste), Alt-Enter or a `"""` block
//! types several lines, and Up/Down recall earlier messages; from a pipe or a file, one line at
//! a time, as bytes, so a line that is not UTF-8 is refused rather than lost with the rest.

use std::io::{BufRead, IsTerminal};

use anyhow::Result;
use rustyline::error::ReadlineError;
use rustyline::history::DefaultHistory;
use rustyline::validate::{ValidationContext, ValidationResult, Validator};
use rustyline::{Cmd, Config, Editor, KeyCode, KeyEvent, Modifiers};

/// What one read gave.
pub(crate) enum Line {
    /// A message or command, without its final line break.
    Text(String),
    /// A piped line that is not UTF-8 (nothing of it is used).
    NotUtf8,
    /// End of input (Ctrl-D at an empty prompt, or the end of the pipe).
    Eof,
    /// Ctrl-C at the prompt.
    Interrupted,
}

/// Where chat input comes from.
pub(crate) enum Input {
    Editor(Box<Editor<Multiline, DefaultHistory>>),
    Piped(Vec<u8>),
}

/// The delimiter of a block typed over several lines (as `ollama run` has it).
const BLOCK: &str = "\"\"\"";

/// Accepts a line unless it opens a `"""` block that is not closed yet (Enter then adds a line).
pub(crate) struct Multiline;

impl Validator for Multiline {
    fn validate(&self, ctx: &mut ValidationContext) -> rustyline::Result<ValidationResult> {
        let t = ctx.input().trim();
        let open = t.starts_with(BLOCK) && (t.len() < 2 * BLOCK.len() || !t.ends_with(BLOCK));
        Ok(if open {
            ValidationResult::Incomplete
        } else {
            ValidationResult::Valid(None)
        })
    }
}

impl rustyline::completion::Completer for Multiline {
    type Candidate = String;
}
impl rustyline::hint::Hinter for Multiline {
    type Hint = String;
}
impl rustyline::highlight::Highlighter for Multiline {}
impl rustyline::Helper for Multiline {}

impl Input {
    /// The line editor when stdin is a terminal that can edit, else the byte reader (rustyline
    /// reads the terminals it cannot drive, `TERM=dumb` and the like, line by line too).
    pub(crate) fn new() -> Result<Input> {
        let term = std::env::var("TERM").unwrap_or_default();
        let dumb = ["dumb", "cons25", "emacs"].contains(&term.as_str());
        if !std::io::stdin().is_terminal() || dumb {
            return Ok(Input::Piped(Vec::new()));
        }
        let config = Config::builder()
            .auto_add_history(true)
            .bracketed_paste(true)
            .max_history_size(1000)?
            .build();
        let mut editor = Editor::with_config(config)?;
        editor.set_helper(Some(Multiline));
        editor.bind_sequence(KeyEvent(KeyCode::Enter, Modifiers::ALT), Cmd::Newline);
        Ok(Input::Editor(Box::new(editor)))
    }

    /// Reads the next message after showing `prompt`.
    pub(crate) fn read(&mut self, prompt: &str) -> Result<Line> {
        match self {
            Input::Editor(editor) => match editor.readline(prompt) {
                Ok(text) => Ok(Line::Text(unblock(&text))),
                Err(ReadlineError::Eof) => Ok(Line::Eof),
                Err(ReadlineError::Interrupted) => Ok(Line::Interrupted),
                Err(e) => Err(e.into()),
            },
            Input::Piped(bytes) => {
                eprint!("{prompt}");
                bytes.clear();
                if std::io::stdin().lock().read_until(b'\n', bytes)? == 0 {
                    return Ok(Line::Eof);
                }
                Ok(match std::str::from_utf8(bytes) {
                    Ok(line) => Line::Text(line.trim_end_matches(['\n', '\r']).to_string()),
                    Err(_) => Line::NotUtf8,
                })
            }
        }
    }
}

/// The text of a `"""` block without its delimiters (and the line breaks next to them); any
/// other input unchanged.
fn unblock(text: &str) -> String {
    let t = text.trim();
    match t
        .strip_prefix(BLOCK)
        .and_then(|t| t.strip_suffix(BLOCK))
        .filter(|_| t.len() >= 2 * BLOCK.len())
    {
        Some(inner) => inner.trim_matches(['\n', '\r']).to_string(),
        None => text.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_lose_their_delimiters_and_other_text_is_kept() {
        assert_eq!(
            unblock("\"\"\"\nline one\nline two\n\"\"\""),
            "line one\nline two"
        );
        assert_eq!(unblock("\"\"\"one line\"\"\""), "one line");
        assert_eq!(unblock("  keep \"\"\" this  "), "  keep \"\"\" this  ");
        assert_eq!(unblock("\"\"\""), "\"\"\"");
    }
}
