//! Chat templates rendered by minijinja must equal Python Jinja2 renders byte for byte.
//!
//! The golden files come from `tools/golden/render_templates.py`, which sets Jinja2 up exactly as
//! transformers' `_compile_jinja_template` and checks its multi-turn renders against
//! `verify/chat_vectors.json`. Regenerate with `python3 tools/golden/render_templates.py`.

mod common;

use std::path::PathBuf;

use common::{read_json, tokenizer_dir};
use mference_text::{ChatTemplate, TextError};

fn golden_files() -> Vec<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    files
}

fn load_template(doc: &serde_json::Value) -> ChatTemplate {
    let family = doc["family"].as_str().unwrap();
    let rel = doc["template"].as_str().unwrap();
    let dir = tokenizer_dir(family);
    if rel == "chat_template.jinja" {
        // The path the CLI takes: template and special tokens read from the folder.
        ChatTemplate::from_dir(&dir).unwrap()
    } else {
        let source = std::fs::read_to_string(dir.join(rel)).unwrap();
        ChatTemplate::from_source(source, doc["special_tokens"].as_object().unwrap()).unwrap()
    }
}

#[test]
fn renders_equal_python_jinja2() {
    let files = golden_files();
    assert_eq!(files.len(), 5, "expected 5 golden files, found {files:?}");
    let mut failures = Vec::new();
    let mut checked = 0;
    for file in files {
        let doc = read_json(file.clone());
        let template = load_template(&doc);
        for case in doc["cases"].as_array().unwrap() {
            let name = format!(
                "{}/{}",
                file.file_name().unwrap().to_string_lossy(),
                case["name"].as_str().unwrap()
            );
            let messages = case["messages"].as_array().unwrap();
            let tools = case["tools"].as_array().map(Vec::as_slice);
            let add_gen = case["add_generation_prompt"].as_bool().unwrap();
            let extra = case["extra"].as_object().unwrap();
            let got = template.render(messages, tools, add_gen, extra);
            checked += 1;
            match (&got, case["rendered"].as_str(), case["error"].as_str()) {
                (Ok(text), Some(want), _) if text == want => {}
                (Err(TextError::TemplateRender(msg)), None, Some(want)) if msg.contains(want) => {}
                _ => failures.push(format!(
                    "{name}:\n--- got:\n{got:?}\n--- want:\n{:?}\n",
                    if case["rendered"].is_null() {
                        &case["error"]
                    } else {
                        &case["rendered"]
                    }
                )),
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {checked} renders differ:\n{}",
        failures.len(),
        failures.join("\n")
    );
    assert!(checked >= 100);
}

/// The golden renders that reproduce `verify/chat_vectors.json` still do (guards the golden files
/// against being regenerated from a broken setup).
#[test]
fn golden_chat_vector_cases_match_the_vectors() {
    let mut seen = 0;
    for file in golden_files() {
        let doc = read_json(file);
        if doc["template"] != "chat_template.jinja" {
            continue;
        }
        let family = doc["family"].as_str().unwrap();
        let vectors = read_json(tokenizer_dir(family).join("verify/chat_vectors.json"));
        for case in doc["cases"].as_array().unwrap() {
            if let Some(chat) = case["chat_vector"].as_str() {
                assert_eq!(case["rendered"], vectors[chat]["text"], "{family}/{chat}");
                seen += 1;
            }
        }
    }
    assert_eq!(seen, 6);
}
