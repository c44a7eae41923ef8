//! A prepared [`IndexWorkload`] in a file, so a harness that measures each backend in a fresh
//! process builds the stream once (building a looped 16-pod stream takes ~15 s, mostly the
//! pods' LRU misses) and each process reads it back (well under a second from the page cache).
//!
//! Format (little-endian): the magic `KVIWL001`, then the counts (steps, queries, stored,
//! removed, final memberships) and the removal mode as u64s; the slabs (`queries`,
//! `query_content`, `stored`, `stored_content`, `removed`) as u64s; then per step its pod, query
//! range, removed range and store count, and per store a parent flag, the parent and its range.
//! Written and read by this module only; a file of another version is refused.

use std::io::{BufReader, BufWriter, Read, Write};
use std::path::Path;

use kv_core::BlockHash;

use super::{IndexWorkload, Removals, Step, StoreOp};

const MAGIC: &[u8; 8] = b"KVIWL001";

impl IndexWorkload {
    /// Writes the workload to `path` (see the module docs).
    pub fn save(&self, path: &Path) -> std::io::Result<()> {
        let mut out = Writer(BufWriter::with_capacity(
            1 << 20,
            std::fs::File::create(path)?,
        ));
        out.0.write_all(MAGIC)?;
        let mode = match self.removals {
            Removals::Batched => 0,
            Removals::OnePerEvent => 1,
            Removals::Shuffled => 2,
        };
        for n in [
            self.steps.len(),
            self.queries.len(),
            self.stored.len(),
            self.removed.len(),
            self.final_memberships,
            mode,
        ] {
            out.u64(n as u64)?;
        }
        out.hashes(&self.queries)?;
        out.words(&self.query_content)?;
        out.hashes(&self.stored)?;
        out.words(&self.stored_content)?;
        out.hashes(&self.removed)?;
        for step in &self.steps {
            out.u64(u64::from(step.pod))?;
            for r in [&step.query, &step.removed] {
                out.u64(r.start as u64)?;
                out.u64(r.end as u64)?;
            }
            out.u64(step.stores.len() as u64)?;
            for op in &step.stores {
                out.u64(u64::from(op.parent.is_some()))?;
                out.u64(op.parent.map_or(0, BlockHash::get))?;
                out.u64(op.blocks.start as u64)?;
                out.u64(op.blocks.end as u64)?;
            }
        }
        out.0.flush()
    }

    /// Reads a workload [`IndexWorkload::save`] wrote.
    pub fn load(path: &Path) -> std::io::Result<Self> {
        let mut input = Reader(BufReader::with_capacity(
            1 << 20,
            std::fs::File::open(path)?,
        ));
        let mut magic = [0; 8];
        input.0.read_exact(&mut magic)?;
        if &magic != MAGIC {
            return Err(invalid("not an index workload file of this version"));
        }
        let [steps, queries, stored, removed, memberships, mode] = [(); 6].map(|_| input.u64());
        let removals = match mode? {
            0 => Removals::Batched,
            1 => Removals::OnePerEvent,
            2 => Removals::Shuffled,
            _ => return Err(invalid("unknown removal mode")),
        };
        let (queries, stored, removed) = (queries? as usize, stored? as usize, removed? as usize);
        let mut w = IndexWorkload {
            queries: input.hashes(queries)?,
            query_content: input.words(queries)?,
            stored: input.hashes(stored)?,
            stored_content: input.words(stored)?,
            removed: input.hashes(removed)?,
            final_memberships: memberships? as usize,
            removals,
            steps: Vec::new(),
        };
        for _ in 0..steps? {
            let pod = input.u64()? as u32;
            let query = input.range(queries)?;
            let removed = input.range(removed)?;
            let stores = (0..input.u64()?)
                .map(|_| {
                    let has_parent = input.u64()? != 0;
                    let parent = BlockHash::new(input.u64()?);
                    Ok(StoreOp {
                        parent: has_parent.then_some(parent),
                        blocks: input.range(stored)?,
                    })
                })
                .collect::<std::io::Result<_>>()?;
            w.steps.push(Step {
                pod,
                query,
                removed,
                stores,
            });
        }
        Ok(w)
    }
}

fn invalid(what: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_owned())
}

struct Writer<W: Write>(W);

impl<W: Write> Writer<W> {
    fn u64(&mut self, v: u64) -> std::io::Result<()> {
        self.0.write_all(&v.to_le_bytes())
    }

    fn words(&mut self, v: &[u64]) -> std::io::Result<()> {
        v.iter().try_for_each(|&x| self.u64(x))
    }

    fn hashes(&mut self, v: &[BlockHash]) -> std::io::Result<()> {
        v.iter().try_for_each(|&x| self.u64(x.get()))
    }
}

struct Reader<R: Read>(R);

impl<R: Read> Reader<R> {
    fn u64(&mut self) -> std::io::Result<u64> {
        let mut b = [0; 8];
        self.0.read_exact(&mut b)?;
        Ok(u64::from_le_bytes(b))
    }

    /// `n` words, read in blocks (a slab is read into memory reserved once).
    fn words(&mut self, n: usize) -> std::io::Result<Vec<u64>> {
        let mut out = Vec::with_capacity(n);
        let mut buf = vec![0u8; 1 << 16];
        while out.len() < n {
            let take = (n - out.len()).min(buf.len() / 8);
            let bytes = &mut buf[..take * 8];
            self.0.read_exact(bytes)?;
            out.extend(
                bytes
                    .chunks_exact(8)
                    .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default())),
            );
        }
        Ok(out)
    }

    fn hashes(&mut self, n: usize) -> std::io::Result<Vec<BlockHash>> {
        Ok(self.words(n)?.into_iter().map(BlockHash::new).collect())
    }

    /// A range within a slab of `len`.
    fn range(&mut self, len: usize) -> std::io::Result<std::ops::Range<usize>> {
        let (start, end) = (self.u64()? as usize, self.u64()? as usize);
        if start > end || end > len {
            return Err(invalid("a range outside its slab"));
        }
        Ok(start..end)
    }
}
