//! What a response-format constraint costs per generated token on a real vocabulary.
//!
//! ```text
//! cargo run --release -p mference-session --example constraint_cost -- \
//!     assets/tokenizers/gemma4 [INSTALL.gturbo]
//! ```
//!
//! With the tokenizer folder (Gemma 4: 262,144 ids): the one-time vocabulary index, the
//! per-request schema compile, and per token the mask computation and its application to a
//! `[vocab]` logits row, along the tokens of a valid reply (median and p90, µs). With an install
//! too: a greedy decode step with the fused head argmax against one that reads the full row back
//! (what a constrained greedy request does).

use std::time::{Duration, Instant};

use mference_models::{LoadOptions, Logits, Want};
use mference_runtime::CacheSlots;
use mference_session::{ResponseFormat, TextSide};
use mference_text::{Family, Tokenizer};
use serde_json::json;

fn pct(v: &mut [Duration], p: f64) -> f64 {
    v.sort_unstable();
    v[((v.len() - 1) as f64 * p).round() as usize].as_secs_f64() * 1e6
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let dir = args
        .first()
        .expect("usage: constraint_cost TOKENIZER_DIR [INSTALL]");
    let tok = Tokenizer::from_dir(std::path::Path::new(dir)).expect("loading the tokenizer");
    let vocab = tok.vocab_size();
    let text = TextSide::new(tok, None, Family::Gemma4, None);
    let index = text.prepare_constraints().expect("indexing the vocabulary");
    // A tool-style record: nested object, enum, bounded strings and numbers, an array.
    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "email": {"type": "string", "format": "email"},
            "role": {"enum": ["reader", "writer", "editor"]},
            "address": {"type": "object", "properties": {
                "street": {"type": "string"}, "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["street", "city", "zip"], "additionalProperties": false},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 5},
            "score": {"type": "number"}
        },
        "required": ["name", "age", "email", "role", "address", "tags", "score"],
        "additionalProperties": false
    });
    let reply = r#"{"name":"Elizabeth Bennet","age":20,"email":"lizzy@longbourn.example","role":"reader","address":{"street":"Longbourn House","city":"Meryton","zip":"01813"},"tags":["witty","proud","prejudiced"],"score":9.5}"#;
    let ids = text.tokenizer.encode(reply, false).unwrap();
    let format = ResponseFormat::JsonSchema {
        schema,
        strict: true,
    };
    let mut compiles = Vec::new();
    let (mut masks, mut applies) = (Vec::new(), Vec::new());
    let mut row = vec![0.0f32; vocab];
    for round in 0..5 {
        let mut c = text.compile(&format).expect("compiling");
        compiles.push(c.compile);
        for &id in &ids {
            let before = c.mask_time;
            let t0 = Instant::now();
            c.mask(&mut row).unwrap();
            let total = t0.elapsed();
            if round > 0 {
                masks.push(c.mask_time - before);
                applies.push(total);
            }
            assert!(
                row[id as usize].is_finite(),
                "the grammar refused token {id}"
            );
            row.fill(0.0);
            c.advance(id).unwrap();
        }
        assert!(c.is_done(), "the reply did not complete the grammar");
    }
    println!(
        "vocabulary {vocab} ids; one-time index {:.1} ms; schema compile median {:.0} µs",
        index.as_secs_f64() * 1e3,
        pct(&mut compiles, 0.5)
    );
    let n = masks.len();
    println!(
        "mask per token, computed and applied to the row ({n} tokens over 4 replies of {} tokens): median {:.0} µs p90 {:.0} µs; the call around it median {:.0} µs",
        ids.len(),
        pct(&mut masks, 0.5),
        pct(&mut masks, 0.9),
        pct(&mut applies, 0.5)
    );
    let Some(install) = args.get(1) else { return };
    let mut model = mference_models::load(
        std::path::Path::new(install),
        &LoadOptions {
            slots: CacheSlots::Resident,
            threads: 1,
            max_context: 4096,
            ..Default::default()
        },
    )
    .expect("loading the install");
    for want in [Want::Argmax, Want::Last] {
        model.truncate(0);
        model.forward(&ids[..8], Want::None).unwrap();
        let mut steps = Vec::new();
        for &id in &ids[8..] {
            let t0 = Instant::now();
            let out = model.forward(&[id], want).unwrap();
            if let Logits::Rows(r) = &out {
                std::hint::black_box(mference_runtime::sampler::argmax(r));
            }
            steps.push(t0.elapsed());
        }
        println!(
            "decode step with {want:?}: median {:.0} µs over {} steps",
            pct(&mut steps, 0.5),
            steps.len()
        );
    }
}
