//! The CI smoke run of every fuzz target: real seeds (files of an install made here, the bundled
//! checkpoints, typical request bodies and tool-call text), then a few thousand deterministic
//! mutations of each. A panic anywhere fails the test; each target must also keep up (a hang or a
//! huge allocation shows as a target far slower than its budget). The long runs are libFuzzer's
//! (`tools/fuzz.sh`). `MFERENCE_FUZZ_SEEDS=DIR` also writes the seeds to `DIR/<target>/` as
//! starting corpora for them.

use std::path::Path;
use std::time::{Duration, Instant};

use mference_fuzzing::{SPLIT, TARGETS};

fn repo() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
}

/// The first `8 + header length` bytes of a shard.
fn header_prefix(shard: &Path) -> Vec<u8> {
    let b = std::fs::read(shard).unwrap();
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    b[..8 + n].to_vec()
}

fn seeds(install: &Path) -> Vec<(&'static str, Vec<u8>)> {
    let model = repo().join("assets/models/gemma4-tiny");
    let qwen = repo().join("assets/models/qwen3_6-tiny");
    let read = |p: &Path| std::fs::read(p).unwrap();
    let mut ck = read(&model.join("config.json"));
    ck.extend_from_slice(SPLIT);
    ck.extend(read(&model.join("model.safetensors.index.json")));
    ck.extend_from_slice(SPLIT);
    ck.extend(header_prefix(&model.join("model.safetensors")));
    let weights = read(&install.join("model_weights.bin"));
    let index_len = mference_format::ResidentIndex::parse_header(&weights)
        .map(|(size, _, _)| size as usize)
        .unwrap_or(16 << 10)
        .min(weights.len());
    let journal = br#"{"schema":1,"repoID":"o/n","requestedRevision":"main","resolvedCommit":"c","sourceIndexSHA256":"s","planFingerprint":"f","totalSourceBytes":10,"completedRanges":[]}"#;
    vec![
        ("safetensors_header", header_prefix(&model.join("model.safetensors"))),
        ("safetensors_header", header_prefix(&qwen.join("model.safetensors"))),
        ("checkpoint", ck),
        ("config_json", read(&model.join("config.json"))),
        ("config_json", read(&qwen.join("config.json"))),
        ("manifest", read(&install.join("manifest.json"))),
        ("layout", read(&install.join("packed_experts/layout.json"))),
        ("receipt", read(&install.join("verified-install.json"))),
        ("resident_index", weights[..index_len].to_vec()),
        ("journal", journal.to_vec()),
        ("chat_request", br#"{"model":"m","messages":[{"role":"system","content":"s"},{"role":"user","content":[{"type":"text","text":"hi"}]},{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{\"a\":1}"}}]},{"role":"tool","tool_call_id":"c1","content":"r"}],"tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object","properties":{"a":{"type":"integer"}}}}}],"max_tokens":8,"temperature":0.5,"top_p":0.9,"stop":["x"],"logprobs":true,"top_logprobs":2,"stream":true}"#.to_vec()),
        ("completion_request", br#"{"model":"m","prompt":[1,2,3],"max_tokens":4,"logprobs":2,"echo":false,"stop":"\n","seed":7}"#.to_vec()),
        ("tool_calls", "Sure. <|tool_call>call:get{city:<|\"|>Paris<|\"|>,n:3,o:{k:[1,2]}}<tool_call|>".as_bytes().to_vec()),
        ("tool_calls", "<think>r</think>\n<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>".as_bytes().to_vec()),
        ("tool_calls", "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n<｜DSML｜parameter name=\"a\" string=\"false\">1</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>".as_bytes().to_vec()),
    ]
}

/// xorshift64*: deterministic mutations.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

const TOKENS: &[&[u8]] = &[
    b"0",
    b"-1",
    b"1e309",
    b"18446744073709551615",
    b"9223372036854775808",
    b"null",
    b"[]",
    b"{}",
    b"\"\"",
    b"\xff",
    b"\x00",
    b"true",
    b"\"..\"",
    b"\"/etc/passwd\"",
    b"[[[[[[[[",
];

fn mutate(seed: &[u8], rng: &mut Rng) -> Vec<u8> {
    let mut b = seed.to_vec();
    for _ in 0..1 + rng.below(4) {
        let at = rng.below(b.len() + 1);
        match rng.below(6) {
            0 if !b.is_empty() => {
                let i = at.min(b.len() - 1);
                b[i] ^= 1 << rng.below(8);
            }
            1 => {
                let t = TOKENS[rng.below(TOKENS.len())];
                b.splice(at..at, t.iter().copied());
            }
            2 if !b.is_empty() => {
                let end = (at + rng.below(16)).min(b.len());
                b.drain(at.min(end)..end);
            }
            3 => b.truncate(at),
            4 if b.len() >= 8 => {
                // Overwrite a number-sized run with an extreme value (lengths, offsets, counts).
                let i = at.min(b.len() - 8);
                b[i..i + 8].copy_from_slice(&rng.next().to_le_bytes());
            }
            _ => {
                let i = rng.below(b.len() + 1);
                b.insert(i.min(b.len()), rng.next() as u8);
            }
        }
    }
    b
}

#[test]
fn every_fuzz_target_survives_mutated_seeds() {
    let work = tempfile::tempdir().unwrap();
    let install = work.path().join("g.gturbo");
    let opts = mference_install::InstallOptions {
        progress: mference_install::ProgressMode::Plain,
        ..Default::default()
    };
    mference_install::install_local(&repo().join("assets/models/gemma4-tiny"), &install, &opts)
        .unwrap();
    let seeds = seeds(&install);
    if let Some(dir) = std::env::var_os("MFERENCE_FUZZ_SEEDS") {
        for (i, (t, s)) in seeds.iter().enumerate() {
            let d = Path::new(&dir).join(t);
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join(format!("seed-{i}")), s).unwrap();
        }
    }
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    for &(name, target) in TARGETS {
        let mine: Vec<&Vec<u8>> = seeds
            .iter()
            .filter(|(t, _)| *t == name)
            .map(|(_, s)| s)
            .collect();
        assert!(!mine.is_empty(), "no seed for {name}");
        let t0 = Instant::now();
        let mut runs = 0;
        for s in &mine {
            target(s);
        }
        while runs < 2000 && t0.elapsed() < Duration::from_secs(4) {
            let input = mutate(mine[runs % mine.len()], &mut rng);
            target(&input);
            runs += 1;
        }
        eprintln!("{name}: {runs} mutated inputs in {:.2?}", t0.elapsed());
        assert!(
            runs >= 50,
            "{name}: only {runs} inputs in 4 s (a hang or a huge allocation?)"
        );
    }
}
