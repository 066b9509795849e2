use crate::Tokenizer;

/// Incremental detokenizer: push generated ids one at a time and get the text they complete.
///
/// Prefix-diff, as mlx-lm's `StreamingDetokenizer` and HF `tokenizers`' `DecodeStream`: the ids
/// since the last emitted boundary are decoded together with a few earlier ids of context, and
/// only the new suffix is emitted. Text that ends in U+FFFD (an incomplete byte-fallback or
/// byte-level UTF-8 sequence) is held back until a later id completes the character, so a chunk
/// never splits a multi-byte character. Concatenating every [`push`](Self::push) and the final
/// [`finish`](Self::finish) gives `tok.decode(all_ids, skip_special)`.
pub struct StreamingDetokenizer<'t> {
    tok: &'t Tokenizer,
    skip_special: bool,
    ids: Vec<u32>,
    /// Start of the decode window (context ids that are already emitted).
    prefix_offset: usize,
    /// End of the already-emitted ids.
    read_offset: usize,
    /// Total text emitted so far.
    emitted: String,
}

impl<'t> StreamingDetokenizer<'t> {
    /// A detokenizer that drops special tokens (`<turn|>`, `<|im_end|>`, ...) from the text, as
    /// `decode(ids, skip_special = true)`.
    pub fn new(tok: &'t Tokenizer) -> Self {
        Self::with_skip_special(tok, true)
    }

    /// A detokenizer with an explicit `skip_special` (use `false` to keep markers such as Gemma's
    /// `<|channel>` or DeepSeek's `</think>` that a later parser needs).
    pub fn with_skip_special(tok: &'t Tokenizer, skip_special: bool) -> Self {
        StreamingDetokenizer {
            tok,
            skip_special,
            ids: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
            emitted: String::new(),
        }
    }

    /// Adds one generated id; returns the text it completes (often empty, never a partial
    /// character).
    pub fn push(&mut self, id: u32) -> String {
        self.ids.push(id);
        let prefix = self.decode(self.prefix_offset, self.read_offset);
        let full = self.decode(self.prefix_offset, self.ids.len());
        if full.len() <= prefix.len() || full.ends_with('\u{FFFD}') {
            return String::new();
        }
        let new = match full.strip_prefix(prefix.as_str()) {
            Some(new) => new.to_string(),
            // The context window decoded differently on its own (a decoder that looks at
            // neighbours); fall back to diffing the full decode against what was emitted.
            None => {
                let all = self.decode(0, self.ids.len());
                match all.strip_prefix(self.emitted.as_str()) {
                    Some(new) if !new.is_empty() => new.to_string(),
                    _ => return String::new(),
                }
            }
        };
        {
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            self.emitted.push_str(&new);
            new
        }
    }

    /// Ends the stream: returns whatever is still held back (for example a byte sequence that never
    /// became valid UTF-8, which decodes to U+FFFD) and resets the detokenizer.
    pub fn finish(&mut self) -> String {
        let all = self.decode(0, self.ids.len());
        let rest = match all.strip_prefix(self.emitted.as_str()) {
            Some(rest) => rest.to_string(),
            // The window decode disagreed with the full decode; emit what is past the emitted length.
            None => all
                .get(self.emitted.len()..)
                .map(str::to_string)
                .unwrap_or_default(),
        };
        self.ids.clear();
        self.prefix_offset = 0;
        self.read_offset = 0;
        self.emitted.clear();
        rest
    }

    /// The ids pushed since creation or the last [`finish`](Self::finish).
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    fn decode(&self, from: usize, to: usize) -> String {
        if from >= to {
            return String::new();
        }
        self.tok
            .decode(&self.ids[from..to], self.skip_special)
            .unwrap_or_default()
    }
}
