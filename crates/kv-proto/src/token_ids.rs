//! `kvindexer.v1.TokenIds` (`repeated uint32 ids = 1`), encoded and decoded by hand.
//!
//! Every client sends a prompt's token ids this way first, and a prompt is thousands of ids.
//! prost's generated code handles a packed varint list one byte at a time through `BufMut` /
//! `Buf` (a capacity or bounds check and a call per byte, slower still through tonic's
//! buffers), which made the varint form of ScorePods about twice as slow as the packed
//! little-endian form. This type is the same message on the wire (prost-build maps
//! `.kvindexer.v1.TokenIds` here with `extern_path`); it writes the varints into a stack
//! buffer flushed with one copy per 2 KiB, and reads them from each contiguous chunk of the
//! input eight bytes at a time (every varint of up to 3 bytes that ends in the word).
//!
//! Invariants (protobuf's rules for a `repeated uint32`, as prost applies them):
//! - encoding is packed (one length-delimited field 1), nothing for an empty list;
//! - decoding accepts packed and unpacked elements, in any mix, each a varint of at most 10
//!   bytes truncated to its low 32 bits; a packed run that ends inside a varint, or a length
//!   past the input, is a [`DecodeError`]; other fields are skipped;
//! - memory reserved up front never exceeds the bytes actually present (one id per byte at
//!   most), so a length prefix cannot make a small input allocate much.

use prost::bytes::{Buf, BufMut};
use prost::encoding::{self, DecodeContext, WireType};
use prost::DecodeError;

/// A prompt's token ids (`TokenIds` in `proto/kvindexer/v1/kv_indexer.proto`).
#[derive(Clone, PartialEq, Eq, Hash, Default, Debug)]
pub struct TokenIds {
    /// The ids, in prompt order.
    pub ids: Vec<u32>,
}

/// The packed payload's length (the ids' varints, without key or length prefix): one byte
/// per id, plus one for each 7-bit boundary it passes. Summed in `u32` lanes over batches
/// that cannot overflow them, so the compiler vectorises the loop (prost asks for the length
/// before it encodes, and the encoder writes it first: it is computed twice a message).
fn payload_len(ids: &[u32]) -> usize {
    ids.chunks(1 << 24)
        .map(|batch| {
            batch
                .iter()
                .map(|&v| {
                    1 + u32::from(v >= 1 << 7)
                        + u32::from(v >= 1 << 14)
                        + u32::from(v >= 1 << 21)
                        + u32::from(v >= 1 << 28)
                })
                .sum::<u32>() as usize
        })
        .sum()
}

/// Bytes written to the stack buffer before it is flushed to the output.
const CHUNK: usize = 2048;

/// Writes `v` as a varint at the start of `out` (5 bytes of room); returns its length. Ids
/// below 2^21 (3 bytes or fewer) are spread into one little-endian word without branches.
#[inline(always)]
fn put_varint(v: u32, out: &mut [u8; 5]) -> usize {
    if v < 1 << 21 {
        let len = 1 + usize::from(v >= 1 << 7) + usize::from(v >= 1 << 14);
        // 7 bits per byte, then a continuation bit on every byte but the last.
        let spread = (v & 0x7f) | (v << 1) & 0x7f00 | (v << 2) & 0x7f_0000;
        let cont = [0, 0x80, 0x8080][len - 1];
        out[..4].copy_from_slice(&(spread | cont).to_le_bytes());
        len
    } else {
        let mut v = v;
        let mut n = 0;
        while v >= 0x80 {
            out[n] = v as u8 | 0x80;
            v >>= 7;
            n += 1;
        }
        out[n] = v as u8;
        n + 1
    }
}

impl prost::Message for TokenIds {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        if self.ids.is_empty() {
            return;
        }
        encoding::encode_key(1, WireType::LengthDelimited, buf);
        encoding::encode_varint(payload_len(&self.ids) as u64, buf);
        let mut chunk = [0u8; CHUNK];
        // Ids in batches that always fit the buffer's room (5 bytes each at most), so the
        // loop over a batch checks nothing but the ids.
        for batch in self.ids.chunks(CHUNK / 5) {
            let mut n = 0;
            for &v in batch {
                let out: &mut [u8; 5] = match (&mut chunk[n..n + 5]).try_into() {
                    Ok(out) => out,
                    Err(_) => unreachable!("a batch's varints fit the buffer"),
                };
                n += put_varint(v, out);
            }
            buf.put_slice(&chunk[..n]);
        }
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), DecodeError> {
        if tag != 1 {
            return encoding::skip_field(wire_type, tag, buf, ctx);
        }
        match wire_type {
            WireType::Varint => {
                self.ids.push(encoding::decode_varint(buf)? as u32);
                Ok(())
            }
            WireType::LengthDelimited => merge_packed(&mut self.ids, buf),
            _ => Err(error(
                "TokenIds.ids: wire type not varint or length-delimited",
            )),
        }
    }

    fn encoded_len(&self) -> usize {
        if self.ids.is_empty() {
            return 0;
        }
        let payload = payload_len(&self.ids);
        encoding::key_len(1) + encoding::encoded_len_varint(payload as u64) + payload
    }

    fn clear(&mut self) {
        self.ids.clear();
    }
}

/// A decode error saying what was wrong. prost 0.14 marks its constructor deprecated (meant for
/// its own generated code) and offers no other for a hand-written `Message`; this is the one
/// place that calls it.
#[allow(deprecated)]
fn error(what: &'static str) -> DecodeError {
    DecodeError::new(what)
}

/// Reads a packed run (its length prefix, then varints) into `ids`.
fn merge_packed(ids: &mut Vec<u32>, buf: &mut impl Buf) -> Result<(), DecodeError> {
    let len = encoding::decode_varint(buf)?;
    let mut left = usize::try_from(len)
        .ok()
        .filter(|&l| l <= buf.remaining())
        .ok_or_else(|| error("TokenIds.ids: packed length past the input"))?;
    // At most one id per byte; never more than is there.
    ids.reserve(left);
    while left > 0 {
        let chunk = buf.chunk();
        let take = chunk.len().min(left);
        let used = decode_complete(&chunk[..take], ids)?;
        buf.advance(used);
        left -= used;
        if left > 0 && used < take {
            // A varint split between two chunks of the input: read it the slow way, and
            // check that it ends inside the run.
            let before = buf.remaining();
            let v = encoding::decode_varint(buf)?;
            let used = before - buf.remaining();
            if used > left {
                return Err(error("TokenIds.ids: a varint runs past its field"));
            }
            left -= used;
            ids.push(v as u32);
        } else if used == 0 && left > 0 {
            // An empty chunk with bytes left: the Buf broke its contract; do not spin.
            return Err(error("TokenIds.ids: input ended inside the field"));
        }
    }
    Ok(())
}

/// Decodes every varint that ends inside `s` into `ids`; returns the bytes consumed (short of
/// `s.len()` only when `s` ends inside a varint).
#[inline]
fn decode_complete(s: &[u8], ids: &mut Vec<u32>) -> Result<usize, DecodeError> {
    let mut i = 0;
    // While a whole varint of any length fits, the varints of up to 3 bytes (every vocabulary
    // up to 2M tokens) that end inside the next 8 bytes are read from one word: the bytes
    // without a continuation bit end them, so one load serves two or three ids.
    while let Some(w) = s.get(i..i + 10) {
        let word = u64::from_le_bytes([w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]]);
        let mut ends = !word & 0x8080_8080_8080_8080;
        let mut start = 0u32; // bytes of the word consumed
        while ends != 0 {
            let end = ends.trailing_zeros() / 8 + 1; // bytes through this varint's last
            let len = end - start;
            if len > 3 {
                break;
            }
            let kept = (word >> (8 * start)) as u32 & (u32::MAX >> (32 - 8 * len));
            ids.push((kept & 0x7f) | (kept >> 1) & 0x3f80 | (kept >> 2) & 0x1f_c000);
            start = end;
            ends &= ends - 1;
        }
        if start > 0 {
            i += start as usize;
            continue;
        }
        match decode_one(&s[i..])? {
            Some((v, len)) => {
                ids.push(v);
                i += len;
            }
            None => return Ok(i),
        }
    }
    while i < s.len() {
        match decode_one(&s[i..])? {
            Some((v, len)) => {
                ids.push(v);
                i += len;
            }
            None => break,
        }
    }
    Ok(i)
}

/// The varint at the start of `s` (its low 32 bits) and its length; `None` when `s` ends
/// inside it.
fn decode_one(s: &[u8]) -> Result<Option<(u32, usize)>, DecodeError> {
    let mut v = 0u64;
    for (k, &b) in s.iter().enumerate() {
        // The tenth byte may carry only bit 63 (prost's rule for a u64 varint).
        if k == 10 || (k == 9 && b > 1) {
            return Err(error("TokenIds.ids: invalid varint"));
        }
        v |= u64::from(b & 0x7f) << (7 * k);
        if b < 0x80 {
            return Ok(Some((v as u32, k + 1)));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests;
