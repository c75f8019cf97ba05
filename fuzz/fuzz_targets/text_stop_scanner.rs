//! Differential: the streaming StopScanner against the brute-force reference,
//! for any stops, text and chunking; the hold-back is checked after every push.
#![no_main]
use arbitrary::Arbitrary;
use cairn_text::{reference, StopScanner};
use libfuzzer_sys::fuzz_target;

#[path = "text_common.rs"]
#[allow(dead_code)]
mod common;

#[derive(Arbitrary, Debug)]
struct Input {
    stops: Vec<String>,
    text: String,
    cuts: Vec<u8>,
}

fuzz_target!(|inp: Input| {
    let stops: Vec<&str> = inp.stops.iter().take(8).map(|s| s.as_str()).collect();
    let Ok(mut s) = StopScanner::new(&stops) else {
        assert!(stops.iter().any(|s| s.is_empty()));
        return;
    };
    let (want, want_stop) = reference::stop_scan(&stops, &inp.text);
    let mut out = String::new();
    let mut seen = String::new();
    let mut got_stop = None;
    for c in common::chunk(&inp.text, &inp.cuts) {
        seen.push_str(&c);
        let (v, m) = s.push(&c);
        out.push_str(&v);
        if m.is_some() {
            got_stop = m;
            break;
        }
        let keep = reference::stop_holdback(&stops, &seen);
        assert_eq!(out, seen[..seen.len() - keep]);
    }
    out.push_str(&s.flush());
    assert_eq!((out, got_stop), (want, want_stop));
});
