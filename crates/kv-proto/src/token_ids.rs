//! `kvindexer.v1.TokenIds` (`repeated uint32 ids = 1`), encoded and decoded by hand.
//!
//! Every client sends a prompt's token ids this way first, and a prompt is thousands of ids.
//! prost's generated code handles a packed varint list one byte at a time through `BufMut` /
//! `Buf` (a capacity or bounds check and a call per byte, slower still through tonic's
//! buffers), which made the varint form of ScorePods about twice as slow as the packed
//! little-endian form. This type is the same message on the wire (prost-build maps
//! `.kvindexer.v1.TokenIds` here with `extern_path`); it writes the varints into a stack
//! buffer flushed with one copy per 2 KiB, and reads them from each contiguous chunk of the
//! input twelve bytes at a time: the bytes without a continuation bit pick a plan from a
//! table, which reads up to four varints of up to 3 bytes without a branch per id.
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
        // 0, 0x80 or 0x8080, shifted rather than looked up (a table here is rebuilt on the
        // stack and read back every id).
        let cont = 0x8080 >> (8 * (3 - len));
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

/// Bytes of input decoded per step into a stack buffer (one id per byte at most), then
/// appended to the list: the ids are written where they stay in cache, and the list's
/// memory is reserved but never written twice.
const BATCH: usize = 1024;

/// Reads a packed run (its length prefix, then varints) into `ids`.
fn merge_packed(ids: &mut Vec<u32>, buf: &mut impl Buf) -> Result<(), DecodeError> {
    let len = encoding::decode_varint(buf)?;
    let mut left = usize::try_from(len)
        .ok()
        .filter(|&l| l <= buf.remaining())
        .ok_or_else(|| error("TokenIds.ids: packed length past the input"))?;
    // At most one id per byte; never more than is there.
    ids.reserve(left);
    let mut batch = [0u32; BATCH];
    while left > 0 {
        let chunk = buf.chunk();
        let take = chunk.len().min(left).min(BATCH);
        let (used, n) = decode_complete(&chunk[..take], &mut batch)?;
        ids.extend_from_slice(&batch[..n]);
        buf.advance(used);
        left -= used;
        if left > 0 && used < take {
            // A varint split between two chunks of the input (or batches): read it the slow
            // way, and check that it ends inside the run.
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

/// Bytes a plan looks at: four varints of up to 3 bytes fit.
const PLAN_BYTES: usize = 12;

/// How to read the varints of up to 3 bytes that start a 12-byte window, for one pattern of
/// its bytes without a continuation bit (the varints' last bytes).
#[derive(Clone, Copy)]
struct Plan {
    /// Varints read (0-4; 0 when the first is longer than 3 bytes).
    count: u8,
    /// Bytes they take.
    consumed: u8,
    /// Each varint's first byte in the window (0 for unused slots).
    start: [u8; 4],
    /// Each varint's bytes, as a mask of the 4 bytes read from its start (0 for unused
    /// slots).
    mask: [u32; 4],
}

/// Plans for every terminator pattern of a window (bit k set: byte k ends a varint), 96 KiB
/// of which a stream touches the few patterns its widths make.
static PLANS: [Plan; 1 << PLAN_BYTES] = {
    let mut plans = [Plan {
        count: 0,
        consumed: 0,
        start: [0; 4],
        mask: [0; 4],
    }; 1 << PLAN_BYTES];
    let mut pattern = 0;
    while pattern < 1 << PLAN_BYTES {
        let plan = &mut plans[pattern];
        let mut start = 0;
        let mut slot = 0;
        while slot < 4 {
            let mut end = start;
            while end < PLAN_BYTES && pattern & (1 << end) == 0 {
                end += 1;
            }
            let len = end + 1 - start;
            if end == PLAN_BYTES || len > 3 {
                break;
            }
            plan.start[slot] = start as u8;
            plan.mask[slot] = u32::MAX >> (32 - 8 * len);
            start = end + 1;
            slot += 1;
        }
        plan.count = slot as u8;
        plan.consumed = start as u8;
        pattern += 1;
    }
    plans
};

/// One bit per byte of `word` without a continuation bit, byte k's in bit k (a movemask in
/// scalar code).
#[inline(always)]
fn ends(word: u64) -> usize {
    ((!word & 0x8080_8080_8080_8080).wrapping_mul(0x0002_0408_1020_4081) >> 56) as usize
}

/// Decodes every varint that ends inside `s` into `out` (room for one id per byte of `s`);
/// returns the bytes consumed (short of `s.len()` only when `s` ends inside a varint) and
/// the ids written.
#[inline]
fn decode_complete(s: &[u8], out: &mut [u32]) -> Result<(usize, usize), DecodeError> {
    let (mut i, mut n) = (0, 0);
    // While 20 bytes are left, the varints of up to 3 bytes (every vocabulary up to 2M
    // tokens) that start the next 12 are read by their plan: up to four ids a step, each from
    // 4 bytes at its start, with no branch per id. Four slots are always written and `n`
    // moves by the count; slots past it are overwritten next or cut off. In bounds: each id
    // took at least one byte, so `n + 4 <= i + 4 < s.len() <= out.len()`; a start (below 16)
    // plus 4 stays inside the 20 bytes.
    // Otherwise (a longer varint, or the last 20 bytes) one varint at a time.
    while i < s.len() {
        if let Some(w) = s.get(i..i + 20) {
            let lo = u64::from_le_bytes([w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]]);
            let hi = u64::from_le_bytes([w[8], w[9], w[10], w[11], w[12], w[13], w[14], w[15]]);
            let plan = &PLANS[(ends(lo) | ends(hi) << 8) & ((1 << PLAN_BYTES) - 1)];
            if plan.count > 0 {
                if let Some(dst) = out.get_mut(n..n + 4) {
                    for (slot, id) in dst.iter_mut().enumerate() {
                        let at = usize::from(plan.start[slot] & 15);
                        let x = u32::from_le_bytes([w[at], w[at + 1], w[at + 2], w[at + 3]])
                            & plan.mask[slot];
                        *id = (x & 0x7f) | (x >> 1) & 0x3f80 | (x >> 2) & 0x1f_c000;
                    }
                    n += usize::from(plan.count);
                    i += usize::from(plan.consumed);
                    continue;
                }
            }
        }
        match decode_one(&s[i..])? {
            Some((v, len)) => {
                out[n] = v;
                n += 1;
                i += len;
            }
            None => break,
        }
    }
    Ok((i, n))
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

/// A buffer cut into small chunks (test code, feature `testing`).
#[cfg(any(test, feature = "testing"))]
pub mod chunked;
#[cfg(test)]
mod tests;
