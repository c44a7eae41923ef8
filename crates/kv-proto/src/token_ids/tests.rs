//! The hand-written `TokenIds` against prost's own derive of the same message: the same bytes
//! out, the same ids (or an error) back, from one slice or from a buffer split anywhere.

use prost::bytes::Bytes;
use prost::Message;

use super::chunked::Chunked;
use super::TokenIds;

/// `message TokenIds { repeated uint32 ids = 1; }` as prost generates it (packed).
#[derive(Clone, PartialEq, prost::Message)]
struct Packed {
    #[prost(uint32, repeated, tag = "1")]
    ids: Vec<u32>,
}

/// The same field sent unpacked (one varint field per id), as some encoders may.
#[derive(Clone, PartialEq, prost::Message)]
struct Unpacked {
    #[prost(uint32, repeated, packed = "false", tag = "1")]
    ids: Vec<u32>,
}

/// Ids of every varint width, from a fixed-seed generator.
fn ids(n: usize, seed: u64) -> Vec<u32> {
    let mut x = seed;
    (0..n)
        .map(|i| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let r = (x >> 32) as u32;
            match i % 6 {
                0 => 0,
                1 => r % 128,
                2 => r % 16_384,
                3 => r % 151_936,
                4 => r,
                _ => u32::MAX - (r % 3),
            }
        })
        .collect()
}

#[test]
fn encodes_the_bytes_prost_encodes() {
    for n in [0, 1, 2, 200, 8_000] {
        let ids = ids(n, n as u64 + 7);
        let ours = TokenIds { ids: ids.clone() };
        let theirs = Packed { ids };
        assert_eq!(ours.encoded_len(), theirs.encoded_len(), "{n} ids");
        assert_eq!(ours.encode_to_vec(), theirs.encode_to_vec(), "{n} ids");
    }
}

#[test]
fn decodes_what_prost_encodes_packed_or_not_from_any_split() {
    let ids = ids(3_000, 11);
    let packed = Packed { ids: ids.clone() }.encode_to_vec();
    let unpacked = Unpacked { ids: ids.clone() }.encode_to_vec();
    // Both forms in one message: repeated fields concatenate.
    let mut mixed = packed.clone();
    mixed.extend_from_slice(&Unpacked { ids: vec![5, 300] }.encode_to_vec());
    let mut both = ids.clone();
    both.extend([5, 300]);
    for (bytes, want) in [(&packed, &ids), (&unpacked, &ids), (&mixed, &both)] {
        let got = TokenIds::decode(bytes.as_slice()).expect("decodes");
        assert_eq!(&got.ids, want);
        for step in [1, 2, 3, 5, 7, 64, 1_000] {
            let buf = Chunked {
                bytes: Bytes::from(bytes.clone()),
                step,
            };
            let got = TokenIds::decode(buf).expect("decodes split input");
            assert_eq!(&got.ids, want, "chunks of {step} bytes");
        }
    }
}

/// Ids whose widths follow a random walk: long runs of 1-, 2- and 3-byte varints (more than
/// four to a word, or a word ending inside one), now and then a 4-5-byte one.
fn random_widths(n: usize, seed: u64) -> Vec<u32> {
    let mut x = seed;
    let mut next = move || {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (x >> 32) as u32
    };
    let mut width = 1;
    (0..n)
        .map(|_| {
            let r = next();
            if r % 8 == 0 {
                width = 1 + next() % 3;
            }
            match (r % 97, width) {
                (0, _) => r | 1 << 28,
                (1, _) => (r >> 8) | 1 << 21,
                (_, 1) => r % 128,
                (_, 2) => 128 + r % (16_384 - 128),
                _ => 16_384 + r % (151_936 - 16_384),
            }
        })
        .collect()
}

#[test]
fn decodes_random_runs_of_widths_as_prost_does() {
    for seed in 0..200 {
        let ids = random_widths(64 + seed as usize * 7, seed);
        let bytes = Packed { ids: ids.clone() }.encode_to_vec();
        assert_eq!(
            TokenIds::decode(bytes.as_slice()).expect("decodes").ids,
            ids,
            "seed {seed}"
        );
        for step in [1, 9, 13, 64] {
            let buf = Chunked {
                bytes: Bytes::from(bytes.clone()),
                step,
            };
            let got = TokenIds::decode(buf).expect("decodes split input");
            assert_eq!(got.ids, ids, "seed {seed}, chunks of {step} bytes");
        }
    }
}

#[test]
fn large_varints_truncate_to_32_bits_as_prost_does() {
    // Field 1, packed: 2^35 + 9 (5 bytes) and u64::MAX (10 bytes).
    let mut payload = Vec::new();
    prost::encoding::encode_varint((1u64 << 35) + 9, &mut payload);
    prost::encoding::encode_varint(u64::MAX, &mut payload);
    let mut msg = vec![0x0a];
    prost::encoding::encode_varint(payload.len() as u64, &mut msg);
    msg.extend_from_slice(&payload);
    let theirs = Packed::decode(msg.as_slice()).expect("prost decodes");
    let ours = TokenIds::decode(msg.as_slice()).expect("decodes");
    assert_eq!(ours.ids, theirs.ids);
    assert_eq!(ours.ids, vec![9, u32::MAX]);
}

#[test]
fn malformed_input_is_an_error_where_prost_errs() {
    let good = Packed {
        ids: vec![1, 300, 70_000],
    }
    .encode_to_vec();
    let cases: Vec<(&str, Vec<u8>)> = vec![
        // The last varint cut short: the run ends inside it.
        ("truncated input", good[..good.len() - 1].to_vec()),
        // A run whose length says one byte less: its last varint runs past the field.
        ("run ends inside a varint", {
            let mut b = good.clone();
            b[1] -= 1;
            b
        }),
        // A length past the input.
        ("length past the input", {
            let mut b = good.clone();
            b[1] += 10;
            b
        }),
        // Eleven continuation bytes.
        ("varint over 10 bytes", {
            let mut b = vec![0x0a, 11];
            b.extend([0xff; 10]);
            b.push(0x01);
            b
        }),
        // Ten bytes whose last carries more than bit 63.
        ("tenth byte over 1", {
            let mut b = vec![0x0a, 10];
            b.extend([0xff; 9]);
            b.push(0x02);
            b
        }),
        // Field 1 as a fixed32: not a uint32's wire type.
        ("wrong wire type", vec![0x0d, 1, 0, 0, 0]),
    ];
    for (name, bytes) in &cases {
        assert!(
            Packed::decode(bytes.as_slice()).is_err(),
            "prost accepts {name}"
        );
        assert!(
            TokenIds::decode(bytes.as_slice()).is_err(),
            "{name} accepted"
        );
        // The same input one byte per chunk.
        let buf = Chunked {
            bytes: Bytes::from(bytes.clone()),
            step: 1,
        };
        assert!(TokenIds::decode(buf).is_err(), "{name} accepted, split");
    }
}

#[test]
fn unknown_fields_are_skipped_and_the_message_round_trips_in_a_request() {
    use crate::kvindexer_v1::score_pods_request::Input;
    use crate::kvindexer_v1::ScorePodsRequest;
    // Field 2 (a string) beside the ids.
    let mut bytes = Packed { ids: vec![4, 5] }.encode_to_vec();
    bytes.extend([0x12, 2, b'h', b'i']);
    assert_eq!(
        TokenIds::decode(bytes.as_slice()).expect("decodes").ids,
        [4, 5]
    );
    let req = ScorePodsRequest {
        model: "m".into(),
        input: Some(Input::Tokens(TokenIds { ids: ids(8_000, 3) })),
        pods: vec!["a".into(), "b".into()],
        ..Default::default()
    };
    let back = ScorePodsRequest::decode(req.encode_to_vec().as_slice()).expect("decodes");
    assert_eq!(back, req);
}
