use crate::Family;

/// One piece of streamed output, split: reasoning (inside the family's reasoning block) and the
/// content after it. Either may be empty.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Split {
    /// Text of the reasoning block (markers and the newlines around them dropped).
    pub reasoning: String,
    /// Text after the block (the visible answer).
    pub content: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Nothing but whitespace and part of the open marker seen yet.
    Start,
    /// Inside the block, before any reasoning text (leading newlines are dropped).
    ReasoningStart,
    Reasoning,
    /// After the block, before any content (the newlines after the close marker are dropped).
    ContentStart,
    Content,
}

/// Splits a reply into its reasoning block and its content, by the family's markers
/// ([`Family::reasoning_markers`]), as vLLM's reasoning parsers and llama-server's
/// `reasoning_content` do: `<think>…</think>` (Qwen 3.6, DeepSeek-V4, Maple) and Gemma 4's
/// `<|channel>thought…<channel|>`.
///
/// The block is either left open by the prompt (the generation prompt ends with the open
/// marker: Qwen 3.6 and DeepSeek-V4 with thinking on, Maple always), or opened by the model as
/// the first thing it writes (Gemma 4 with thinking on). Text after the close marker is content;
/// a block that never closes is all reasoning. The newlines the templates write inside and after
/// the markers are dropped. A family without markers, or output that does not start with the
/// open marker, is all content. The result does not depend on how the text is chunked: a marker
/// split across pushes is held back until it is complete.
#[derive(Debug, Clone)]
pub struct ReasoningParser {
    markers: Option<(&'static str, &'static str)>,
    state: State,
    /// Text held back: a possible start of the open marker, or trailing newlines and a possible
    /// start of the close marker.
    held: String,
    reasoning: String,
}

impl ReasoningParser {
    /// A parser for `family`'s output; `open`: the prompt ends inside the reasoning block.
    pub fn new(family: Family, open: bool) -> Self {
        let markers = family.reasoning_markers();
        let state = match (markers, open) {
            (None, _) => State::Content,
            (Some(_), true) => State::ReasoningStart,
            (Some(_), false) => State::Start,
        };
        ReasoningParser {
            markers,
            state,
            held: String::new(),
            reasoning: String::new(),
        }
    }

    /// Whether `prompt` (a rendered chat prompt) ends inside `family`'s reasoning block: its last
    /// non-whitespace text is the open marker.
    pub fn prompt_leaves_open(family: Family, prompt: &str) -> bool {
        family
            .reasoning_markers()
            .is_some_and(|(open, _)| prompt.trim_end().ends_with(open))
    }

    /// Whether the output is inside the reasoning block now.
    pub fn in_reasoning(&self) -> bool {
        matches!(self.state, State::ReasoningStart | State::Reasoning)
    }

    /// All reasoning text passed on so far.
    pub fn reasoning(&self) -> &str {
        &self.reasoning
    }

    /// Adds the next chunk of output; returns what can be passed on now.
    pub fn push(&mut self, text: &str) -> Split {
        let mut out = Split::default();
        let Some((open, close)) = self.markers else {
            out.content.push_str(text);
            return out;
        };
        self.held.push_str(text);
        loop {
            match self.state {
                State::Start => {
                    let t = self.held.trim_start();
                    if let Some(rest) = t.strip_prefix(open) {
                        self.held = rest.to_string();
                        self.state = State::ReasoningStart;
                    } else if open.starts_with(t) {
                        return out; // whitespace, or the open marker so far
                    } else {
                        self.state = State::Content;
                    }
                }
                State::ReasoningStart => {
                    if !self.skip_newlines(State::Reasoning) {
                        return out;
                    }
                }
                State::Reasoning => {
                    if let Some(at) = self.held.find(close) {
                        let rest = self.held[at + close.len()..].to_string();
                        self.emit_reasoning(&mut out, at, true);
                        self.held = rest;
                        self.state = State::ContentStart;
                        continue;
                    }
                    let keep = held_back(&self.held, close);
                    self.emit_reasoning(&mut out, self.held.len() - keep, false);
                    return out;
                }
                State::ContentStart => {
                    if !self.skip_newlines(State::Content) {
                        return out;
                    }
                }
                State::Content => {
                    out.content.push_str(&self.held);
                    self.held.clear();
                    return out;
                }
            }
        }
    }

    /// The end of the output: what is still held back is passed on (an unfinished marker is text).
    pub fn finish(&mut self) -> Split {
        let mut out = Split::default();
        let held = std::mem::take(&mut self.held);
        match self.state {
            State::Start => out.content = held,
            State::ReasoningStart | State::Reasoning => {
                let t = held.trim_end_matches('\n');
                self.reasoning.push_str(t);
                out.reasoning = t.to_string();
            }
            State::ContentStart | State::Content => out.content = held,
        }
        out
    }

    /// Drops the newlines that start what is held; once other text follows them, moves to
    /// `next` and returns `true` (`false`: only newlines so far).
    fn skip_newlines(&mut self, next: State) -> bool {
        let t = self.held.trim_start_matches('\n');
        if t.is_empty() {
            self.held.clear();
            return false;
        }
        self.held = t.to_string();
        self.state = next;
        true
    }

    /// Passes on `held[..end]` as reasoning; at the close marker (`closing`) without the
    /// newlines before it.
    fn emit_reasoning(&mut self, out: &mut Split, end: usize, closing: bool) {
        let mut text = &self.held[..end];
        if closing {
            text = text.trim_end_matches('\n');
        }
        self.reasoning.push_str(text);
        out.reasoning.push_str(text);
        self.held.drain(..end);
    }
}

/// How many bytes at the end of `s` may still turn into newlines before `close` or the start of
/// `close`: trailing newlines plus the longest suffix that is a prefix of `close`.
fn held_back(s: &str, close: &str) -> usize {
    let partial = (1..close.len().min(s.len() + 1))
        .rev()
        .find(|&n| s.is_char_boundary(s.len() - n) && close.starts_with(&s[s.len() - n..]))
        .unwrap_or(0);
    let before = &s[..s.len() - partial];
    partial + (before.len() - before.trim_end_matches('\n').len())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (reasoning, content) of `pieces` pushed one by one, then finished.
    fn run(family: Family, open: bool, pieces: &[&str]) -> (String, String) {
        let mut p = ReasoningParser::new(family, open);
        let (mut r, mut c) = (String::new(), String::new());
        for piece in pieces {
            let s = p.push(piece);
            r += &s.reasoning;
            c += &s.content;
        }
        let s = p.finish();
        assert_eq!(p.reasoning(), r + &s.reasoning);
        (p.reasoning().to_string(), c + &s.content)
    }

    /// Every split of `text` into single characters gives the same result as the whole.
    fn same_by_chars(family: Family, open: bool, text: &str) -> (String, String) {
        let whole = run(family, open, &[text]);
        let chars: Vec<String> = text.chars().map(String::from).collect();
        let refs: Vec<&str> = chars.iter().map(String::as_str).collect();
        assert_eq!(run(family, open, &refs), whole, "{text:?} by characters");
        whole
    }

    #[test]
    fn an_open_block_is_reasoning_until_the_close_marker_whatever_the_chunking() {
        // Qwen 3.6 with thinking on: the prompt ends with `<think>\n`.
        let (r, c) = same_by_chars(
            Family::Qwen3_5Moe,
            true,
            "Let me think.\n\nOK.\n</think>\n\nThe answer\n\nis 4.",
        );
        assert_eq!(r, "Let me think.\n\nOK.");
        assert_eq!(c, "The answer\n\nis 4.");
        assert_eq!(
            run(Family::Maple, true, &["Let me </th", "ink>", "\n", "\nOK"]),
            ("Let me ".into(), "OK".into())
        );
        let mut p = ReasoningParser::new(Family::Maple, true);
        assert_eq!(p.push("never closes").content, "");
        assert!(p.in_reasoning());
        assert_eq!(run(Family::Maple, true, &["never </thi"]).0, "never </thi");
    }

    #[test]
    fn gemma_opens_its_thought_channel_itself() {
        let (r, c) = same_by_chars(
            Family::Gemma4,
            false,
            "<|channel>thought\nThe user greets.<channel|>Hello!",
        );
        assert_eq!((r.as_str(), c.as_str()), ("The user greets.", "Hello!"));
        // Without the channel, all of it is the answer (thinking off, or the model skipped it).
        assert_eq!(
            same_by_chars(Family::Gemma4, false, "\n\nHello <|channel> there"),
            (String::new(), "\n\nHello <|channel> there".into())
        );
        // A reply that is only the start of the marker stays text at the end.
        assert_eq!(
            run(Family::Gemma4, false, &["<|chan"]),
            (String::new(), "<|chan".into())
        );
    }

    #[test]
    fn a_closed_block_in_the_prompt_leaves_the_output_as_content() {
        // Qwen 3.6 with thinking off ends the prompt with an empty, closed block.
        assert_eq!(
            same_by_chars(Family::Qwen3_5Moe, false, "</think>\n\nx"),
            (String::new(), "</think>\n\nx".into())
        );
        // The model may still open one itself.
        assert_eq!(
            same_by_chars(Family::DeepseekV4, false, "<think>a</think>b"),
            ("a".into(), "b".into())
        );
        assert_eq!(
            same_by_chars(Family::Inkling, true, "<think>a</think>b"),
            (String::new(), "<think>a</think>b".into())
        );
    }

    #[test]
    fn the_prompt_tells_whether_the_block_is_open() {
        let open = |f, p| ReasoningParser::prompt_leaves_open(f, p);
        assert!(open(Family::Qwen3_5Moe, "<|im_start|>assistant\n<think>\n"));
        assert!(!open(
            Family::Qwen3_5Moe,
            "<|im_start|>assistant\n<think>\n\n</think>\n\n"
        ));
        assert!(open(Family::DeepseekV4, "<｜Assistant｜><think>"));
        assert!(!open(Family::Gemma4, "<|turn>model\n"));
        assert!(!open(Family::Inkling, "<think>"));
    }
}
