//! A minimal, zero-copy msgpack reader: exactly what the `KVEventBatch` decoder needs, with
//! every read bounds-checked so malformed input is an error, never a panic.
//!
//! Invariants: the cursor only moves forward; a failed read leaves the reader in an unspecified
//! position (callers abandon the payload); nesting deeper than [`MAX_DEPTH`] is refused so a
//! hostile payload cannot exhaust the stack while being skipped.

use super::DecodeError;

/// Deepest nesting `skip` follows; real payloads nest at most 5 levels.
pub const MAX_DEPTH: usize = 32;

/// Decoded bytes a payload may cost, per payload byte. Real vLLM batches decode to 1.5-5x their
/// size (the most for vLLM <= 0.23's array-form events of one block: ~107 bytes on the wire,
/// ~540 decoded, most of it the event structs); crafted payloads (nil extra keys at 32x,
/// one-byte hashes at 8x, empty events at 25x) are refused. With the payload itself a message
/// holds at most 7x its size.
pub const DECODE_BUDGET_PER_BYTE: usize = 6;
/// Decoded bytes every payload may cost on top (small batches).
pub const DECODE_BUDGET_BASE: usize = 4096;

/// A cursor over one msgpack payload, with the budget of decoded bytes it may still spend.
#[derive(Debug, Clone)]
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    budget: usize,
}

/// A scalar or container header, as seen by `peek_kind`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MsgpackKind {
    /// `nil`
    Nil,
    /// `true` / `false`
    Bool,
    /// Any integer encoding (positive or negative fixint, uint8-64, int8-64).
    Int,
    /// float32 / float64
    Float,
    /// Any string encoding.
    Str,
    /// Any bin encoding.
    Bin,
    /// Any array encoding.
    Array,
    /// Any map encoding.
    Map,
    /// ext types (never sent by vLLM).
    Ext,
    /// 0xc1, which msgpack never uses.
    Reserved,
}

/// An integer read from the wire, keeping its signedness.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Int {
    /// A value encoded as unsigned (or a non-negative fixint).
    Unsigned(u64),
    /// A value encoded as signed and negative.
    Negative(i64),
}

impl<'a> Reader<'a> {
    /// Starts reading `buf` from its first byte.
    pub fn new(buf: &'a [u8]) -> Self {
        Self {
            buf,
            pos: 0,
            budget: buf
                .len()
                .saturating_mul(DECODE_BUDGET_PER_BYTE)
                .saturating_add(DECODE_BUDGET_BASE),
        }
    }

    /// Spends `bytes` of the decode budget before the caller allocates them; a payload whose
    /// decoded form would be larger than its budget is refused (`DecodeError::TooLarge`).
    #[inline(always)]
    pub fn charge(&mut self, bytes: usize) -> Result<(), DecodeError> {
        match self.budget.checked_sub(bytes) {
            Some(left) => {
                self.budget = left;
                Ok(())
            }
            None => Err(DecodeError::TooLarge { at: self.pos }),
        }
    }

    /// Bytes consumed so far (for error messages).
    pub fn position(&self) -> usize {
        self.pos
    }

    /// True when every byte has been consumed.
    pub fn is_at_end(&self) -> bool {
        self.pos >= self.buf.len()
    }

    #[inline(always)]
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len());
        match end {
            Some(end) => {
                let slice = &self.buf[self.pos..end];
                self.pos = end;
                Ok(slice)
            }
            None => Err(DecodeError::Truncated { at: self.pos }),
        }
    }

    #[inline(always)]
    fn byte(&mut self) -> Result<u8, DecodeError> {
        let b = *self
            .buf
            .get(self.pos)
            .ok_or(DecodeError::Truncated { at: self.pos })?;
        self.pos += 1;
        Ok(b)
    }

    #[inline(always)]
    fn be<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    /// The kind of the next value, without consuming it.
    pub fn peek_kind(&self) -> Result<MsgpackKind, DecodeError> {
        let b = *self
            .buf
            .get(self.pos)
            .ok_or(DecodeError::Truncated { at: self.pos })?;
        Ok(match b {
            0x00..=0x7f | 0xe0..=0xff | 0xcc..=0xd3 => MsgpackKind::Int,
            0x80..=0x8f | 0xde | 0xdf => MsgpackKind::Map,
            0x90..=0x9f | 0xdc | 0xdd => MsgpackKind::Array,
            0xa0..=0xbf | 0xd9..=0xdb => MsgpackKind::Str,
            0xc0 => MsgpackKind::Nil,
            0xc2 | 0xc3 => MsgpackKind::Bool,
            0xc4..=0xc6 => MsgpackKind::Bin,
            0xca | 0xcb => MsgpackKind::Float,
            0xc7..=0xc9 | 0xd4..=0xd8 => MsgpackKind::Ext,
            0xc1 => MsgpackKind::Reserved,
        })
    }

    fn unexpected(&self, expected: &'static str) -> DecodeError {
        if self.pos >= self.buf.len() {
            return DecodeError::Truncated { at: self.pos };
        }
        DecodeError::UnexpectedType {
            expected,
            found: self.peek_kind().ok(),
            at: self.pos,
        }
    }

    /// Consumes a `nil` if one is next; reports whether it did.
    #[inline(always)]
    pub fn try_nil(&mut self) -> bool {
        if self.buf.get(self.pos) == Some(&0xc0) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    /// Reads an array header, returning its element count.
    #[inline(always)]
    pub fn array_len(&mut self) -> Result<usize, DecodeError> {
        let at = self.pos;
        match self.byte()? {
            b @ 0x90..=0x9f => Ok((b & 0x0f) as usize),
            0xdc => Ok(u16::from_be_bytes(self.be()?) as usize),
            0xdd => Ok(u32::from_be_bytes(self.be()?) as usize),
            _ => {
                self.pos = at;
                Err(self.unexpected("array"))
            }
        }
    }

    /// Reads a map header, returning its entry count.
    pub fn map_len(&mut self) -> Result<usize, DecodeError> {
        let at = self.pos;
        match self.byte()? {
            b @ 0x80..=0x8f => Ok((b & 0x0f) as usize),
            0xde => Ok(u16::from_be_bytes(self.be()?) as usize),
            0xdf => Ok(u32::from_be_bytes(self.be()?) as usize),
            _ => {
                self.pos = at;
                Err(self.unexpected("map"))
            }
        }
    }

    /// Reads a string, borrowing it from the payload.
    pub fn str(&mut self) -> Result<&'a str, DecodeError> {
        let at = self.pos;
        let len = match self.byte()? {
            b @ 0xa0..=0xbf => (b & 0x1f) as usize,
            0xd9 => self.byte()? as usize,
            0xda => u16::from_be_bytes(self.be()?) as usize,
            0xdb => u32::from_be_bytes(self.be()?) as usize,
            _ => {
                self.pos = at;
                return Err(self.unexpected("string"));
            }
        };
        let bytes = self.take(len)?;
        std::str::from_utf8(bytes).map_err(|_| DecodeError::InvalidUtf8 { at })
    }

    /// Reads a bin value, borrowing it from the payload.
    pub fn bin(&mut self) -> Result<&'a [u8], DecodeError> {
        let at = self.pos;
        let len = match self.byte()? {
            0xc4 => self.byte()? as usize,
            0xc5 => u16::from_be_bytes(self.be()?) as usize,
            0xc6 => u32::from_be_bytes(self.be()?) as usize,
            _ => {
                self.pos = at;
                return Err(self.unexpected("bin"));
            }
        };
        self.take(len)
    }

    /// Reads any integer encoding.
    #[inline(always)]
    pub fn int(&mut self) -> Result<Int, DecodeError> {
        let at = self.pos;
        let b = self.byte()?;
        Ok(match b {
            0x00..=0x7f => Int::Unsigned(b as u64),
            0xe0..=0xff => Int::Negative(b as i8 as i64),
            0xcc => Int::Unsigned(self.byte()? as u64),
            0xcd => Int::Unsigned(u16::from_be_bytes(self.be()?) as u64),
            0xce => Int::Unsigned(u32::from_be_bytes(self.be()?) as u64),
            0xcf => Int::Unsigned(u64::from_be_bytes(self.be()?)),
            0xd0 => signed(self.byte()? as i8 as i64),
            0xd1 => signed(i16::from_be_bytes(self.be()?) as i64),
            0xd2 => signed(i32::from_be_bytes(self.be()?) as i64),
            0xd3 => signed(i64::from_be_bytes(self.be()?)),
            _ => {
                self.pos = at;
                return Err(self.unexpected("integer"));
            }
        })
    }

    /// Reads an integer that must fit a `u32` (token ids, block sizes).
    #[inline(always)]
    pub fn u32(&mut self) -> Result<u32, DecodeError> {
        let at = self.pos;
        match self.int()? {
            Int::Unsigned(v) if v <= u32::MAX as u64 => Ok(v as u32),
            _ => Err(DecodeError::OutOfRange { at }),
        }
    }

    /// Reads an integer as `i64` (ranks, ids).
    pub fn i64(&mut self) -> Result<i64, DecodeError> {
        let at = self.pos;
        match self.int()? {
            Int::Unsigned(v) => i64::try_from(v).map_err(|_| DecodeError::OutOfRange { at }),
            Int::Negative(v) => Ok(v),
        }
    }

    /// Reads a float, accepting float32/64 and (leniently) integers.
    pub fn f64(&mut self) -> Result<f64, DecodeError> {
        let at = self.pos;
        match self.buf.get(self.pos) {
            Some(0xcb) => {
                self.pos += 1;
                Ok(f64::from_be_bytes(self.be()?))
            }
            Some(0xca) => {
                self.pos += 1;
                Ok(f32::from_be_bytes(self.be()?) as f64)
            }
            _ => match self.int() {
                Ok(Int::Unsigned(v)) => Ok(v as f64),
                Ok(Int::Negative(v)) => Ok(v as f64),
                Err(_) => {
                    self.pos = at;
                    Err(self.unexpected("float"))
                }
            },
        }
    }

    /// Reads a boolean.
    pub fn bool(&mut self) -> Result<bool, DecodeError> {
        match self.buf.get(self.pos) {
            Some(0xc2) => {
                self.pos += 1;
                Ok(false)
            }
            Some(0xc3) => {
                self.pos += 1;
                Ok(true)
            }
            _ => Err(self.unexpected("bool")),
        }
    }

    /// Skips one complete value of any type.
    pub fn skip(&mut self) -> Result<(), DecodeError> {
        self.skip_at_depth(0)
    }

    fn skip_at_depth(&mut self, depth: usize) -> Result<(), DecodeError> {
        if depth > MAX_DEPTH {
            return Err(DecodeError::TooDeep { at: self.pos });
        }
        match self.peek_kind()? {
            MsgpackKind::Nil | MsgpackKind::Bool => {
                self.pos += 1;
            }
            MsgpackKind::Int => {
                self.int()?;
            }
            MsgpackKind::Float => {
                self.f64()?;
            }
            MsgpackKind::Str => {
                self.str()?;
            }
            MsgpackKind::Bin => {
                self.bin()?;
            }
            MsgpackKind::Array => {
                let n = self.array_len()?;
                for _ in 0..n {
                    self.skip_at_depth(depth + 1)?;
                }
            }
            MsgpackKind::Map => {
                let n = self.map_len()?;
                for _ in 0..n {
                    self.skip_at_depth(depth + 1)?;
                    self.skip_at_depth(depth + 1)?;
                }
            }
            MsgpackKind::Ext => {
                let len = match self.byte()? {
                    0xd4 => 1,
                    0xd5 => 2,
                    0xd6 => 4,
                    0xd7 => 8,
                    0xd8 => 16,
                    0xc7 => self.byte()? as usize,
                    0xc8 => u16::from_be_bytes(self.be()?) as usize,
                    _ => u32::from_be_bytes(self.be()?) as usize,
                };
                self.take(len + 1)?;
            }
            MsgpackKind::Reserved => return Err(self.unexpected("any value")),
        }
        Ok(())
    }
}

#[inline(always)]
fn signed(v: i64) -> Int {
    if v >= 0 {
        Int::Unsigned(v as u64)
    } else {
        Int::Negative(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_every_integer_width() {
        let cases: &[(&[u8], Int)] = &[
            (&[0x05], Int::Unsigned(5)),
            (&[0xff], Int::Negative(-1)),
            (&[0xcc, 0xff], Int::Unsigned(255)),
            (&[0xcd, 0x01, 0x00], Int::Unsigned(256)),
            (&[0xce, 0, 1, 0, 0], Int::Unsigned(65_536)),
            (
                &[0xcf, 0xff, 0, 0, 0, 0, 0, 0, 1],
                Int::Unsigned(0xff00_0000_0000_0001),
            ),
            (&[0xd0, 0x80], Int::Negative(-128)),
            (
                &[0xd3, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xfe],
                Int::Negative(-2),
            ),
        ];
        for (bytes, want) in cases {
            assert_eq!(
                Reader::new(bytes).int().expect("valid"),
                *want,
                "{bytes:x?}"
            );
        }
    }

    #[test]
    fn truncation_and_bad_utf8_are_errors() {
        assert!(matches!(
            Reader::new(&[0xcf, 1, 2]).int(),
            Err(DecodeError::Truncated { .. })
        ));
        assert!(matches!(
            Reader::new(&[0xa2, 0xff, 0xfe]).str(),
            Err(DecodeError::InvalidUtf8 { .. })
        ));
        assert!(matches!(
            Reader::new(&[0xdd, 0xff, 0xff, 0xff, 0xff]).skip(),
            Err(DecodeError::Truncated { .. })
        ));
    }

    #[test]
    fn deep_nesting_is_refused() {
        let deep = vec![0x91u8; 10_000];
        assert!(matches!(
            Reader::new(&deep).skip(),
            Err(DecodeError::TooDeep { .. })
        ));
    }
}
