//! TextPipeline: any chunking equals "reference stop scan, then one-shot
//! parse of the visible text", and nothing is returned after a stop.
#![no_main]
use arbitrary::Arbitrary;
use cairn_text::{parse_output, reference, OutputParser, TextPipeline};
use libfuzzer_sys::fuzz_target;

#[path = "text_common.rs"]
mod common;

#[derive(Arbitrary, Debug)]
struct Input {
    stops: Vec<common::Piece>,
    pieces: Vec<common::Piece>,
    family: u8,
    reasoning: bool,
    cuts: Vec<u8>,
}

fuzz_target!(|inp: Input| {
    let stops: Vec<String> = inp
        .stops
        .iter()
        .take(4)
        .map(|p| common::build(std::slice::from_ref(p)))
        .filter(|s| !s.is_empty())
        .collect();
    let text = common::build(&inp.pieces);
    let family = common::family(inp.family);
    let stop_refs: Vec<&str> = stops.iter().map(|s| s.as_str()).collect();
    let (visible, want_stop) = reference::stop_scan(&stop_refs, &text);
    let want = parse_output(&visible, family, inp.reasoning, false).unwrap();

    let mut p = TextPipeline::new(&stops, family, inp.reasoning, false).unwrap();
    let mut got = Vec::new();
    let mut got_stop = None;
    for c in common::chunk(&text, &inp.cuts) {
        let (segs, m) = p.push(&c);
        if got_stop.is_some() {
            assert!(segs.is_empty() && m.is_none());
        }
        got.extend(segs);
        got_stop = got_stop.or(m);
    }
    got.extend(p.flush());
    assert_eq!((OutputParser::coalesce(got), got_stop), (want, want_stop));
});
