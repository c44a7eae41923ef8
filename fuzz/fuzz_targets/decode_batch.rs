//! The event decoder on arbitrary bytes: never a panic; anything it accepts re-encodes (kv-core's
//! encoder, map form) to bytes that decode and re-encode to themselves.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(batch) = kv_core::decode_batch(data) else {
        return;
    };
    let once = kv_core::encode_batch(&batch);
    let again = kv_core::decode_batch(&once).expect("what the encoder writes decodes");
    assert_eq!(kv_core::encode_batch(&again), once, "encode(decode(x)) is stable");
});
