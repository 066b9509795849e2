//! Inkling's text side against `assets/tokenizers/inkling` (o200k_base plus the 60 chat specials,
//! checked upstream against tml-renderers; see its SOURCES.md): the encode vectors, the decode
//! round trip, the rendered chats of `verify/chat_vectors.json`, the specials, the stop token
//! `<|content_model_end_sampling|>` and the assistant-turn opener.

mod common;

use common::{ids_of, read_json, tokenizer_dir};
use mference_text::{stop_token_ids, ChatTemplate, Family, Tokenizer};

fn tokenizer() -> Tokenizer {
    Tokenizer::from_dir(&tokenizer_dir("inkling")).unwrap()
}

#[test]
fn inkling_encode_and_decode_reproduce_the_vectors() {
    let tok = tokenizer();
    let file = read_json(tokenizer_dir("inkling").join("verify/vectors.json"));
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
        let back = tok.decode(&want, false).unwrap();
        if back != text {
            bad.push(format!("#{i}: decode gives {back:?}"));
        }
    }
    assert!(
        bad.is_empty(),
        "{} of {}:\n{}",
        bad.len(),
        vectors.len(),
        bad.join("\n")
    );
}

#[test]
fn inkling_chats_render_and_encode_like_the_vectors() {
    let tok = tokenizer();
    let t = ChatTemplate::from_dir(&tokenizer_dir("inkling")).unwrap();
    let file = read_json(tokenizer_dir("inkling").join("verify/chat_vectors.json"));
    for (chat, v) in file.as_object().unwrap() {
        let messages = v["messages"].as_array().unwrap();
        let mut kwargs = Family::Inkling.default_template_kwargs();
        kwargs.insert(
            "reasoning_effort".into(),
            v["render_options"]["reasoning_effort"].clone(),
        );
        let text = t.render(messages, None, true, &kwargs).unwrap();
        assert_eq!(text, v["text"].as_str().unwrap(), "{chat}");
        // The family's defaults render the same (effort none).
        let plain = t
            .render(
                messages,
                None,
                true,
                &Family::Inkling.default_template_kwargs(),
            )
            .unwrap();
        assert_eq!(plain, text, "{chat} with the default kwargs");
        assert!(plain.ends_with(Family::Inkling.turn_open_token()));
        assert_eq!(
            tok.encode(&text, false).unwrap(),
            ids_of(&v["ids"]),
            "{chat}"
        );
    }
}

#[test]
fn inkling_specials_and_stop_token() {
    let tok = tokenizer();
    let special = read_json(tokenizer_dir("inkling").join("special_tokens.json"));
    for (token, id) in special["tokens"].as_object().unwrap() {
        assert_eq!(
            tok.token_id(token),
            Some(id.as_u64().unwrap() as u32),
            "{token}"
        );
    }
    assert_eq!(tok.vocab_size(), 200_058);
    assert_eq!(tok.eos_id(), Some(200_006));
    assert_eq!(stop_token_ids(Family::Inkling, &tok), vec![200_006]);
    assert_eq!(
        ids_of(&special["end_of_generation_token_ids"]),
        stop_token_ids(Family::Inkling, &tok)
    );
    assert_eq!(
        Family::from_model_type("inkling_mm_model"),
        Some(Family::Inkling)
    );
}
