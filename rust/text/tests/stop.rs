mod common;

use cairn_text::{StopScanner, TextError};
use common::{chunks_of, random_chunks, random_text, stop_check, Rng};

/// Streams `chunks` through a scanner; returns visible text and the stop.
fn run(stops: &[&str], chunks: &[&str], flush: bool) -> (String, Option<String>) {
    let mut s = StopScanner::new(stops).unwrap();
    let mut out = String::new();
    let mut stop = None;
    for c in chunks {
        let (v, m) = s.push(c);
        out.push_str(&v);
        if let Some(i) = m {
            assert!(stop.is_none(), "a second match was reported");
            stop = Some(stops[i].to_owned());
        }
    }
    if flush {
        out.push_str(&s.flush());
    }
    (out, stop)
}

#[test]
fn must_hold_cases() {
    assert_eq!(
        run(&["###"], &["Hello #", "#", "# world"], true),
        ("Hello ".into(), Some("###".into()))
    );
    assert_eq!(run(&["###"], &["a ##", "x"], true), ("a ##x".into(), None));
    assert_eq!(
        run(&["a", "is"], &[" The user is a"], true),
        (" The user ".into(), Some("is".into()))
    );
    assert_eq!(
        run(&["abc", "b"], &["abc"], true),
        ("a".into(), Some("b".into()))
    );
    assert_eq!(
        run(&["gani"], &["VLLM is a 100% volunteer organization"], true),
        ("VLLM is a 100% volunteer or".into(), Some("gani".into()))
    );
}

#[test]
fn holds_back_then_releases() {
    let mut s = StopScanner::new(&["###"]).unwrap();
    assert_eq!(s.push("a ##"), ("a ".into(), None));
    assert_eq!(s.held(), "##");
    assert_eq!(s.push("x"), ("##x".into(), None));
    assert_eq!(s.flush(), "");
}

#[test]
fn nothing_after_a_match() {
    let mut s = StopScanner::new(&["END"]).unwrap();
    assert_eq!(s.push("abcENDdef"), ("abc".into(), Some(0)));
    assert_eq!(s.push("more"), (String::new(), None));
    assert_eq!(s.flush(), "");
    // flush resets: a new stream works again.
    assert_eq!(s.push("xEND"), ("x".into(), Some(0)));
}

#[test]
fn ties_and_priorities() {
    // Same end: the one listed first wins, even when it is shorter.
    assert_eq!(
        run(&["c", "abc"], &["xabc"], true),
        ("xab".into(), Some("c".into()))
    );
    assert_eq!(
        run(&["abc", "c"], &["xabc"], true),
        ("x".into(), Some("abc".into()))
    );
    // Earliest completion wins over a longer match that starts earlier.
    assert_eq!(
        run(&["abcd", "bc"], &["abcd"], true),
        ("a".into(), Some("bc".into()))
    );
    // Duplicates are harmless.
    assert_eq!(
        run(&["x", "x"], &["ax"], true),
        ("a".into(), Some("x".into()))
    );
}

#[test]
fn utf8_stops_and_text() {
    for n in 1..5 {
        let text = "héllo wörld ✓ ende 🙂 fin";
        let chunks = chunks_of(text, n);
        let refs: Vec<&str> = chunks.iter().map(|s| s.as_str()).collect();
        assert_eq!(
            run(&["✓ e"], &refs, true),
            ("héllo wörld ".into(), Some("✓ e".into()))
        );
        assert_eq!(
            run(&["🙂"], &refs, true),
            ("héllo wörld ✓ ende ".into(), Some("🙂".into()))
        );
        assert_eq!(run(&["🙃"], &refs, true), (text.into(), None));
    }
}

#[test]
fn long_self_overlapping_stop_builds_fast_and_works() {
    // Quadratic to build as a DFA; linear as an NFA.
    let stop = "s".repeat(200_000);
    let mut s = StopScanner::new(&[stop.as_str()]).unwrap();
    let text = format!("{}x{}", &stop[1..], stop);
    let (out, m) = s.push(&text);
    assert_eq!((out.len(), m), (stop.len(), Some(0)));
}

#[test]
fn empty_stop_is_an_error_and_empty_list_passes_through() {
    assert_eq!(
        StopScanner::new(&["a", ""]).unwrap_err(),
        TextError::EmptyStop { index: 1 }
    );
    let mut s = StopScanner::new::<&str>(&[]).unwrap();
    assert_eq!(s.push("anything ###"), ("anything ###".into(), None));
}

#[test]
fn differential_against_naive_reference() {
    let alphabet = ["a", "b", "c", "ab", "#", "é", "🙂", " "];
    let mut rng = Rng(0x5eed_1234_abcd_0001);
    for _ in 0..4000 {
        let nstops = 1 + rng.below(4);
        let stops: Vec<String> = (0..nstops)
            .map(|_| {
                let s = random_text(&mut rng, &alphabet, 4);
                if s.is_empty() {
                    "a".into()
                } else {
                    s
                }
            })
            .collect();
        let stops: Vec<&str> = stops.iter().map(|s| s.as_str()).collect();
        let text = random_text(&mut rng, &alphabet, 20);
        let s = StopScanner::new(&stops).unwrap();
        let chunks = random_chunks(&text, &mut rng);
        stop_check::matches_reference(s, &stops, &text, &chunks);
    }
}
