//! Maple's text side with `assets/tokenizers/maple` (the pinned repo's tokenizer, config and
//! template; `SOURCES.md`): encode/decode against `verify/`, the chat template's open `<think>`
//! generation prompt, the stop tokens and the tool-call syntax of its template.

mod common;

use common::{ids_of, read_json, tokenizer_dir};
use mference_text::{parse_tool_calls, stop_token_ids, ChatTemplate, Family, Tokenizer};

fn tok() -> Tokenizer {
    Tokenizer::from_dir(&tokenizer_dir("maple")).unwrap()
}

#[test]
fn maple_tokenizer_reproduces_the_vectors() {
    let t = tok();
    let file = read_json(tokenizer_dir("maple").join("verify/vectors.json"));
    let vectors = file["vectors"].as_array().unwrap();
    let bad: Vec<usize> = vectors
        .iter()
        .enumerate()
        .filter(|(_, v)| t.encode(v["text"].as_str().unwrap(), false).unwrap() != ids_of(&v["ids"]))
        .map(|(i, _)| i)
        .collect();
    assert!(
        bad.is_empty(),
        "{} of {} differ: {bad:?}",
        bad.len(),
        vectors.len()
    );
}

#[test]
fn maple_chats_render_and_encode_like_the_vectors_with_think_left_open() {
    let t = tok();
    let template = ChatTemplate::from_dir(&tokenizer_dir("maple")).unwrap();
    let chats = read_json(tokenizer_dir("maple").join("verify/chat_vectors.json"));
    for (name, chat) in chats.as_object().unwrap() {
        let messages = chat["messages"].as_array().unwrap();
        let text = template
            .render(
                messages,
                None,
                true,
                &Family::Maple.default_template_kwargs(),
            )
            .unwrap();
        assert_eq!(text, chat["text"].as_str().unwrap(), "{name}");
        assert!(text.ends_with("<|im_start|>assistant\n<think>\n"), "{name}");
        assert_eq!(
            t.encode(&text, false).unwrap(),
            ids_of(&chat["ids"]),
            "{name}"
        );
    }
    assert_eq!(Family::from_model_type("maple"), Some(Family::Maple));
    assert_eq!(
        Family::Maple.reasoning_markers(),
        Some(("<think>", "</think>"))
    );
    let ids = t.encode(Family::Maple.turn_open_token(), false).unwrap();
    assert_eq!(ids, [151644]);
}

#[test]
fn maple_stops_at_im_end_and_endoftext() {
    assert_eq!(stop_token_ids(Family::Maple, &tok()), [151645, 151643]);
}

#[test]
fn maple_tool_calls_in_its_template_syntax_parse() {
    let out = parse_tool_calls(
        Family::Maple,
        "Checking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
    )
    .unwrap();
    assert_eq!(out.tool_calls.len(), 1);
    assert_eq!(out.tool_calls[0].name, "get_weather");
    assert_eq!(out.tool_calls[0].arguments["city"], "Paris");
    assert_eq!(out.content, "Checking.");
}

/// The three files are the pinned repo's (deepgrove/maple-preview-2bit-mlx@361db5da): their sha256
/// are the ones the original records (NeelM0906/Mference `docs/MAPLE.md`, "Reference pins").
#[test]
fn maple_tokenizer_files_match_the_pinned_sha256() {
    use sha2::{Digest, Sha256};
    for (file, want) in [
        (
            "tokenizer.json",
            "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4",
        ),
        (
            "tokenizer_config.json",
            "bcab9fe0f4f56a0cffba7c916f943c376810d32c08f2cebf01f8b15849039d35",
        ),
        (
            "chat_template.jinja",
            "83e4c58ca602ade89b126cc75a036eb8bd06d373d4fd94b09d2277d609131089",
        ),
    ] {
        let bytes = std::fs::read(tokenizer_dir("maple").join(file)).unwrap();
        let got: String = Sha256::digest(&bytes)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(got, want, "{file}");
    }
}
