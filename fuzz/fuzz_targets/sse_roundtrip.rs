//! encode -> decode gives back every event (CR and CRLF in data become LF),
//! for any chunking; invalid names and ids are refused, never written.
#![no_main]

use arbitrary::Arbitrary;
use cairn_sse::{encode_comment_into, encode_event_into, Decoder, Event, EventFields};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
enum Frame {
    Event {
        name: Option<String>,
        data: String,
        id: Option<String>,
        retry: Option<u64>,
    },
    Comment(String),
}

fuzz_target!(|input: (Vec<Frame>, Vec<u8>)| {
    let (frames, cuts) = input;
    let mut body = Vec::new();
    let mut want = Vec::new();
    let mut last_id: Option<String> = None;
    for f in &frames {
        match f {
            Frame::Event {
                name,
                data,
                id,
                retry,
            } => {
                let before = body.len();
                let fields = EventFields {
                    id: id.as_deref(),
                    retry: *retry,
                };
                let bad_name = name
                    .as_deref()
                    .is_some_and(|n| n.is_empty() || n.contains(['\r', '\n']));
                let bad_id = id
                    .as_deref()
                    .is_some_and(|i| i.contains(['\r', '\n', '\0']));
                let r = encode_event_into(&mut body, name.as_deref(), data, fields);
                assert_eq!(r.is_err(), bad_name || bad_id);
                if r.is_err() {
                    assert_eq!(body.len(), before);
                    continue;
                }
                if id.is_some() {
                    last_id = id.clone();
                }
                want.push(Event {
                    event: name.clone(),
                    data: data.replace("\r\n", "\n").replace('\r', "\n"),
                    id: last_id.clone(),
                    retry: *retry,
                });
            }
            Frame::Comment(text) => encode_comment_into(&mut body, text),
        }
    }
    let mut d = Decoder::new();
    let mut got = Vec::new();
    let mut rest = &body[..];
    let mut i = 0;
    while !rest.is_empty() {
        let n = cuts
            .get(i)
            .map_or(rest.len(), |&c| c as usize % 11 + 1)
            .min(rest.len());
        d.feed(&rest[..n], &mut got).unwrap();
        rest = &rest[n..];
        i += 1;
    }
    assert!(!d.finish());
    assert_eq!(got, want);
});
