//! Tokenizer parity with the vectors in `assets/tokenizers/*/verify` (ids produced by Python
//! `tokenizers` 0.23.3, llama.cpp and tiktoken; see `verify/README.md`).

mod common;

use common::{ids_of, read_json, tokenizer, tokenizer_dir, FAMILIES};
use mference_text::{stop_token_ids, Family};

/// The one vector whose text is not in NFC: Qwen's NFC normalizer changes it, so its decode is the
/// NFC form (`unicodedata.normalize('NFC', text)` in CPython).
const NON_NFC: &str = "\u{e7}wmO\u{c9}\u{ee}g\u{327}";
const NON_NFC_AS_NFC: &str = "\u{e7}wmO\u{c9}\u{ee}\u{123}";

#[test]
fn encode_reproduces_every_vector() {
    for (_, name) in FAMILIES {
        let tok = tokenizer(name);
        let file = read_json(tokenizer_dir(name).join("verify/vectors.json"));
        let vectors = file["vectors"].as_array().unwrap();
        assert_eq!(vectors.len() as u64, file["count"].as_u64().unwrap());
        let mut bad = Vec::new();
        for (i, v) in vectors.iter().enumerate() {
            let text = v["text"].as_str().unwrap();
            let want = ids_of(&v["ids"]);
            let got = tok.encode(text, false).unwrap();
            if got != want {
                bad.push(format!("#{i} {text:?}: got {got:?}, want {want:?}"));
            }
        }
        assert!(
            bad.is_empty(),
            "{name}: {} of {} differ:\n{}",
            bad.len(),
            vectors.len(),
            bad.join("\n")
        );
    }
}

/// `decode(ids) == text`, where the READMEs say it holds: Gemma's decoder turns a literal U+2581
/// into a space (`gemma4/SOURCES.md`), Qwen normalizes to NFC, DeepSeek round-trips everything.
#[test]
fn decode_round_trips_vectors() {
    for (family, name) in FAMILIES {
        let tok = tokenizer(name);
        let file = read_json(tokenizer_dir(name).join("verify/vectors.json"));
        let mut checked = 0;
        for (i, v) in file["vectors"].as_array().unwrap().iter().enumerate() {
            let text = v["text"].as_str().unwrap();
            if family == Family::Gemma4 && text.contains('\u{2581}') {
                continue;
            }
            let want = if family == Family::Qwen3_5Moe && text == NON_NFC {
                NON_NFC_AS_NFC
            } else {
                text
            };
            let got = tok.decode(&ids_of(&v["ids"]), false).unwrap();
            assert_eq!(got, want, "{name} #{i}");
            checked += 1;
        }
        assert!(checked > 200, "{name}: only {checked} vectors checked");
    }
}

/// The llama.cpp-layout copy of the vectors (`inputs.txt` + `expected_ids.txt`) read as raw bytes.
#[test]
fn llama_cpp_layout_vectors() {
    for (_, name) in FAMILIES {
        let tok = tokenizer(name);
        let dir = tokenizer_dir(name).join("verify");
        let inputs = std::fs::read(dir.join("inputs.txt")).unwrap();
        let inputs = String::from_utf8(inputs).unwrap();
        let mut texts: Vec<&str> = inputs.split("\n__ggml_vocab_test__\n").collect();
        assert_eq!(
            texts.pop(),
            Some(""),
            "{name}: inputs.txt ends with a separator"
        );
        let expected = std::fs::read_to_string(dir.join("expected_ids.txt")).unwrap();
        let lines: Vec<&str> = expected.split('\n').collect();
        assert!(lines.len() >= texts.len());
        for (i, text) in texts.iter().enumerate() {
            let want: Vec<u32> = lines[i]
                .split_whitespace()
                .map(|x| x.parse().unwrap())
                .collect();
            assert_eq!(
                tok.encode(text, false).unwrap(),
                want,
                "{name} #{i} {text:?}"
            );
        }
    }
}

#[test]
fn chat_vectors_encode_and_round_trip() {
    for (_, name) in FAMILIES {
        let tok = tokenizer(name);
        let file = read_json(tokenizer_dir(name).join("verify/chat_vectors.json"));
        for (chat, v) in file.as_object().unwrap() {
            let text = v["text"].as_str().unwrap();
            let ids = ids_of(&v["ids"]);
            assert_eq!(tok.encode(text, false).unwrap(), ids, "{name}/{chat}");
            assert_eq!(tok.decode(&ids, false).unwrap(), text, "{name}/{chat}");
            for (control, count) in v["control_counts"].as_object().unwrap() {
                let id = tok
                    .token_id(control)
                    .unwrap_or_else(|| panic!("{name}: no id for {control}"));
                let n = ids.iter().filter(|&&x| x == id).count() as u64;
                assert_eq!(
                    n,
                    count.as_u64().unwrap(),
                    "{name}/{chat}: count of {control}"
                );
            }
        }
    }
}

/// Ids, BOS and vocabulary sizes against `special_tokens.json` and the checkpoints'
/// tokenizer files (the repos of `crates/install/src/presets.rs`).
#[test]
fn special_tokens_match_the_folder() {
    for (family, name) in FAMILIES {
        let tok = tokenizer(name);
        let special = read_json(tokenizer_dir(name).join("special_tokens.json"));
        for (token, id) in special["tokens"].as_object().unwrap() {
            assert_eq!(
                tok.token_id(token),
                Some(id.as_u64().unwrap() as u32),
                "{name} {token}"
            );
        }
        assert_eq!(
            tok.bos_id(),
            special["bos_token_id"].as_u64().map(|x| x as u32),
            "{name}"
        );
        assert_eq!(
            tok.eos_id(),
            special["eos_token_id"].as_u64().map(|x| x as u32),
            "{name}"
        );
        let mut stops = stop_token_ids(family, tok);
        let mut want = ids_of(&special["end_of_generation_token_ids"]);
        stops.sort();
        want.sort();
        assert_eq!(stops, want, "{name} stop ids");
    }
    assert_eq!(tokenizer("gemma4").vocab_size(), 262_144);
    assert_eq!(tokenizer("qwen3_6").vocab_size(), 248_077);
    assert_eq!(tokenizer("deepseek_v4").vocab_size(), 129_280);
    assert_eq!(
        stop_token_ids(Family::Gemma4, tokenizer("gemma4")),
        vec![1, 106, 50]
    );
}

#[test]
fn gemma_adds_bos_only_with_special_tokens() {
    let tok = tokenizer("gemma4");
    let plain = tok.encode("Hello world", false).unwrap();
    let with = tok.encode("Hello world", true).unwrap();
    assert_eq!(with[0], 2);
    assert_eq!(&with[1..], &plain[..]);
    let qwen = tokenizer("qwen3_6");
    assert_eq!(
        qwen.encode("Hello world", true).unwrap(),
        qwen.encode("Hello world", false).unwrap()
    );
}

/// The bytes of the reference ids, concatenated, are the vector's text (its NFC form for Qwen, a
/// literal U+2581 written as a space for Gemma, as in `decode_round_trips_vectors`): the byte map a
/// constrained decoder matches grammars against spells what the tokenizer decodes.
#[test]
fn token_bytes_spell_every_vector() {
    use mference_text::TokenBytes;
    for (family, name) in FAMILIES {
        let tok = tokenizer(name);
        let bytes = tok.token_bytes().unwrap();
        assert_eq!(bytes.len(), tok.vocab_size());
        let file = read_json(tokenizer_dir(name).join("verify/vectors.json"));
        let mut checked = 0;
        for (i, v) in file["vectors"].as_array().unwrap().iter().enumerate() {
            let text = v["text"].as_str().unwrap();
            let ids = ids_of(&v["ids"]);
            if ids
                .iter()
                .any(|&id| matches!(bytes[id as usize], TokenBytes::Special(_)))
            {
                continue; // a control token in the text is not text
            }
            let want = if family == Family::Qwen3_5Moe && text == NON_NFC {
                NON_NFC_AS_NFC.to_string()
            } else if family == Family::Gemma4 {
                text.replace('\u{2581}', " ")
            } else {
                text.to_string()
            };
            let mut got = Vec::new();
            for &id in &ids {
                let TokenBytes::Text(b) = &bytes[id as usize] else {
                    unreachable!()
                };
                got.extend_from_slice(b);
            }
            assert_eq!(String::from_utf8_lossy(&got), want, "{name} #{i}");
            checked += 1;
        }
        assert!(checked > 100, "{name}: only {checked} vectors checked");
        for special in [
            "<eos>",
            "<|turn>",
            "<|tool_call>",
            "<|im_end|>",
            "<tool_call>",
        ] {
            if let Some(id) = tok.token_id(special) {
                assert_eq!(
                    bytes[id as usize],
                    TokenBytes::Special(special.into()),
                    "{name}"
                );
            }
        }
    }
}
