//! Streaming detokenizer: pushing ids one by one concatenates to the full decode, and no chunk
//! splits a character (a split would surface as U+FFFD in a chunk).

mod common;

use common::{ids_of, read_json, tokenizer, tokenizer_dir, FAMILIES};
use mference_text::StreamingDetokenizer;

const TEXTS: &[&str] = &[
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "天气怎么样？今天北京多云，气温18度。",
    "日本語のテキスト：東京タワーは333メートルです。",
    "Emoji: 👍🏽 👨‍👩‍👧‍👦 🇫🇷 🎉🎉🎉 and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math 𝒳",
    "Accents: Réponds en français, s'il te plaît — déjà vu, naïve, Ångström, Ñandú, Zürich.",
    "Mixed\tws\r\n  and\u{a0}nbsp\u{2028}line sep; Ελληνικά, русский, עברית, العربية, हिन्दी, 한국어.",
    "fn main() { println!(\"{}\", \"ß→∑\"); }\n    // ∀x ∈ ℝ: x² ≥ 0",
    "",
];

fn check(name: &str, ids: &[u32], skip_special: bool) {
    let tok = tokenizer(name);
    let want = tok.decode(ids, skip_special).unwrap();
    let mut detok = StreamingDetokenizer::with_skip_special(tok, skip_special);
    let mut got = String::new();
    for &id in ids {
        let chunk = detok.push(id);
        assert!(
            !chunk.contains('\u{FFFD}') || want.contains('\u{FFFD}'),
            "{name}: chunk {chunk:?} has a replacement character the full text has not"
        );
        got.push_str(&chunk);
    }
    got.push_str(&detok.finish());
    assert_eq!(got, want, "{name}: ids {ids:?}");
}

#[test]
fn streamed_text_equals_full_decode() {
    for (_, name) in FAMILIES {
        for text in TEXTS {
            let ids = tokenizer(name).encode(text, false).unwrap();
            check(name, &ids, true);
            check(name, &ids, false);
        }
    }
}

#[test]
fn streamed_vectors_and_chats_equal_full_decode() {
    for (_, name) in FAMILIES {
        let file = read_json(tokenizer_dir(name).join("verify/vectors.json"));
        for v in file["vectors"].as_array().unwrap() {
            check(name, &ids_of(&v["ids"]), true);
        }
        let chats = read_json(tokenizer_dir(name).join("verify/chat_vectors.json"));
        for v in chats.as_object().unwrap().values() {
            check(name, &ids_of(&v["ids"]), true);
            check(name, &ids_of(&v["ids"]), false);
        }
    }
}

/// Multi-byte characters that the tokenizer splits over several byte tokens are emitted whole, in
/// the push of their last byte.
#[test]
fn multi_byte_characters_are_never_split() {
    for (_, name) in FAMILIES {
        let tok = tokenizer(name);
        for text in ["𝔘", "👨‍👩‍👧‍👦", "ģ", "龘", "🇫🇷"] {
            let ids = tok.encode(text, false).unwrap();
            let mut detok = StreamingDetokenizer::new(tok);
            let chunks: Vec<String> = ids.iter().map(|&id| detok.push(id)).collect();
            for chunk in &chunks {
                assert!(
                    !chunk.contains('\u{FFFD}'),
                    "{name}: {text:?} gave chunk {chunk:?}"
                );
            }
            assert_eq!(chunks.concat() + &detok.finish(), text, "{name}");
        }
    }
}

/// A byte sequence that never becomes valid UTF-8 is held back, then released by `finish` exactly
/// as the full decode shows it.
#[test]
fn dangling_bytes_are_released_by_finish() {
    let tok = tokenizer("gemma4");
    // "<0xF0>" and "<0x9F>" are byte-fallback tokens: the first two bytes of a 4-byte character.
    let ids: Vec<u32> = ["<0xF0>", "<0x9F>"]
        .iter()
        .map(|t| tok.token_id(t).unwrap())
        .collect();
    let mut detok = StreamingDetokenizer::new(tok);
    assert_eq!(detok.push(ids[0]), "");
    assert_eq!(detok.push(ids[1]), "");
    let rest = detok.finish();
    assert_eq!(rest, tok.decode(&ids, true).unwrap());
    assert!(rest.contains('\u{FFFD}'));
}
