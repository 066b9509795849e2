use crate::{Family, Tokenizer};

/// The ids that end generation for `family`: the ids of [`Family::stop_tokens`] (Gemma `<eos>`
/// (1), `<turn|>` (106), `<|tool_response>` (50); ChatML `<|im_end|>`, `<|endoftext|>`;
/// DeepSeek `<｜end▁of▁sentence｜>`; Inkling `<|content_model_end_sampling|>`). Tokens missing
/// from `tok` are left out, so the list may be shorter than that (never longer).
pub fn stop_token_ids(family: Family, tok: &Tokenizer) -> Vec<u32> {
    let names = family.stop_tokens();
    let mut ids = Vec::with_capacity(names.len());
    for id in names.iter().filter_map(|n| tok.token_id(n)) {
        if !ids.contains(&id) {
            ids.push(id);
        }
    }
    ids
}

/// User stop strings over streamed text (`--stop`, the API's `stop`).
///
/// Text is held back while its tail could still be the start of a stop string; once a stop string
/// appears, the text before it is emitted and the stop string and everything after it are
/// dropped. The result does not depend on how the text is chunked (a stop string may be split
/// across pushes): generation stops where the first stop string completes.
#[derive(Debug, Clone)]
pub struct StopStrings {
    stops: Vec<String>,
    held: String,
    stopped: bool,
}

impl StopStrings {
    /// Watches for `stops`; empty strings are ignored.
    pub fn new(stops: Vec<String>) -> Self {
        StopStrings {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
            stopped: false,
        }
    }

    /// Adds the next chunk of generated text. Returns the text that can be shown now and whether a
    /// stop string has been seen (then generation should end; later pushes return `("", true)`).
    pub fn push(&mut self, text: &str) -> (String, bool) {
        if self.stopped {
            return (String::new(), true);
        }
        self.held.push_str(text);
        // Generation stops at the first stop string to *complete* (as if the text came one
        // character at a time, so the result does not depend on chunking); among stops that
        // complete at the same point, the longest one is cut.
        let first_end = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()).map(|at| at + s.len()))
            .min();
        if let Some(end) = first_end {
            let at = self
                .stops
                .iter()
                .filter(|s| s.len() <= end && self.held[..end].ends_with(s.as_str()))
                .map(|s| end - s.len())
                .min()
                .unwrap_or(end);
            let out = self.held[..at].to_string();
            self.held.clear();
            self.stopped = true;
            return (out, true);
        }
        let keep = self.longest_partial_suffix();
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        (out, false)
    }

    /// Ends the stream: returns the held-back text (a tail that turned out not to be a stop string);
    /// empty after a stop.
    pub fn finish(&mut self) -> String {
        if self.stopped {
            return String::new();
        }
        std::mem::take(&mut self.held)
    }

    /// Whether a stop string has been seen.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Length in bytes of the longest tail of `held` that is a proper prefix of a stop string.
    fn longest_partial_suffix(&self) -> usize {
        let held = self.held.as_str();
        let longest = self.stops.iter().map(String::len).max().unwrap_or(0);
        let first = held.len().saturating_sub(longest.saturating_sub(1));
        // Scan start positions from the left so the first hit is the longest tail; only char
        // boundaries can start a prefix of a (valid UTF-8) stop string.
        for (start, _) in held.char_indices().filter(|(i, _)| *i >= first) {
            let tail = &held[start..];
            if self
                .stops
                .iter()
                .any(|s| s.len() > tail.len() && s.starts_with(tail))
            {
                return tail.len();
            }
        }
        0
    }
}
