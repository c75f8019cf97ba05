//! Any bytes, any chunking: the decoder never panics, chunking never changes
//! the events, and a size limit only ever turns into an error.
#![no_main]

use cairn_sse::{Decoder, Event};
use libfuzzer_sys::fuzz_target;

fn decode(bytes: &[u8], cuts: &[u8]) -> (Vec<Event>, bool) {
    let mut d = Decoder::new();
    let mut out = Vec::new();
    let mut rest = bytes;
    for &c in cuts.iter().cycle().take(bytes.len()) {
        if rest.is_empty() {
            break;
        }
        let n = (c as usize % 7 + 1).min(rest.len());
        d.feed(&rest[..n], &mut out).unwrap();
        rest = &rest[n..];
    }
    d.feed(rest, &mut out).unwrap();
    let partial = d.has_partial();
    assert_eq!(d.finish(), partial);
    assert!(!d.has_partial());
    (out, partial)
}

fuzz_target!(|input: (Vec<u8>, Vec<u8>, u16)| {
    let (bytes, cuts, limit) = input;
    let whole = decode(&bytes, &[]);
    let cut = if cuts.is_empty() {
        whole.clone()
    } else {
        decode(&bytes, &cuts)
    };
    assert_eq!(whole, cut);
    for e in &whole.0 {
        assert!(e.event.as_deref().is_none_or(|n| !n.contains(['\r', '\n'])));
        assert!(!e.data.contains('\r'));
    }
    // With a limit: the events before the error are a prefix of the full list.
    let mut d = Decoder::with_limit(limit as usize);
    let mut out = Vec::new();
    if d.feed(&bytes, &mut out).is_ok() {
        d.finish();
        assert_eq!(out, whole.0);
    } else {
        assert!(whole.0.starts_with(&out));
        assert!(!d.has_partial());
    }
});
