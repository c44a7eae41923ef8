//! kv-proto's hand-written `TokenIds` decoder (every client's prompt goes through it) against
//! prost's own derive of the same message, on arbitrary bytes: both accept the same inputs and
//! decode the same ids, from one slice and from a buffer split into chunks anywhere (a varint
//! or a key straddling two); whatever decodes encodes to the bytes prost encodes. Never a
//! panic.
//!
//! Input layout: byte 0 is the chunk size of the split buffer (1-256), the rest the message.
#![no_main]

use kv_proto::token_ids::chunked::Chunked;
use kv_proto::token_ids::TokenIds;
use libfuzzer_sys::fuzz_target;
use prost::bytes::Bytes;
use prost::Message;

/// `message TokenIds { repeated uint32 ids = 1; }` as prost generates it: the reference.
#[derive(Clone, PartialEq, prost::Message)]
struct Reference {
    #[prost(uint32, repeated, tag = "1")]
    ids: Vec<u32>,
}

fuzz_target!(|data: &[u8]| {
    let Some((&step, message)) = data.split_first() else {
        return;
    };
    let ours = TokenIds::decode(message);
    let theirs = Reference::decode(message);
    assert_eq!(
        ours.as_ref().map(|t| &t.ids).ok(),
        theirs.as_ref().map(|r| &r.ids).ok(),
        "the decoders disagree on {message:?}"
    );
    let chunked = Chunked {
        bytes: Bytes::copy_from_slice(message),
        step: usize::from(step) + 1,
    };
    let split = TokenIds::decode(chunked);
    assert_eq!(
        split.as_ref().map(|t| &t.ids).ok(),
        ours.as_ref().map(|t| &t.ids).ok(),
        "a split buffer decodes otherwise ({} bytes a chunk)",
        usize::from(step) + 1
    );
    if let (Ok(ours), Ok(theirs)) = (ours, theirs) {
        assert_eq!(ours.encoded_len(), theirs.encoded_len());
        assert_eq!(ours.encode_to_vec(), theirs.encode_to_vec());
    }
});
