//! Differential: the streaming StopScanner against the brute-force reference,
//! for any stops, text and chunking; the hold-back is checked after every push.
#![no_main]
use arbitrary::Arbitrary;
use cairn_text::StopScanner;
use libfuzzer_sys::fuzz_target;

#[path = "../../rust/text/tests/common/stop_check.rs"]
mod stop_check;
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
    let Ok(s) = StopScanner::new(&stops) else {
        assert!(stops.iter().any(|s| s.is_empty()));
        return;
    };
    let chunks = common::chunk(&inp.text, &inp.cuts);
    stop_check::matches_reference(s, &stops, &inp.text, &chunks);
});
