//! The gemma4 parser (see text_formats_common.rs): no panics, any chunking
//! equals the one-shot parse, well-formed calls round-trip.
#![no_main]
use libfuzzer_sys::fuzz_target;

#[path = "text_formats_common.rs"]
mod common;

fuzz_target!(|inp: common::Input| common::run(cairn_text::Family::Gemma4, inp));
