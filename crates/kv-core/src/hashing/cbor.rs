//! The subset of canonical CBOR (RFC 8949 §4.2.1, as `cbor2.dumps(x, canonical=True)` writes it)
//! that vLLM's `sha256_cbor` block inputs use: unsigned and negative integers, byte and text
//! strings, arrays and `null`.
//!
//! Invariant: every head is written in its shortest form, which is what "canonical" means for
//! these types; the block-hash vectors pin the bytes (`cbor_input_hex`).

/// CBOR major types, already shifted into the high three bits of the initial byte.
const MAJOR_UNSIGNED: u8 = 0x00;
const MAJOR_NEGATIVE: u8 = 0x20;
#[cfg(test)]
const MAJOR_BYTES: u8 = 0x40;
const MAJOR_TEXT: u8 = 0x60;
const MAJOR_ARRAY: u8 = 0x80;
/// The simple value `null` (Python `None`).
pub const NULL: u8 = 0xf6;

/// Writes a head (major type + argument) in its shortest form.
#[inline(always)]
pub fn write_head(out: &mut Vec<u8>, major: u8, value: u64) {
    if value < 24 {
        out.push(major | value as u8);
    } else if value <= u8::MAX as u64 {
        out.extend_from_slice(&[major | 24, value as u8]);
    } else if value <= u16::MAX as u64 {
        out.push(major | 25);
        out.extend_from_slice(&(value as u16).to_be_bytes());
    } else if value <= u32::MAX as u64 {
        out.push(major | 26);
        out.extend_from_slice(&(value as u32).to_be_bytes());
    } else {
        out.push(major | 27);
        out.extend_from_slice(&value.to_be_bytes());
    }
}

/// Writes one unsigned integer: the reference [`write_u32s`] is tested against.
#[cfg(test)]
pub fn write_uint(out: &mut Vec<u8>, value: u64) {
    write_head(out, MAJOR_UNSIGNED, value);
}

/// Writes unsigned integers (a block's token ids) in one pass: the buffer grows once to the
/// worst case (5 bytes each) and is truncated after, so there is no per-byte capacity check.
#[inline]
pub fn write_u32s(out: &mut Vec<u8>, values: &[u32]) {
    let start = out.len();
    out.resize(start + values.len() * 5, 0);
    let buf = &mut out[start..];
    let mut n = 0;
    for &v in values {
        n += match v {
            0..=23 => {
                buf[n] = v as u8;
                1
            }
            24..=0xff => {
                buf[n] = 24;
                buf[n + 1] = v as u8;
                2
            }
            0x100..=0xffff => {
                buf[n] = 25;
                buf[n + 1..n + 3].copy_from_slice(&(v as u16).to_be_bytes());
                3
            }
            _ => {
                buf[n] = 26;
                buf[n + 1..n + 5].copy_from_slice(&v.to_be_bytes());
                5
            }
        };
    }
    out.truncate(start + n);
}

/// Writes a signed integer: major 0 for `v >= 0`, major 1 (`-1 - n`) otherwise.
pub fn write_int(out: &mut Vec<u8>, value: i64) {
    if value >= 0 {
        write_head(out, MAJOR_UNSIGNED, value as u64);
    } else {
        write_head(out, MAJOR_NEGATIVE, (-1 - value) as u64);
    }
}

/// Writes a byte string (Python `bytes`). The hot path writes the 32-byte parent digest's head
/// (`58 20`) inline; this general form pins it in the tests.
#[cfg(test)]
pub fn write_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    write_head(out, MAJOR_BYTES, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// Writes a UTF-8 text string (Python `str`).
pub fn write_text(out: &mut Vec<u8>, text: &str) {
    write_head(out, MAJOR_TEXT, text.len() as u64);
    out.extend_from_slice(text.as_bytes());
}

/// Writes an array head; the caller writes `len` items after it.
#[inline(always)]
pub fn write_array_head(out: &mut Vec<u8>, len: usize) {
    write_head(out, MAJOR_ARRAY, len as u64);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn uint(v: u64) -> Vec<u8> {
        let mut out = Vec::new();
        write_uint(&mut out, v);
        out
    }

    #[test]
    fn integers_use_the_shortest_head() {
        assert_eq!(uint(0), [0x00]);
        assert_eq!(uint(23), [0x17]);
        assert_eq!(uint(24), [0x18, 24]);
        assert_eq!(uint(255), [0x18, 0xff]);
        assert_eq!(uint(256), [0x19, 0x01, 0x00]);
        assert_eq!(uint(65_535), [0x19, 0xff, 0xff]);
        assert_eq!(uint(65_536), [0x1a, 0, 1, 0, 0]);
        assert_eq!(uint(u32::MAX as u64 + 1), [0x1b, 0, 0, 0, 1, 0, 0, 0, 0]);
        let mut neg = Vec::new();
        write_int(&mut neg, -11);
        assert_eq!(neg, [0x2a], "vLLM's multimodal offset -11 is 2a");
    }

    #[test]
    fn the_batch_writer_equals_the_one_at_a_time_writer() {
        let values = [0, 23, 24, 255, 256, 65_535, 65_536, u32::MAX, 7];
        let mut one = vec![0xaa];
        for &v in &values {
            write_uint(&mut one, v as u64);
        }
        let mut batch = vec![0xaa];
        write_u32s(&mut batch, &values);
        assert_eq!(batch, one);
    }

    #[test]
    fn matches_ciborium_for_text_bytes_and_arrays() {
        let mut ours = Vec::new();
        write_array_head(&mut ours, 3);
        write_text(&mut ours, "cache_salt");
        write_bytes(&mut ours, &[1, 2, 3]);
        write_int(&mut ours, -300);
        let value = ciborium::Value::Array(vec![
            ciborium::Value::Text("cache_salt".into()),
            ciborium::Value::Bytes(vec![1, 2, 3]),
            ciborium::Value::Integer((-300).into()),
        ]);
        let mut theirs = Vec::new();
        ciborium::into_writer(&value, &mut theirs).expect("in-memory write");
        assert_eq!(ours, theirs);
    }
}
