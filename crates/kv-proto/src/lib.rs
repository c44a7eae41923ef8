//! kv-indexer's gRPC types, generated at build time from the top-level `proto/`: one home for
//! the daemon's servers, the `score` command and loadgen's client.
//!
//! - [`kvindexer_v1`]: `proto/kvindexer/v1/kv_indexer.proto` (ScorePods, ListPods, ClearPod);
//! - [`indexer_v1`]: `proto/indexer/v1/indexer.proto` (llm-d's `GetPodScores`, field for field);
//! - [`llmd_upstream`]: llm-d's own copy of that schema (client only, for tests);
//! - [`FILE_DESCRIPTOR_SET`]: both schemas encoded, for server reflection;
//! - [`token_ids_le`]: the packed form of `ScorePodsRequest.token_ids_le`, both ways;
//! - [`token_ids`]: `TokenIds` (the varint list), encoded and decoded by hand.

/// Generated code for `proto/kvindexer/v1/kv_indexer.proto`.
pub mod kvindexer_v1 {
    #![allow(missing_docs, clippy::all, clippy::pedantic)]
    tonic::include_proto!("kvindexer.v1");
    pub use crate::token_ids::TokenIds;
}

pub mod token_ids;

/// Generated code for `proto/indexer/v1/indexer.proto`.
pub mod indexer_v1 {
    #![allow(missing_docs, clippy::all, clippy::pedantic)]
    tonic::include_proto!("indexer.v1");
}

/// A client generated from llm-d's own `indexer.proto` (vendored unchanged in
/// `proto/vendor/llm-d`, with its origin): tests read kv-indexer's `GetPodScores` through it,
/// so the schema llm-d's gateways compile against is what is checked, not ours.
pub mod llmd_upstream {
    #![allow(missing_docs, clippy::all, clippy::pedantic)]
    include!(concat!(env!("OUT_DIR"), "/llmd_upstream/indexer.v1.rs"));
}

/// Encoded descriptors of both schemas, for server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("kv_indexer_descriptor");

/// `ScorePodsRequest.token_ids_le`: token ids packed as little-endian u32. One implementation
/// for the server and every client, so both sides agree on the byte order.
pub mod token_ids_le {
    /// Packs token ids, 4 bytes each, little-endian.
    pub fn encode(ids: &[u32]) -> Vec<u8> {
        let mut out = Vec::with_capacity(ids.len() * 4);
        for id in ids {
            out.extend_from_slice(&id.to_le_bytes());
        }
        out
    }

    /// Unpacks token ids; `None` when the length is not a multiple of 4 (a truncated or
    /// mis-encoded field).
    pub fn decode(bytes: &[u8]) -> Option<Vec<u32>> {
        if !bytes.len().is_multiple_of(4) {
            return None;
        }
        Some(
            bytes
                .chunks_exact(4)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
        )
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn packs_little_endian_and_round_trips() {
            let ids = [0, 1, 0x0102_0304, u32::MAX, 151_643];
            let bytes = super::encode(&ids);
            assert_eq!(&bytes[8..12], &[4, 3, 2, 1], "least significant byte first");
            assert_eq!(super::decode(&bytes).as_deref(), Some(&ids[..]));
            assert_eq!(super::decode(&[]), Some(vec![]));
        }

        #[test]
        fn a_length_not_a_multiple_of_four_is_refused() {
            let bytes = super::encode(&[7, 8]);
            for cut in [1, 2, 3, 5] {
                assert_eq!(super::decode(&bytes[..cut]), None, "{cut} bytes");
            }
        }
    }
}
