//! Encoder output, decoder rules, and chunking invariance.

use cairn_sse::{
    encode_comment, encode_event, encode_event_into, Decoder, Event, EventFields, SseError,
    PING_FRAME,
};

fn decode_chunked(bytes: &[u8], size: usize) -> Vec<Event> {
    let mut d = Decoder::new();
    let mut out = Vec::new();
    for c in bytes.chunks(size.max(1)) {
        d.feed(c, &mut out).unwrap();
    }
    out
}

fn ev(event: Option<&str>, data: &str) -> Event {
    Event {
        event: event.map(String::from),
        data: data.into(),
        id: None,
        retry: None,
    }
}

#[test]
fn encodes_exact_bytes() {
    assert_eq!(
        encode_event(Some("ping"), "{}").unwrap(),
        b"event: ping\ndata: {}\n\n"
    );
    assert_eq!(encode_event(None, "[DONE]").unwrap(), b"data: [DONE]\n\n");
    assert_eq!(
        encode_event(Some("x"), "").unwrap(),
        b"event: x\ndata: \n\n"
    );
    assert_eq!(
        encode_event(Some("x"), "a\r\nb\rc\nd\n").unwrap(),
        b"event: x\ndata: a\ndata: b\ndata: c\ndata: d\ndata: \n\n"
    );
    let mut out = Vec::new();
    encode_event_into(
        &mut out,
        Some("m"),
        "d",
        EventFields {
            id: Some("7"),
            retry: Some(1500),
        },
    )
    .unwrap();
    assert_eq!(out, b"event: m\nid: 7\nretry: 1500\ndata: d\n\n");
    assert_eq!(encode_comment(""), b":\n\n");
    assert_eq!(encode_comment("a\nb"), b": a\n: b\n\n");
    assert_eq!(PING_FRAME, b"event: ping\ndata: {\"type\": \"ping\"}\n\n");
}

#[test]
fn rejects_fields_that_would_break_framing() {
    for bad in ["", "a\nb", "a\r", "\n"] {
        assert_eq!(
            encode_event(Some(bad), "x"),
            Err(SseError::InvalidEventName(bad.into()))
        );
    }
    let mut out = b"keep".to_vec();
    for bad in ["1\n", "\r", "a\0b"] {
        let r = encode_event_into(
            &mut out,
            None,
            "x",
            EventFields {
                id: Some(bad),
                retry: None,
            },
        );
        assert_eq!(r, Err(SseError::InvalidId(bad.into())));
    }
    assert_eq!(out, b"keep", "output untouched on error");
}

#[test]
fn decodes_whatwg_examples() {
    // Examples from the WHATWG specification, section "Parsing an event stream".
    let s = b"data: YHOO\ndata: +2\ndata: 10\n\n";
    assert_eq!(decode_chunked(s, 100), vec![ev(None, "YHOO\n+2\n10")]);

    let s = b": test stream\n\ndata: first event\nid: 1\n\ndata:second event\nid\n\ndata:  third event\n\n";
    let got = decode_chunked(s, 100);
    assert_eq!(got.len(), 3);
    assert_eq!(
        (got[0].data.as_str(), got[0].id.as_deref()),
        ("first event", Some("1"))
    );
    assert_eq!(
        (got[1].data.as_str(), got[1].id.as_deref()),
        ("second event", Some(""))
    );
    assert_eq!(
        (got[2].data.as_str(), got[2].id.as_deref()),
        (" third event", Some(""))
    );

    let s = b"data\n\ndata\ndata\n\ndata:";
    let mut d = Decoder::new();
    let mut got = Vec::new();
    d.feed(s, &mut got).unwrap();
    assert_eq!(got, vec![ev(None, ""), ev(None, "\n")]);
    assert!(d.has_partial());
    assert!(d.finish(), "the unterminated event is discarded");

    let s = b"data:test\n\ndata: test\n\n";
    assert_eq!(
        decode_chunked(s, 100),
        vec![ev(None, "test"), ev(None, "test")]
    );
}

#[test]
fn decoder_edge_cases() {
    // CR, LF and CRLF line ends, CR and LF split across chunks.
    let s = b"event: a\r\ndata: 1\r\r\nevent: b\rdata: 2\r\r";
    let want = vec![ev(Some("a"), "1"), ev(Some("b"), "2")];
    for size in 1..s.len() {
        assert_eq!(decode_chunked(s, size), want, "chunk size {size}");
    }
    // BOM only at the start, possibly split; invalid UTF-8 becomes U+FFFD.
    let s = b"\xEF\xBB\xBFdata: \xEF\xBB\xBFx\xFF\n\n";
    for size in 1..5 {
        assert_eq!(decode_chunked(s, size), vec![ev(None, "\u{FEFF}x\u{FFFD}")]);
    }
    // Events without data are not dispatched; unknown fields are ignored.
    assert!(decode_chunked(b"event: x\n\nretry: 5\n\nfoo: bar\n\n", 3).is_empty());
    // retry only with all-digit values; id with NUL ignored; id persists.
    let got = decode_chunked(
        b"id: 1\nretry: 10\ndata: a\n\nid: 2\0\nretry: 1x\ndata: b\n\n",
        4,
    );
    assert_eq!((got[0].id.as_deref(), got[0].retry), (Some("1"), Some(10)));
    assert_eq!((got[1].id.as_deref(), got[1].retry), (Some("1"), None));
    // Multi-byte characters split across chunks.
    let frame = encode_event(Some("é"), "日本語 🙂").unwrap();
    for size in 1..8 {
        assert_eq!(
            decode_chunked(&frame, size),
            vec![ev(Some("é"), "日本語 🙂")]
        );
    }
}

#[test]
fn limit_bounds_memory_and_resets() {
    let mut d = Decoder::with_limit(16);
    let mut out = Vec::new();
    assert!(d.feed(b"data: 0123456789abcdef", &mut out).is_err());
    assert!(!d.has_partial());
    d.feed(b"data: ok\n\n", &mut out).unwrap();
    assert_eq!(out, vec![ev(None, "ok")]);
    let mut d = Decoder::with_limit(16);
    let mut out = Vec::new();
    let r = d.feed(b"data: 0123456\ndata: 789abcdef\n\n", &mut out);
    assert_eq!(r, Err(SseError::EventTooLarge { limit: 16 }));
}

/// A whole-input reference decoder, written from the specification text.
fn reference(bytes: &[u8]) -> Vec<Event> {
    let text = String::from_utf8_lossy(bytes);
    let text = text.strip_prefix('\u{FEFF}').unwrap_or(&text);
    let norm = text.replace("\r\n", "\n").replace('\r', "\n");
    let mut lines: Vec<&str> = norm.split('\n').collect();
    lines.pop(); // the unterminated remainder is never a complete line
    let (mut out, mut event, mut data, mut id, mut retry) =
        (vec![], None, None::<String>, None, None);
    for line in lines {
        if line.is_empty() {
            if let Some(mut d) = data.take() {
                d.pop();
                out.push(Event {
                    event: event.take(),
                    data: d,
                    id: id.clone(),
                    retry: retry.take(),
                });
            }
            event = None;
            retry = None;
            continue;
        }
        if line.starts_with(':') {
            continue;
        }
        let (f, v) = line.split_once(':').unwrap_or((line, ""));
        let v = v.strip_prefix(' ').unwrap_or(v);
        match f {
            "event" => event = Some(v.to_string()),
            "data" => data
                .get_or_insert_with(String::new)
                .push_str(&format!("{v}\n")),
            "id" if !v.contains('\0') => id = Some(v.to_string()),
            "retry" if !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()) => {
                retry = v.parse().ok().or(retry)
            }
            _ => {}
        }
    }
    out
}

#[test]
fn chunking_invariance_against_reference() {
    let mut state: u64 = 0x1234_5678;
    let mut rnd = move |n: u64| {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (state >> 33) % n
    };
    let atoms: [&[u8]; 14] = [
        b"data",
        b"event",
        b"id",
        b"retry",
        b":",
        b" ",
        b"\n",
        b"\r",
        b"\r\n",
        b"x",
        b"1",
        b"\xEF\xBB\xBF",
        b"\xC3\xA9",
        b"\0",
    ];
    for _ in 0..3000 {
        let mut s = Vec::new();
        for _ in 0..rnd(40) {
            s.extend_from_slice(atoms[rnd(atoms.len() as u64) as usize]);
        }
        let want = reference(&s);
        assert_eq!(
            decode_chunked(&s, s.len()),
            want,
            "{:?}",
            String::from_utf8_lossy(&s)
        );
        let size = 1 + rnd(5) as usize;
        assert_eq!(
            decode_chunked(&s, size),
            want,
            "{:?} / {size}",
            String::from_utf8_lossy(&s)
        );
    }
}
