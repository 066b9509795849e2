//! A compact form of a BPE `tokenizer.json`, kept inside the install so that a start does not
//! parse 33 MB of JSON (Gemma 4's tokenizer took ~0.9 s of a ~1.1 s start).
//!
//! The cache holds the model's vocabulary as strings and its merges as pairs of vocabulary
//! entries, and everything else of `tokenizer.json` (normalizer, pre-tokenizer, post-processor,
//! decoder, added tokens, the BPE options) as the JSON it was. It is bound to the SHA-256 of the
//! `tokenizer.json` it was made from and carries the SHA-256 of its own payload: a cache whose
//! digests do not match is never used, and the tokenizer is then parsed from `tokenizer.json`
//! and the cache written again. From the cache the tokenizer is built by the same steps as the
//! `tokenizers` crate's own deserializer (its `tokenizer/serialization.rs`: model, parts, then
//! the added tokens); the tests check that both give the same serialized tokenizer on every
//! bundled tokenizer.
//!
//! Layout (little-endian): magic `MFTOKC01`, the tokenizer.json SHA-256 (64 hex bytes), the
//! payload SHA-256 (64 hex bytes), then the payload: `u64` length + the JSON without
//! `model.vocab` / `model.merges`; `u32` entry count, per entry `u32` id and `u32` byte length,
//! `u64` length + the entries' strings back to back; `u32` merge count, per merge two `u32`
//! entry indices.

use std::collections::HashMap;

use mference_format::hash::sha256_hex;
use serde::Deserialize;
use serde_json::Value;
use tokenizers::models::bpe::{BpeBuilder, Merges, Vocab, BPE};
use tokenizers::{
    AddedToken, DecoderWrapper, NormalizerWrapper, PaddingParams, PostProcessorWrapper,
    PreTokenizerWrapper, TokenizerBuilder, TruncationParams,
};

const MAGIC: &[u8; 8] = b"MFTOKC01";
const HEADER: usize = 8 + 64 + 64;

/// The compact form of `json` (a `tokenizer.json` whose SHA-256 is `json_sha256`), or why it
/// has none: only a BPE model in the current layout (`"type": "BPE"`, merges as pairs or as
/// `"a b"` lines, every merge part in the vocabulary) is cached; anything else is loaded from
/// the JSON every time.
pub(crate) fn encode(json: &[u8], json_sha256: &str) -> Result<Vec<u8>, String> {
    let mut root: Value = serde_json::from_slice(json).map_err(|e| e.to_string())?;
    let model = root
        .get_mut("model")
        .and_then(Value::as_object_mut)
        .ok_or("no model object")?;
    if model.get("type").and_then(Value::as_str) != Some("BPE") {
        return Err("the model is not a BPE with a \"type\" field".into());
    }
    let vocab = match model.shift_remove("vocab") {
        Some(Value::Object(v)) => v,
        _ => return Err("model.vocab is not an object".into()),
    };
    let merges = match model.shift_remove("merges") {
        Some(Value::Array(m)) => m,
        _ => return Err("model.merges is not an array".into()),
    };
    let mut entries = Vec::with_capacity(vocab.len());
    let mut index: HashMap<&str, u32> = HashMap::with_capacity(vocab.len());
    for (i, (token, id)) in vocab.iter().enumerate() {
        let id = id
            .as_u64()
            .and_then(|v| u32::try_from(v).ok())
            .ok_or_else(|| format!("vocabulary id of {token:?} is not a u32"))?;
        entries.push((id, token.as_str()));
        index.insert(token, i as u32);
    }
    let find = |s: &str| {
        index
            .get(s)
            .copied()
            .ok_or_else(|| format!("merge part {s:?} is not in the vocabulary"))
    };
    let mut pairs = Vec::with_capacity(merges.len());
    let legacy = merges.first().is_some_and(Value::is_string);
    for m in &merges {
        let (a, b) = match (legacy, m) {
            // `convert_merges_to_hashmap` of tokenizers' models/bpe/model.rs.
            (true, Value::String(s)) if s.starts_with("#version") => continue,
            (true, Value::String(s)) => match s.split(' ').collect::<Vec<_>>()[..] {
                [a, b] => (a, b),
                _ => return Err(format!("merge {s:?} is not two parts")),
            },
            (false, Value::Array(p)) => match &p[..] {
                [Value::String(a), Value::String(b)] => (a.as_str(), b.as_str()),
                _ => return Err("a merge is not a pair of strings".into()),
            },
            _ => return Err("merges mix two forms".into()),
        };
        pairs.push((find(a)?, find(b)?));
    }
    let rest = serde_json::to_vec(&root).map_err(|e| e.to_string())?;
    let mut payload = Vec::new();
    payload.extend_from_slice(&(rest.len() as u64).to_le_bytes());
    payload.extend_from_slice(&rest);
    payload.extend_from_slice(&(entries.len() as u32).to_le_bytes());
    let mut strings = Vec::new();
    for (id, token) in &entries {
        payload.extend_from_slice(&id.to_le_bytes());
        payload.extend_from_slice(&(token.len() as u32).to_le_bytes());
        strings.extend_from_slice(token.as_bytes());
    }
    payload.extend_from_slice(&(strings.len() as u64).to_le_bytes());
    payload.extend_from_slice(&strings);
    payload.extend_from_slice(&(pairs.len() as u32).to_le_bytes());
    for (a, b) in &pairs {
        payload.extend_from_slice(&a.to_le_bytes());
        payload.extend_from_slice(&b.to_le_bytes());
    }
    let mut out = Vec::with_capacity(HEADER + payload.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(json_sha256.as_bytes());
    out.extend_from_slice(sha256_hex(&payload).as_bytes());
    out.extend_from_slice(&payload);
    Ok(out)
}

/// Why a cache was not used.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Stale {
    /// Not a cache of this format (or too short to be one).
    Format,
    /// Made from another `tokenizer.json`.
    OtherSource,
    /// The payload does not match its digest (a damaged file).
    Damaged,
    /// The digests match but the payload does not decode (written by another version).
    Invalid(String),
}

impl std::fmt::Display for Stale {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Stale::Format => write!(f, "of another format or version"),
            Stale::OtherSource => write!(f, "made from another tokenizer.json"),
            Stale::Damaged => write!(f, "damaged (its payload does not match its SHA-256)"),
            Stale::Invalid(why) => write!(f, "unreadable ({why})"),
        }
    }
}

/// The tokenizer in `cache` and the SHA-256 of the `tokenizer.json` it was made from (the caller
/// compares it with the file's), if `cache` is one of this format and its payload matches its
/// digest.
pub(crate) fn decode(cache: &[u8]) -> Result<(String, tokenizers::Tokenizer), Stale> {
    if cache.len() < HEADER || &cache[..8] != MAGIC {
        return Err(Stale::Format);
    }
    let bound = std::str::from_utf8(&cache[8..72]).map_err(|_| Stale::Format)?;
    let payload = &cache[HEADER..];
    if &cache[72..HEADER] != sha256_hex(payload).as_bytes() {
        return Err(Stale::Damaged);
    }
    Ok((bound.to_string(), build(payload).map_err(Stale::Invalid)?))
}

/// Reads the payload in order; every read is bounds-checked.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if n > self.0.len() {
            return Err("truncated".into());
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Ok(head)
    }
    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    fn len64(&mut self) -> Result<usize, String> {
        let v = u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes"));
        usize::try_from(v).map_err(|_| "length out of range".to_string())
    }
}

/// The options of a BPE model, as `tokenizers`' BPE deserializer reads them (a `null` is unset).
#[derive(Deserialize)]
struct BpeOptions {
    dropout: Option<f32>,
    unk_token: Option<String>,
    continuing_subword_prefix: Option<String>,
    end_of_word_suffix: Option<String>,
    fuse_unk: Option<bool>,
    byte_fallback: Option<bool>,
    ignore_merges: Option<bool>,
}

/// An entry of `added_tokens` (tokenizers' `AddedTokenWithId`).
#[derive(Deserialize)]
struct AddedWithId {
    #[serde(rename = "id")]
    _id: u32,
    #[serde(flatten)]
    token: AddedToken,
}

/// `tokenizer.json` without the model's vocabulary and merges; absent parts are unset, as in
/// tokenizers' `TokenizerVisitor`.
#[derive(Deserialize)]
struct Parts {
    version: Option<String>,
    #[serde(default)]
    truncation: Option<TruncationParams>,
    #[serde(default)]
    padding: Option<PaddingParams>,
    #[serde(default)]
    added_tokens: Vec<AddedWithId>,
    #[serde(default)]
    normalizer: Option<NormalizerWrapper>,
    #[serde(default)]
    pre_tokenizer: Option<PreTokenizerWrapper>,
    #[serde(default)]
    post_processor: Option<PostProcessorWrapper>,
    #[serde(default)]
    decoder: Option<DecoderWrapper>,
    model: BpeOptions,
}

fn build(payload: &[u8]) -> Result<tokenizers::Tokenizer, String> {
    let mut r = Reader(payload);
    let n = r.len64()?;
    let parts: Parts = serde_json::from_slice(r.take(n)?).map_err(|e| e.to_string())?;
    if parts.version.as_deref().is_some_and(|v| v != "1.0") {
        return Err("unknown tokenizer version".into());
    }
    let count = r.u32()? as usize;
    let heads = r.take(count.checked_mul(8).ok_or("too many entries")?)?;
    let n = r.len64()?;
    let strings = std::str::from_utf8(r.take(n)?).map_err(|e| e.to_string())?;
    let mut tokens: Vec<(u32, &str)> = Vec::with_capacity(count);
    let mut at = 0usize;
    for head in heads.chunks_exact(8) {
        let id = u32::from_le_bytes(head[..4].try_into().expect("4 bytes"));
        let len = u32::from_le_bytes(head[4..].try_into().expect("4 bytes")) as usize;
        let token = strings
            .get(at..at + len)
            .ok_or("an entry is outside the strings")?;
        at += len;
        tokens.push((id, token));
    }
    let count = r.u32()? as usize;
    let pairs = r.take(count.checked_mul(8).ok_or("too many merges")?)?;
    let entry = |b: &[u8]| {
        let i = u32::from_le_bytes(b.try_into().expect("4 bytes")) as usize;
        tokens
            .get(i)
            .map(|t| t.1.to_string())
            .ok_or("a merge names no entry")
    };
    // The merges' strings are made on a second thread while the vocabulary map is filled.
    let (vocab, merges) = std::thread::scope(|s| {
        let merges = s.spawn(|| {
            pairs
                .chunks_exact(8)
                .map(|p| Ok((entry(&p[..4])?, entry(&p[4..])?)))
                .collect::<Result<Merges, &str>>()
        });
        let mut vocab = Vocab::with_capacity(tokens.len());
        for &(id, token) in &tokens {
            vocab.insert(token.to_string(), id);
        }
        (vocab, merges.join().expect("merges thread panicked"))
    });
    let merges = merges?;
    let o = parts.model;
    let mut b = BpeBuilder::new().vocab_and_merges(vocab, merges);
    if let Some(v) = o.dropout {
        b = b.dropout(v);
    }
    if let Some(v) = o.unk_token {
        b = b.unk_token(v);
    }
    if let Some(v) = o.continuing_subword_prefix {
        b = b.continuing_subword_prefix(v);
    }
    if let Some(v) = o.end_of_word_suffix {
        b = b.end_of_word_suffix(v);
    }
    if let Some(v) = o.fuse_unk {
        b = b.fuse_unk(v);
    }
    if let Some(v) = o.byte_fallback {
        b = b.byte_fallback(v);
    }
    if let Some(v) = o.ignore_merges {
        b = b.ignore_merges(v);
    }
    let bpe: BPE = b.build().map_err(|e| e.to_string())?;
    let mut t = TokenizerBuilder::new()
        .with_model(bpe)
        .with_normalizer(parts.normalizer)
        .with_pre_tokenizer(parts.pre_tokenizer)
        .with_post_processor(parts.post_processor)
        .with_decoder(parts.decoder)
        .with_truncation(parts.truncation)
        .with_padding(parts.padding)
        .build()
        .map_err(|e| e.to_string())?;
    t.add_tokens(parts.added_tokens.into_iter().map(|a| a.token))
        .map_err(|e| e.to_string())?;
    Ok(t.into())
}
