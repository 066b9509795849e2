//! The tokenizer cache against its reference, the `tokenizers` crate's own reading of
//! `tokenizer.json`: the same serialized tokenizer (vocabulary, merges in rank order, added
//! tokens, normalizer, pre-tokenizer, post-processor, decoder) and the same ids, on every bundled
//! tokenizer; and a cache that was not made from this `tokenizer.json`, or is damaged, is never
//! used.

use std::path::Path;

use serde_json::json;

use crate::family_tests::tokenizer_dir;
use crate::{Family, Tokenizer, TokenizerCache};

/// Text that crosses the cases a tokenizer splits differently: spaces and runs of them, digits,
/// punctuation, newlines, accents, CJK, an emoji, byte-fallback material and special tokens.
const SAMPLE: &str = "Hello  world!\n\n  It is a truth universally acknowledged, that 12345 \
                      costs $6.78 — naïve café, 東京タワー, 😀 \u{0}\t<bos><|im_end|> tail   ";

/// The JSON-parsed tokenizer (the cache's first load, which writes it) and the cached one
/// (the second load) serialize the same and encode [`SAMPLE`] the same.
fn cache_matches_json(family: Family) {
    let dir = tokenizer_dir(family);
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("cache/tokenizer.bin");
    let (parsed, first) = Tokenizer::from_dir_cached(&dir, &cache, None).unwrap();
    assert_eq!(
        first,
        TokenizerCache::Written { replaced: None },
        "{family:?}"
    );
    let (cached, second) = Tokenizer::from_dir_cached(&dir, &cache, None).unwrap();
    assert_eq!(second, TokenizerCache::Used, "{family:?}");
    assert!(
        parsed.inner.to_string(false).unwrap() == cached.inner.to_string(false).unwrap(),
        "{family:?}: the cached tokenizer serializes differently from tokenizer.json's"
    );
    for special in [false, true] {
        assert_eq!(
            parsed.encode(SAMPLE, special).unwrap(),
            cached.encode(SAMPLE, special).unwrap(),
            "{family:?}"
        );
    }
    assert_eq!(parsed.bos_id(), cached.bos_id());
    assert_eq!(parsed.eos_id(), cached.eos_id());
}

#[test]
fn gemma4_cache_matches_its_tokenizer_json() {
    cache_matches_json(Family::Gemma4);
}

#[test]
fn qwen_cache_matches_its_tokenizer_json() {
    cache_matches_json(Family::Qwen3_5Moe);
}

#[test]
fn deepseek_v4_cache_matches_its_tokenizer_json() {
    cache_matches_json(Family::DeepseekV4);
}

#[test]
fn inkling_cache_matches_its_tokenizer_json() {
    cache_matches_json(Family::Inkling);
}

#[test]
fn maple_cache_matches_its_tokenizer_json() {
    cache_matches_json(Family::Maple);
}

/// A small byte-fallback BPE `tokenizer.json` in `dir` with `merges` (pairs or legacy lines).
fn write_tiny(dir: &Path, merges: serde_json::Value, abc_id: u32) {
    let t = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [{"id": 0, "content": "<unk>", "single_word": false, "lstrip": false,
                          "rstrip": false, "normalized": false, "special": true},
                         {"id": 9, "content": "<eot>", "single_word": false, "lstrip": false,
                          "rstrip": false, "normalized": false, "special": true}],
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"},
        "pre_tokenizer": null,
        "post_processor": null,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"}]},
        "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>",
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                  "vocab": {"<unk>": 0, "a": 1, "b": 2, "c": 3, "ab": 4, "\u{2581}": 5,
                            "abc": abc_id, "<0x21>": 7, "bc": 8},
                  "merges": merges}
    });
    std::fs::write(dir.join("tokenizer.json"), t.to_string()).unwrap();
}

fn serialized(t: &Tokenizer) -> String {
    t.inner.to_string(false).unwrap()
}

#[test]
fn a_stale_or_damaged_cache_is_rebuilt_never_used() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let cache = dir.join("cache/tokenizer.bin");
    write_tiny(dir, json!([["a", "b"], ["ab", "c"]]), 6);
    let load = || Tokenizer::from_dir_cached(dir, &cache, None).unwrap();
    let reference = || Tokenizer::from_dir(dir).unwrap();

    assert_eq!(load().1, TokenizerCache::Written { replaced: None });
    let (t, how) = load();
    assert_eq!(how, TokenizerCache::Used);
    assert_eq!(serialized(&t), serialized(&reference()));
    assert_eq!(t.encode("abc ab!", false).unwrap(), [6, 5, 4, 7]);

    // Another tokenizer.json (abc has another id, the merge order is changed): rebuilt.
    write_tiny(dir, json!([["b", "c"], ["a", "b"], ["ab", "c"]]), 10);
    let (t, how) = load();
    let why = match how {
        TokenizerCache::Written {
            replaced: Some(why),
        } => why,
        other => panic!("{other:?}"),
    };
    assert!(why.contains("another tokenizer.json"), "{why}");
    assert_eq!(serialized(&t), serialized(&reference()));
    assert_eq!(
        t.encode("abc", false).unwrap(),
        reference().encode("abc", false).unwrap()
    );
    assert_eq!(load().1, TokenizerCache::Used);

    // One flipped byte anywhere in the payload (here: in the vocabulary's strings): rebuilt.
    let mut bytes = std::fs::read(&cache).unwrap();
    let at = bytes.len() - 30;
    bytes[at] ^= 0x01;
    std::fs::write(&cache, &bytes).unwrap();
    let (t, how) = load();
    assert!(
        matches!(&how, TokenizerCache::Written { replaced: Some(w) } if w.contains("damaged")),
        "{how:?}"
    );
    assert_eq!(serialized(&t), serialized(&reference()));

    // Not a cache at all.
    std::fs::write(&cache, b"MFTOK").unwrap();
    assert!(matches!(
        load().1,
        TokenizerCache::Written { replaced: Some(w) } if w.contains("format")
    ));
    assert_eq!(load().1, TokenizerCache::Used);
}

#[test]
fn legacy_merge_lines_are_cached_like_pairs() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let cache = dir.join("tokenizer.bin");
    write_tiny(dir, json!(["#version: 0.2", "a b", "ab c"]), 6);
    assert_eq!(
        Tokenizer::from_dir_cached(dir, &cache, None).unwrap().1,
        TokenizerCache::Written { replaced: None }
    );
    let (t, how) = Tokenizer::from_dir_cached(dir, &cache, None).unwrap();
    assert_eq!(how, TokenizerCache::Used);
    assert_eq!(
        serialized(&t),
        serialized(&Tokenizer::from_dir(dir).unwrap())
    );
}

#[test]
fn an_unwritable_cache_or_a_model_without_one_still_loads_from_json() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    write_tiny(dir, json!([["a", "b"], ["ab", "c"]]), 6);
    // The cache's folder is a file: nothing can be written there.
    std::fs::write(dir.join("cache"), b"").unwrap();
    let (t, how) = Tokenizer::from_dir_cached(dir, &dir.join("cache/tokenizer.bin"), None).unwrap();
    assert!(matches!(how, TokenizerCache::NotWritten(_)), "{how:?}");
    assert_eq!(
        serialized(&t),
        serialized(&Tokenizer::from_dir(dir).unwrap())
    );

    // A WordLevel model has no compact form here.
    let wl = json!({"version": "1.0", "added_tokens": [], "normalizer": null,
                    "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
                    "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "hi": 1}, "unk_token": "[UNK]"}});
    std::fs::write(dir.join("tokenizer.json"), wl.to_string()).unwrap();
    let (t, how) = Tokenizer::from_dir_cached(dir, &dir.join("other.bin"), None).unwrap();
    assert!(matches!(how, TokenizerCache::NotCacheable(_)), "{how:?}");
    assert_eq!(t.encode("hi there", false).unwrap(), [1, 0]);
    assert!(!dir.join("other.bin").exists());
}

#[test]
fn no_tokenizer_json_is_an_error_even_with_a_cache() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let cache = dir.join("tokenizer.bin");
    write_tiny(dir, json!([["a", "b"]]), 6);
    Tokenizer::from_dir_cached(dir, &cache, None).unwrap();
    std::fs::remove_file(dir.join("tokenizer.json")).unwrap();
    let e = Tokenizer::from_dir_cached(dir, &cache, None).unwrap_err();
    assert!(matches!(e, crate::TextError::NoTokenizer { .. }), "{e}");
}

#[test]
fn a_tokenizer_json_the_manifest_lists_is_named_as_missing_not_as_never_installed() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("tokenizer");
    std::fs::create_dir(&dir).unwrap();
    let cache = dir.join("tokenizer.bin");
    write_tiny(&dir, json!([["a", "b"]]), 6);
    std::fs::remove_file(dir.join("tokenizer.json")).unwrap();
    let e = Tokenizer::from_dir_cached(&dir, &cache, None).unwrap_err();
    assert!(matches!(e, crate::TextError::NoTokenizer { .. }), "{e}");
    std::fs::write(
        tmp.path().join("manifest.json"),
        json!({"files": {"tokenizer/tokenizer.json": {"bytes": 1}}}).to_string(),
    )
    .unwrap();
    let e = Tokenizer::from_dir_cached(&dir, &cache, None).unwrap_err();
    assert!(
        matches!(e, crate::TextError::TokenizerMissing { .. }),
        "{e}"
    );
    assert!(
        e.to_string()
            .contains("the install is incomplete or damaged"),
        "{e}"
    );
}

/// With the digest of `tokenizer.json` given by the caller (an install's manifest digest, checked
/// beside the load), the cache is bound to that digest: a cache made under another digest is
/// replaced, one made under the same is used, and the tokenizer is the file's either way.
#[test]
fn a_given_digest_binds_the_cache_as_the_files_own_hash_does() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let cache = dir.join("tokenizer.bin");
    write_tiny(dir, json!([["a", "b"], ["ab", "c"]]), 6);
    let own =
        mference_format::hash::sha256_hex(&std::fs::read(dir.join("tokenizer.json")).unwrap());
    let reference = serialized(&Tokenizer::from_dir(dir).unwrap());
    // Made under the file's own hash, then loaded under another digest: not used.
    Tokenizer::from_dir_cached(dir, &cache, None).unwrap();
    let other = "0".repeat(64);
    let (t, how) = Tokenizer::from_dir_cached(dir, &cache, Some(&other)).unwrap();
    assert!(
        matches!(&how, TokenizerCache::Written { replaced: Some(w) } if w.contains("other")),
        "{how:?}"
    );
    assert_eq!(serialized(&t), reference);
    // Now bound to that digest: used under it, replaced under the file's own hash.
    assert_eq!(
        Tokenizer::from_dir_cached(dir, &cache, Some(&other))
            .unwrap()
            .1,
        TokenizerCache::Used
    );
    assert!(matches!(
        Tokenizer::from_dir_cached(dir, &cache, Some(&own.to_uppercase()))
            .unwrap()
            .1,
        TokenizerCache::Written { replaced: Some(_) }
    ));
    let (t, how) = Tokenizer::from_dir_cached(dir, &cache, Some(&own)).unwrap();
    assert_eq!(how, TokenizerCache::Used);
    assert_eq!(serialized(&t), reference);
    // The file must still be there, as without a digest.
    std::fs::remove_file(dir.join("tokenizer.json")).unwrap();
    assert!(Tokenizer::from_dir_cached(dir, &cache, Some(&own)).is_err());
}
