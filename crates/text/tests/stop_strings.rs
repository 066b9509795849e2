//! Stop strings over streamed text. The expected output is computed independently of the chunking:
//! the full text cut before the earliest occurrence of any stop string (`str::find`).

use mference_text::StopStrings;
use proptest::prelude::*;

/// Feeds `chunks`, checking every push, and returns (all emitted text, stopped).
fn run(stops: &[&str], chunks: &[&str]) -> (String, bool) {
    let mut s = StopStrings::new(stops.iter().map(|s| s.to_string()).collect());
    let mut out = String::new();
    for chunk in chunks {
        let (emit, stopped) = s.push(chunk);
        out.push_str(&emit);
        if stopped {
            assert_eq!(
                s.push("more text"),
                (String::new(), true),
                "pushes after a stop emit nothing"
            );
            assert_eq!(s.finish(), "");
            return (out, true);
        }
    }
    out.push_str(&s.finish());
    (out, false)
}

/// The reference: generation stops at the shortest prefix of `text` that contains a stop string,
/// and the output is that prefix cut before the earliest stop-string occurrence in it.
fn expected(stops: &[&str], text: &str) -> (String, bool) {
    let ends = text.char_indices().map(|(i, c)| i + c.len_utf8());
    for end in ends {
        let prefix = &text[..end];
        let hit = stops
            .iter()
            .filter(|s| !s.is_empty())
            .filter_map(|s| prefix.find(s))
            .min();
        if let Some(at) = hit {
            return (text[..at].to_string(), true);
        }
    }
    (text.to_string(), false)
}

/// Splits `text` at the given char boundaries.
fn split_at_all<'a>(text: &'a str, cuts: &[usize]) -> Vec<&'a str> {
    let mut pieces = Vec::new();
    let mut last = 0;
    for &c in cuts {
        pieces.push(&text[last..c]);
        last = c;
    }
    pieces.push(&text[last..]);
    pieces
}

#[test]
fn stop_split_at_every_position_is_not_printed() {
    let stops = ["<|END|>", "Observation:"];
    let text = "Thought: call the tool.\nObservation: 42 — done<|END|>tail";
    let want = expected(&stops, text);
    assert_eq!(want, ("Thought: call the tool.\n".to_string(), true));
    let bounds: Vec<usize> = text.char_indices().map(|(i, _)| i).skip(1).collect();
    // One cut anywhere, and two cuts at every pair of positions.
    for &a in &bounds {
        assert_eq!(run(&stops, &split_at_all(text, &[a])), want, "cut at {a}");
        for &b in bounds.iter().filter(|&&b| b > a) {
            assert_eq!(
                run(&stops, &split_at_all(text, &[a, b])),
                want,
                "cuts at {a},{b}"
            );
        }
    }
    // Character by character.
    let chars: Vec<String> = text.chars().map(String::from).collect();
    let chunks: Vec<&str> = chars.iter().map(String::as_str).collect();
    assert_eq!(run(&stops, &chunks), want);
}

#[test]
fn partial_prefix_is_held_then_released() {
    let mut s = StopStrings::new(vec!["STOP".into()]);
    assert_eq!(s.push("abc ST"), ("abc ".to_string(), false));
    assert_eq!(s.push("O"), (String::new(), false));
    // "STOX" can no longer become "STOP": everything is released.
    assert_eq!(s.push("X and"), ("STOX and".to_string(), false));
    assert_eq!(s.push(" S"), (" ".to_string(), false));
    assert_eq!(
        s.finish(),
        "S",
        "finish releases a tail that never completed"
    );
}

#[test]
fn overlapping_and_multi_byte_stops() {
    // Self-overlapping stop: the held tail must restart inside the failed match.
    assert_eq!(
        run(&["aab"], &["a", "a", "a", "b", "c"]),
        ("a".to_string(), true)
    );
    // Multi-byte stop split inside a character is impossible (chunks are str), but split between
    // its characters works, and text before it is released.
    assert_eq!(
        run(&["终止。"], &["你好终", "止", "。之后"]),
        ("你好".to_string(), true)
    );
    // The earliest occurrence wins over a stop listed first.
    assert_eq!(
        run(&["world", "lo"], &["hello world"]),
        ("hel".to_string(), true)
    );
    // A stop that completes first ends generation even if a longer one started earlier.
    assert_eq!(
        run(&["abcd", "bc"], &["a", "b", "c", "d"]),
        ("a".to_string(), true)
    );
    assert_eq!(run(&["abcd", "bc"], &["abcd"]), ("a".to_string(), true));
    // Two stops completing at the same point: the longer one is cut.
    assert_eq!(run(&["c", "abc"], &["xabcd"]), ("x".to_string(), true));
    // Empty stop strings are ignored.
    assert_eq!(run(&[""], &["abc"]), ("abc".to_string(), false));
    // No stops: everything passes straight through.
    let mut s = StopStrings::new(vec![]);
    assert_eq!(s.push("x"), ("x".to_string(), false));
}

#[test]
fn nothing_held_without_a_possible_match() {
    let mut s = StopStrings::new(vec!["</answer>".into()]);
    for chunk in ["The ", "answer ", "is ", "42."] {
        assert_eq!(s.push(chunk), (chunk.to_string(), false));
    }
}

fn text_strategy() -> impl Strategy<Value = String> {
    // A small alphabet so stop strings occur often; includes multi-byte characters.
    proptest::collection::vec(prop::sample::select(vec!['a', 'b', 'é', '终', '🎉']), 0..40)
        .prop_map(|v| v.into_iter().collect())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2048))]

    #[test]
    fn any_chunking_gives_the_reference(
        text in text_strategy(),
        stops in proptest::collection::vec(text_strategy().prop_map(|s| s.chars().take(3).collect::<String>()), 0..4),
        cut_seeds in proptest::collection::vec(any::<prop::sample::Index>(), 0..8),
    ) {
        check_chunking(&text, &stops, &cut_seeds)?;
    }

    /// Stops cut out of the text itself, so they occur, overlap and nest often.
    #[test]
    fn any_chunking_with_stops_from_the_text(
        text in text_strategy(),
        picks in proptest::collection::vec((any::<prop::sample::Index>(), 1usize..5), 1..4),
        cut_seeds in proptest::collection::vec(any::<prop::sample::Index>(), 0..8),
    ) {
        let chars: Vec<char> = text.chars().collect();
        prop_assume!(!chars.is_empty());
        let stops: Vec<String> = picks
            .iter()
            .map(|(ix, len)| {
                let start = ix.index(chars.len());
                chars[start..(start + len).min(chars.len())].iter().collect()
            })
            .collect();
        check_chunking(&text, &stops, &cut_seeds)?;
    }
}

fn check_chunking(
    text: &str,
    stops: &[String],
    cut_seeds: &[prop::sample::Index],
) -> Result<(), TestCaseError> {
    {
        let stops: Vec<&str> = stops.iter().map(String::as_str).collect();
        let bounds: Vec<usize> = text
            .char_indices()
            .map(|(i, _)| i)
            .chain([text.len()])
            .collect();
        let mut cuts: Vec<usize> = cut_seeds
            .iter()
            .map(|ix| bounds[ix.index(bounds.len())])
            .collect();
        cuts.sort();
        cuts.dedup();
        let chunks = split_at_all(text, &cuts);
        let mut emitted_so_far = String::new();
        let mut s = StopStrings::new(stops.iter().map(|s| s.to_string()).collect());
        let mut stopped = false;
        for chunk in &chunks {
            let (emit, st) = s.push(chunk);
            emitted_so_far.push_str(&emit);
            // Never emitted: any text that already contains a stop string.
            for stop in stops.iter().filter(|s| !s.is_empty()) {
                prop_assert!(!emitted_so_far.contains(stop));
            }
            if st {
                stopped = true;
                break;
            }
        }
        if !stopped {
            emitted_so_far.push_str(&s.finish());
        }
        prop_assert_eq!((emitted_so_far, stopped), expected(&stops, text));
    }
    Ok(())
}
