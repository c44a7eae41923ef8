//! The run index's free block ids, kept as ranges so that a stretch of new blocks gets
//! consecutive ids: a query walks consecutive ids without probing, and each place where a
//! chain leaves them costs a dependent miss (a hop).
//!
//! Ranges come from blocks leaving the index (frees in ascending or descending order extend
//! one range). A new stretch takes its first id, in order of preference:
//! 1. from the smallest size class (powers of two) whose every range fits the blocks still
//!    to store, its newest range (the longer ranges stay whole for longer stretches);
//! 2. from the longest range of at least [`MIN_STRETCH`] ids;
//! 3. from fresh ids, while free ids are under a [`SLACK`]th of the live ones (the caller
//!    decides: it knows both counts);
//! 4. from the longest range there is; else fresh ids up to the capacity.
//!
//! The stretch then goes on at `prev + 1` while that id is free, so it consumes the range it
//! took from in order ([`FreeIds::taken`] keeps that range's start in step).
//!
//! Measured (docs/benchmarks-history.md, "Free ids by size"): in the 16-pod replay, taking the newest
//! range whatever its length gave ranges of 55 ids on average, nine hops per request.
//!
//! Invariants: every free id is in a range, the range being filled or the one being taken
//! from. A range may also name ids taken since (a store that went on at `prev + 1` into a
//! range other than the one being taken from), so a taker checks every id it takes and skips
//! taken ones; lengths are upper bounds. `occupied` has bit `c` set iff size class `c` has a
//! range.

/// Ids a new stretch should get without a hop when no range fits it whole: ranges shorter
/// than this are taken only when fresh ids are not allowed.
pub(super) const MIN_STRETCH: u32 = 64;

/// Fresh ids are taken for a new stretch (rather than a range shorter than [`MIN_STRETCH`])
/// only while free ids are under live ids divided by this. A rule at the moment of choosing,
/// not a bound: a stretch begun on fresh ids goes on on them, and ids freed later add to the
/// free ones, so the id space settles above it. Measured: 1.14 ids per live block in the
/// 16-pod replay, 1.18 with shuffled evictions (16 bytes per id).
pub(super) const SLACK: u64 = 8;

/// Size classes: class `c` holds ranges of `2^c .. 2^(c + 1)` ids.
const CLASSES: usize = 32;

/// Free ids as ranges `start .. end` (see the module docs).
#[derive(Default)]
pub(super) struct FreeIds {
    /// The range frees are extending.
    filling: (u32, u32),
    /// The range a stretch is taking from (its next id first).
    taking: (u32, u32),
    /// Other ranges by size class, newest last.
    classes: [Vec<(u32, u32)>; CLASSES],
    /// Bit `c` set iff `classes[c]` is not empty (a pick is a bit scan).
    occupied: u32,
}

/// The size class of a range of `len` ids (at least 1).
fn class(len: u32) -> u32 {
    31 - len.max(1).leading_zeros()
}

/// The classes whose every range has at least `len` ids, as a mask.
fn classes_from(len: u32) -> u32 {
    let least = len.max(1).next_power_of_two().trailing_zeros();
    u32::MAX.checked_shl(least).unwrap_or(0)
}

impl FreeIds {
    /// Records `id` as free: it extends the range being filled when adjacent to it (either
    /// end), else that range is filed and a new one begins.
    pub(super) fn free(&mut self, id: u32) {
        let (a, b) = self.filling;
        if a == b {
            self.filling = (id, id + 1);
        } else if b == id {
            self.filling.1 += 1;
        } else if a == id + 1 {
            self.filling.0 = id;
        } else {
            self.file(self.filling);
            self.filling = (id, id + 1);
        }
    }

    /// A stretch took `id` at its previous block's next id: the range being taken from
    /// moves past it when it starts there.
    pub(super) fn taken(&mut self, id: u32) {
        if self.taking.0 == id && id < self.taking.1 {
            self.taking.0 += 1;
        }
    }

    /// The first id of a new stretch of up to `want` blocks, from a range as the module docs
    /// say; `None` when the caller should take a fresh id (`fresh_ok`: fresh ids are within
    /// [`SLACK`]; or no range is left). `is_free` tells whether an id is still free.
    pub(super) fn take(
        &mut self,
        want: u32,
        fresh_ok: bool,
        is_free: impl Fn(u32) -> bool,
    ) -> Option<u32> {
        // Both open ranges compete with the filed ones.
        let open = [
            std::mem::take(&mut self.filling),
            std::mem::take(&mut self.taking),
        ];
        open.into_iter().for_each(|range| self.file(range));
        loop {
            let fits = self.occupied & classes_from(want);
            let long = self.occupied & classes_from(MIN_STRETCH);
            let c = if fits != 0 {
                fits.trailing_zeros()
            } else if long != 0 {
                31 - long.leading_zeros()
            } else if fresh_ok || self.occupied == 0 {
                return None;
            } else {
                31 - self.occupied.leading_zeros()
            };
            let (a, b) = self.pop(c);
            if let Some(id) = (a..b).find(|&id| is_free(id)) {
                self.taking = (id + 1, b);
                return Some(id);
            }
        }
    }

    /// Bytes held by the filed ranges.
    pub(super) fn allocated_bytes(&self) -> usize {
        self.classes.iter().map(|c| c.capacity() * 8).sum()
    }

    /// Files a range (nothing when empty) in its size class.
    fn file(&mut self, (a, b): (u32, u32)) {
        if a < b {
            let c = class(b - a);
            self.classes[c as usize].push((a, b));
            self.occupied |= 1 << c;
        }
    }

    /// The newest range of class `c` (which `occupied` says is not empty).
    fn pop(&mut self, c: u32) -> (u32, u32) {
        let list = &mut self.classes[c as usize];
        let range = list.pop().unwrap_or_default();
        if list.is_empty() {
            self.occupied &= !(1 << c);
        }
        range
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Frees `a .. b` in ascending order.
    fn free_all(free: &mut FreeIds, a: u32, b: u32) {
        (a..b).for_each(|id| free.free(id));
    }

    #[test]
    fn a_stretch_takes_a_range_of_the_smallest_class_that_fits_it() {
        let mut free = FreeIds::default();
        free_all(&mut free, 0, 10); // 10 ids
        free.free(100); // files 0..10
        free_all(&mut free, 101, 300); // 100..300: 200 ids
        free.free(1000); // files 100..300
        free_all(&mut free, 1001, 1040); // 1000..1040: 40 ids
        assert_eq!(free.take(30, true, |_| true), Some(1000));
        // 100 blocks: class 7 (128 ids and up) fits whole, the 200-id range.
        assert_eq!(free.take(100, true, |_| true), Some(100));
        assert_eq!(free.take(5, true, |_| true), Some(0));
    }

    #[test]
    fn without_a_fit_the_longest_long_range_then_fresh_ids_then_any() {
        let mut free = FreeIds::default();
        free_all(&mut free, 0, 70);
        free.free(200);
        free_all(&mut free, 201, 300); // 200..300: 100 ids
        free.free(500);
        free_all(&mut free, 501, 510); // 500..510: 10 ids
                                       // 100 is the longest of at least MIN_STRETCH: taken before fresh ids.
        assert_eq!(free.take(1000, true, |_| true), Some(200));
        // That stretch took its whole range; the next takes the other long one.
        let gone = |id: u32| (200..300).contains(&id);
        assert_eq!(free.take(1000, true, |id| !gone(id)), Some(0));
        // Only a short range is left: fresh ids while they are allowed, then the range.
        let gone = |id: u32| id < 300;
        assert_eq!(free.take(1000, true, |id| !gone(id)), None);
        assert_eq!(free.take(1000, false, |id| !gone(id)), Some(500));
        assert_eq!(free.take(1000, false, |id| !gone(id)), Some(501));
    }

    #[test]
    fn a_stretch_goes_on_in_its_range_and_taken_ids_are_skipped() {
        let mut free = FreeIds::default();
        free_all(&mut free, 0, 100);
        assert_eq!(free.take(3, true, |_| true), Some(0));
        // The stretch went on at 1 and 2 (its next ids): the range's start follows.
        free.taken(1);
        free.taken(2);
        // Ids 3..50 were taken another way (a stretch of another range ran into them).
        assert_eq!(free.take(3, true, |id| id >= 50), Some(50));
        assert_eq!(free.take(3, true, |id| id >= 50), Some(51));
        // Every id taken: nothing to give.
        assert_eq!(free.take(3, false, |_| false), None);
    }

    #[test]
    fn frees_in_either_order_make_one_range() {
        let mut free = FreeIds::default();
        (0..64).rev().for_each(|id| free.free(id));
        free_all(&mut free, 64, 128);
        assert_eq!(free.take(128, true, |_| true), Some(0));
        assert_eq!(free.occupied, 0, "one range, now being taken");
    }
}
