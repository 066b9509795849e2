//! Constrained decoding: a response format (any JSON object, or JSON matching a schema) compiled
//! by llguidance (the library llama.cpp uses) into a matcher that says, before each sampled
//! token, which token ids keep the output a prefix of a valid reply.
//!
//! The mask is applied to the logits row before repetition penalty, top-p, top-k and
//! temperature, and before greedy argmax: a constrained request never takes the fused
//! head-argmax path (`Want::Argmax`), since the full `[vocab]` row must be read back to mask it.
//! The stop ids of the family are allowed exactly when the grammar accepts the output so far.

use std::sync::Arc;
use std::time::{Duration, Instant};

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use mference_text::TokenBytes;
use serde_json::{json, Value};
use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

use crate::{SessionError, TextSide};

/// What the reply must be (the OpenAI `response_format`).
#[derive(Debug, Clone, PartialEq)]
pub enum ResponseFormat {
    /// `{"type": "json_object"}`: one JSON object.
    JsonObject,
    /// `{"type": "json_schema", "json_schema": {"schema": …, "strict": …}}`: JSON valid under
    /// `schema` (JSON Schema; the subset llguidance implements, `docs/json_schema.md` upstream).
    /// `strict: false` compiles leniently: keywords llguidance does not implement are ignored
    /// (with a warning) instead of refusing the schema, so such a reply may not validate.
    JsonSchema {
        /// The schema object.
        schema: Value,
        /// OpenAI's `strict`.
        strict: bool,
    },
}

/// The grammar compiler of one vocabulary: built once per text side, on first use.
pub(crate) struct Grammars {
    factory: ParserFactory,
    /// How long building the token trie and the factory took.
    built_in: Duration,
}

/// The vocabulary as llguidance sees it: each id's bytes, control tokens marked special.
struct VocabEnv {
    trie: TokTrie,
}

impl TokenizerEnv for VocabEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    /// Greedy longest-match over the trie. llguidance tokenizes only to compute forced tokens,
    /// which this crate does not use; [`Self::tokenize_is_canonical`] says so.
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.greedy_tokenize(s)
    }

    fn tokenize_is_canonical(&self) -> bool {
        false
    }
}

impl Grammars {
    fn build(text: &TextSide) -> Result<Self, String> {
        let t0 = Instant::now();
        let bytes = text
            .tokenizer
            .token_bytes()
            .map_err(|e| format!("this tokenizer cannot be constrained: {e}"))?;
        let words: Vec<Vec<u8>> = bytes
            .into_iter()
            .map(|b| match b {
                TokenBytes::Text(b) => b,
                TokenBytes::Special(name) => {
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend_from_slice(name.as_bytes());
                    w
                }
            })
            .collect();
        let eos = text
            .stop_ids
            .first()
            .copied()
            .or(text.tokenizer.eos_id())
            .ok_or("this tokenizer has no stop token to end a constrained reply with")?;
        let info = TokRxInfo::new(words.len() as u32, eos);
        let mut trie = TokTrie::from(&info, &words);
        if text.stop_ids.len() > 1 {
            trie = trie.with_eos_tokens(&text.stop_ids);
        }
        let env: TokEnv = Arc::new(VocabEnv { trie });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        factory.quiet();
        Ok(Grammars {
            factory,
            built_in: t0.elapsed(),
        })
    }
}

/// A compiled response format for one request: feed it every generated token.
pub struct Constraint {
    matcher: Matcher,
    /// Time to compile the grammar for this request (the vocabulary index excluded).
    pub compile: Duration,
    /// Time spent computing masks so far.
    pub mask_time: Duration,
    /// Masks computed so far.
    pub masks: usize,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("compile", &self.compile)
            .field("masks", &self.masks)
            .finish()
    }
}

/// The llguidance options every format compiles with: compact JSON (no whitespace between
/// tokens, so a weak model cannot fill its budget with blanks) and, for non-strict schemas,
/// lenient keyword handling. A schema's own `x-guidance` object wins.
fn with_options(mut schema: Value, lenient: bool) -> Value {
    if let Value::Object(o) = &mut schema {
        o.entry("x-guidance")
            .or_insert_with(|| json!({"whitespace_flexible": false, "lenient": lenient}));
    }
    schema
}

impl TextSide {
    /// Builds the vocabulary index for constrained decoding now instead of on the first
    /// constrained request; returns how long it took (a second call returns the first's time).
    ///
    /// Errors: [`SessionError::Constraint`] when the tokenizer's bytes cannot be known.
    pub fn prepare_constraints(&self) -> Result<Duration, SessionError> {
        self.grammars
            .get_or_init(|| Grammars::build(self))
            .as_ref()
            .map(|g| g.built_in)
            .map_err(|e| SessionError::Constraint(e.clone()))
    }

    /// Compiles `format` into a [`Constraint`] for one generation.
    ///
    /// Errors: [`SessionError::Schema`] with llguidance's reason when the schema does not
    /// compile (unsupported or unsatisfiable keywords, a bad `$ref`, not an object);
    /// [`SessionError::Constraint`] when the vocabulary cannot be indexed. A prompt that leaves a
    /// reasoning block open cannot take a constraint ([`Session::generate`](crate::Session::generate)
    /// refuses it).
    pub fn compile(&self, format: &ResponseFormat) -> Result<Constraint, SessionError> {
        self.prepare_constraints()?;
        let Some(Ok(g)) = self.grammars.get() else {
            unreachable!("prepare_constraints built the grammars")
        };
        let schema = match format {
            ResponseFormat::JsonObject => with_options(json!({"type": "object"}), false),
            ResponseFormat::JsonSchema { schema, strict } => {
                if !schema.is_object() {
                    return Err(SessionError::Schema(
                        "the schema must be a JSON object".into(),
                    ));
                }
                with_options(schema.clone(), !strict)
            }
        };
        let t0 = Instant::now();
        let parser = g
            .factory
            .create_parser(TopLevelGrammar::from_json_schema(schema))
            .map_err(|e| SessionError::Schema(first_line(&e.to_string())))?;
        let mut matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(SessionError::Schema(first_line(&e)));
        }
        // Some schemas compile but cannot produce a first token (a `$ref` loop): find out
        // before generating, so the request gets its 400.
        if let Err(e) = matcher.compute_mask_or_eos() {
            return Err(SessionError::Schema(first_line(&e.to_string())));
        }
        Ok(Constraint {
            matcher,
            compile: t0.elapsed(),
            mask_time: Duration::ZERO,
            masks: 0,
        })
    }
}

/// llguidance's message without the parser state it appends on the following lines (kept out
/// of error replies and the one-line request log).
fn first_line(e: &str) -> String {
    e.lines().next().unwrap_or("").trim().to_string()
}

impl Constraint {
    /// Sets every logit of `row` (`[vocab]`, the model's vocabulary, which may be longer than the
    /// tokenizer's) that the grammar does not allow next to `-inf`; the stop ids stay only if the
    /// output so far is complete.
    ///
    /// Errors: [`SessionError::Constraint`] when the matcher fails (a lexer limit) or allows
    /// nothing.
    pub fn mask(&mut self, row: &mut [f32]) -> Result<(), SessionError> {
        let t0 = Instant::now();
        let vob = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| SessionError::Constraint(first_line(&e.to_string())))?;
        if vob.is_zero() {
            return Err(SessionError::Constraint(
                "the grammar allows no token here".into(),
            ));
        }
        let words = vob.as_slice();
        for (w, chunk) in row.chunks_mut(32).enumerate() {
            let bits = words.get(w).copied().unwrap_or(0);
            if bits == u32::MAX {
                continue;
            }
            for (b, v) in chunk.iter_mut().enumerate() {
                if bits & (1 << b) == 0 {
                    *v = f32::NEG_INFINITY;
                }
            }
        }
        self.mask_time += t0.elapsed();
        self.masks += 1;
        Ok(())
    }

    /// Advances the grammar past the sampled token `id`.
    ///
    /// Errors: [`SessionError::Constraint`] when the grammar does not allow `id`.
    pub fn advance(&mut self, id: u32) -> Result<(), SessionError> {
        self.matcher
            .consume_token(id)
            .map_err(|e| SessionError::Constraint(first_line(&e.to_string())))
    }

    /// The output is complete and nothing but a stop token may follow.
    pub fn is_done(&self) -> bool {
        self.matcher.is_stopped()
    }
}
