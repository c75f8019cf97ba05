//! The streaming `StopScanner` against the brute-force reference, for the
//! differential test and the `text_stop_scanner` fuzz target (which includes
//! this file with `#[path]`, so it uses nothing but `cairn_text`).
use cairn_text::{reference, StopScanner};

/// Streams `chunks` (the pieces of `text`) through `s`, built for `stops`:
/// before a match, exactly the longest suffix that is a stop's prefix is
/// held back after every push, and the visible text and the stop equal the
/// one-shot reference scan.
pub fn matches_reference(mut s: StopScanner, stops: &[&str], text: &str, chunks: &[String]) {
    let (want_text, want_stop) = reference::stop_scan(stops, text);
    let mut seen = String::new();
    let mut out = String::new();
    let mut got_stop = None;
    for c in chunks {
        seen.push_str(c);
        let (v, m) = s.push(c);
        out.push_str(&v);
        if m.is_some() {
            got_stop = m;
            break;
        }
        let keep = reference::stop_holdback(stops, &seen);
        assert_eq!(
            out,
            seen[..seen.len() - keep],
            "stops {stops:?} text {text:?}"
        );
        assert_eq!(s.held(), &seen[seen.len() - keep..]);
    }
    out.push_str(&s.flush());
    assert_eq!(
        (out.as_str(), got_stop),
        (want_text.as_str(), want_stop),
        "stops {stops:?} text {text:?}"
    );
}
