//! Holds back streamed text from a tool-call marker on, for the family's tool-call parser.

/// Streams text until a tool-call marker shows up; from the marker on everything is held for the
/// parser, and a tail that could still become the marker is held until it cannot.
pub(crate) struct ToolGate {
    marker: Option<&'static str>,
    held: String,
    in_call: bool,
}

impl ToolGate {
    /// A gate for `marker`; `None` passes everything through.
    pub(crate) fn new(marker: Option<&'static str>) -> Self {
        ToolGate {
            marker,
            held: String::new(),
            in_call: false,
        }
    }

    pub(crate) fn push(&mut self, s: &str) -> String {
        let Some(marker) = self.marker else {
            return s.to_string();
        };
        self.held.push_str(s);
        if self.in_call {
            return String::new();
        }
        if let Some(i) = self.held.find(marker) {
            let out = self.held[..i].to_string();
            self.in_call = true;
            self.held.drain(..i);
            return out;
        }
        let n = self.held.len();
        let keep = (1..marker.len().min(n + 1))
            .rev()
            .find(|&k| self.held.is_char_boundary(n - k) && marker.starts_with(&self.held[n - k..]))
            .unwrap_or(0);
        self.held.drain(..n - keep).collect()
    }

    /// What is left to show at the end when the held text is a tool call.
    pub(crate) fn finish(&mut self) -> String {
        if self.in_call {
            String::new()
        } else {
            std::mem::take(&mut self.held)
        }
    }

    /// Everything held back, for output whose held text turned out not to be a tool call (cut
    /// by `max_tokens` or a stop string, or a marker written as prose).
    pub(crate) fn release(&mut self) -> String {
        self.in_call = false;
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gate_holds_back_a_partial_marker_and_everything_after_it() {
        let mut g = ToolGate::new(Some("<|tool_call>"));
        assert_eq!(g.push("Hello <|tool"), "Hello ");
        assert_eq!(g.push("_call>call:f{}"), "");
        assert_eq!(g.push(" more"), "");
        assert_eq!(g.finish(), "");
        let mut g = ToolGate::new(Some("<|tool_call>"));
        assert_eq!(g.push("a <|to"), "a ");
        assert_eq!(g.push("y"), "<|toy");
        assert_eq!(g.push("<"), "");
        assert_eq!(g.finish(), "<");
        // Not a call after all: everything held from the marker on comes back once.
        let mut g = ToolGate::new(Some("<|tool_call>"));
        assert_eq!(g.push("See <|tool_"), "See ");
        assert_eq!(g.push("call>call:f{"), "");
        assert_eq!(g.push("x"), "");
        assert_eq!(g.release(), "<|tool_call>call:f{x");
        assert_eq!(g.release(), "");
    }
}
