use crate::Family;

/// Hides a reasoning block that the generation prompt left open (Maple's template ends with
/// `<|im_start|>assistant\n<think>\n`, as the original runs it): streamed text is held back until
/// the family's closing marker (`</think>`) appears, then only what follows it is passed on, without
/// the newlines the template writes after the marker. Reasoning that never closes shows nothing. A
/// family without an open reasoning block passes everything through. The result does not depend on
/// how the text is chunked (the marker may be split across pushes).
#[derive(Debug, Clone)]
pub struct ReasoningGate {
    close: Option<&'static str>,
    /// The reasoning so far (everything before the marker), kept for callers that report it.
    reasoning: String,
    /// Text after the marker has started (leading newlines are still being dropped until then).
    content_started: bool,
}

impl ReasoningGate {
    /// A gate for `family` ([`Family::open_reasoning_close`]).
    pub fn new(family: Family) -> Self {
        let close = family.open_reasoning_close();
        ReasoningGate {
            close,
            reasoning: String::new(),
            content_started: close.is_none(),
        }
    }

    /// Whether the reasoning block is still open (text is being hidden).
    pub fn in_reasoning(&self) -> bool {
        self.close.is_some()
    }

    /// The hidden reasoning text seen so far (a marker split across pushes included until complete).
    pub fn reasoning(&self) -> &str {
        &self.reasoning
    }

    /// Adds the next chunk of generated text; returns what can be shown.
    pub fn push(&mut self, text: &str) -> String {
        if let Some(close) = self.close {
            self.reasoning.push_str(text);
            let Some(at) = self.reasoning.find(close) else {
                return String::new();
            };
            let rest = self.reasoning[at + close.len()..].to_string();
            self.reasoning.truncate(at);
            self.close = None;
            return self.content(&rest);
        }
        self.content(text)
    }

    /// Drops the newlines between the marker and the first content.
    fn content(&mut self, text: &str) -> String {
        if self.content_started {
            return text.to_string();
        }
        let t = text.trim_start_matches('\n');
        self.content_started = !t.is_empty();
        t.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(family: Family, pieces: &[&str]) -> String {
        let mut g = ReasoningGate::new(family);
        pieces.iter().map(|p| g.push(p)).collect()
    }

    #[test]
    fn maple_hides_reasoning_until_the_marker_whatever_the_chunking() {
        let text = "Let me think.\n</think>\n\nThe answer\n\nis 4.";
        let whole = run(Family::Maple, &[text]);
        assert_eq!(whole, "The answer\n\nis 4.");
        let chars: Vec<String> = text.chars().map(String::from).collect();
        let refs: Vec<&str> = chars.iter().map(String::as_str).collect();
        assert_eq!(run(Family::Maple, &refs), whole);
        assert_eq!(
            run(Family::Maple, &["Let me </th", "ink>", "\n", "\nOK"]),
            "OK"
        );
        let mut g = ReasoningGate::new(Family::Maple);
        assert_eq!(g.push("never closes"), "");
        assert!(g.in_reasoning());
        assert_eq!(g.reasoning(), "never closes");
    }

    #[test]
    fn families_without_an_open_block_pass_everything() {
        assert_eq!(run(Family::Qwen3_5Moe, &["</think>\n\nx"]), "</think>\n\nx");
        assert_eq!(run(Family::Gemma4, &["\n\nhi"]), "\n\nhi");
    }
}
