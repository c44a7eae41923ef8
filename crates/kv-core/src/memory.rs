//! Memory for structures probed at random (the index's table and id chunks, the digest
//! memo): large zeroed allocations, prefaulting, a transparent-huge-page hint, and the one
//! software-prefetch hint.
//!
//! Zeroed allocation means no initialisation pass: untouched memory stays untouched. The
//! huge-page hint (`madvise(MADV_HUGEPAGE)`, 2 MiB pages where THP is `always` or `madvise`)
//! is opt-in ([`advise_huge`]): the digest memo takes it; the index's table does not. Measured
//! for the table (benches/peers, 1,024 pods, glibc, builds alternated): with the hint the
//! kernel spent 0.72-1.07 s of CPU on the index's pages, without it 0.24-0.32 s; user time
//! was the same at load 6 (1.00-1.20 s with, 1.02-1.08 s without) and up to 30% higher
//! without at load 8 (1.02-1.11 s, 1.18-1.43 s: the TLB misses the hint saves); CPU time in
//! all 20-30% lower without. At 16 pods, a table churning at a steady size, no difference
//! beyond the noise. A huge page is an order-9 block of the page allocator; in a virtual
//! machine whose balloon reports free blocks of that order to the host (free page
//! reporting), those are likely the blocks the host took back, and zeroing one costs the
//! host's faults again.

/// Types whose all-zero bit pattern is a valid, default value.
///
/// # Safety
/// Implementors must be valid when every byte is zero.
pub unsafe trait Zeroable: Sized {}

// SAFETY: atomics of integers are plain integers; zero is a valid value.
unsafe impl Zeroable for std::sync::atomic::AtomicU64 {}

/// One cache line of 32-bit atomics, aligned to the line: a unit of memory a probe reads at
/// once (the digest memo's entries are whole lines).
#[repr(C, align(64))]
pub struct CacheLine(pub [std::sync::atomic::AtomicU32; 16]);

// SAFETY: an array of integer atomics; zero is a valid value of each.
unsafe impl Zeroable for CacheLine {}

/// Allocations at least this large get the huge-page hint.
const HUGE_HINT_MIN: usize = 2 << 20;

/// A boxed slice of `len` zeroed `T`s.
pub fn zeroed_slice<T: Zeroable>(len: usize) -> Box<[T]> {
    let len = len.max(1);
    let layout = match std::alloc::Layout::array::<T>(len) {
        Ok(l) => l,
        Err(_) => std::alloc::handle_alloc_error(std::alloc::Layout::new::<T>()),
    };
    // A zero-sized layout would make `alloc_zeroed` undefined behaviour.
    assert!(layout.size() > 0, "zero-sized element type");
    // SAFETY: the layout has non-zero size (len >= 1, and T is not zero-sized: checked above).
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) } as *mut T;
    if ptr.is_null() {
        std::alloc::handle_alloc_error(layout);
    }
    // SAFETY: `ptr` is a fresh allocation of `len` Ts with `T`'s layout, all zero, which is a
    // valid `T` (Zeroable); the Box takes ownership and frees it with the same layout.
    unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(ptr, len)) }
}

/// `N` zeroed `T`s behind an `Arc`, zeroed in place: one allocation and one pass (an `Arc`
/// built from a zeroed boxed slice allocated twice and copied, faulting in every page of every
/// id chunk twice). (`Arc::new_zeroed` would skip the pass on fresh memory; it is newer than
/// the crate's minimum Rust.)
pub fn zeroed_arc_array<T: Zeroable, const N: usize>() -> std::sync::Arc<[T; N]> {
    let mut chunk = std::sync::Arc::<[T; N]>::new_uninit();
    let Some(slot) = std::sync::Arc::get_mut(&mut chunk) else {
        unreachable!("a new Arc has one owner")
    };
    // SAFETY: the pointer is to the Arc's own uninitialised `[T; N]`, which we own alone; every
    // byte is written with zero, and all-zero is a valid `T` (Zeroable), so after it the value
    // is a valid `[T; N]` and `assume_init` is sound.
    unsafe {
        std::ptr::write_bytes(slot.as_mut_ptr(), 0, 1);
        chunk.assume_init()
    }
}

/// Faults in every page of `slice` now, in one system call, instead of one page fault per page
/// as the first writes reach them. For memory that is written at random soon after it is
/// allocated (a hash table: every page holds entries once it is a few percent full), where a
/// trap per page cost more than the zeroing itself (a `perf` profile of a growing run index).
/// Advice only: on kernels before 5.14 (no `MADV_POPULATE_WRITE`) the pages fault as before.
pub fn prefault<T>(slice: &[T]) {
    let len = std::mem::size_of_val(slice);
    if len < HUGE_HINT_MIN {
        return;
    }
    populate(slice.as_ptr() as *mut u8, len);
}

#[cfg(target_os = "linux")]
fn populate(ptr: *mut u8, len: usize) {
    let page = 4096usize;
    let start = (ptr as usize).div_ceil(page) * page;
    let end = (ptr as usize + len) / page * page;
    if end > start {
        // SAFETY: the range lies inside an allocation the caller owns; MADV_POPULATE_WRITE
        // only makes its pages resident (zero pages stay zero), never changes contents.
        // Failure (an older kernel) is harmless: the pages fault in on first use.
        unsafe {
            libc::madvise(
                start as *mut libc::c_void,
                end - start,
                libc::MADV_POPULATE_WRITE,
            );
        }
    }
}

#[cfg(not(target_os = "linux"))]
fn populate(_ptr: *mut u8, _len: usize) {}

/// Asks the kernel to back `slice` with transparent huge pages (if at least 2 MiB): fewer TLB
/// misses for memory probed at random, at the cost of zeroing 2 MiB at each first touch.
pub fn advise_huge<T>(slice: &[T]) {
    advise_huge_range(slice.as_ptr() as *mut u8, std::mem::size_of_val(slice));
}

#[cfg(target_os = "linux")]
fn advise_huge_range(ptr: *mut u8, len: usize) {
    if len < HUGE_HINT_MIN {
        return;
    }
    // madvise needs a page-aligned start: advise the page-aligned interior.
    let page = 4096usize;
    let start = (ptr as usize).div_ceil(page) * page;
    let end = (ptr as usize + len) / page * page;
    if end > start {
        // SAFETY: the range lies inside an allocation we own; MADV_HUGEPAGE only changes how
        // the kernel backs it and never its contents. Failure (THP off) is harmless.
        unsafe {
            libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
        }
    }
}

#[cfg(not(target_os = "linux"))]
fn advise_huge_range(_ptr: *mut u8, _len: usize) {}

/// Asks the CPU to bring the cache line at `ptr` in; a pure hint (never faults, no effect on
/// results), used to overlap the misses of a batch.
#[inline(always)]
pub fn prefetch_read(ptr: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: prefetch is a hint; it never faults or reads memory architecturally, whatever the
    // address.
    unsafe {
        std::arch::x86_64::_mm_prefetch(ptr as *const i8, std::arch::x86_64::_MM_HINT_T0);
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = ptr;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    #[test]
    fn zeroed_slices_read_zero() {
        let s: Box<[AtomicU64]> = zeroed_slice(1 << 20);
        assert_eq!(s.len(), 1 << 20);
        assert!(s
            .iter()
            .step_by(4099)
            .all(|x| x.load(Ordering::Relaxed) == 0));
    }

    /// Resident KiB of the whole pages inside `slice` (`mincore`; adjacent allocations may
    /// share one mapping, so a mapping's Rss would not tell them apart).
    #[cfg(target_os = "linux")]
    fn resident_kib<T>(slice: &[T]) -> Option<u64> {
        let page = 4096usize;
        let start = (slice.as_ptr() as usize).div_ceil(page) * page;
        let end = (slice.as_ptr() as usize + std::mem::size_of_val(slice)) / page * page;
        let mut pages = vec![0u8; (end - start) / page];
        // SAFETY: the range is page-aligned and inside `slice`'s allocation, which is mapped;
        // `pages` has one byte per page of it. mincore only reports residency.
        let rc =
            unsafe { libc::mincore(start as *mut libc::c_void, end - start, pages.as_mut_ptr()) };
        (rc == 0).then(|| pages.iter().filter(|p| *p & 1 == 1).count() as u64 * 4)
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn prefault_makes_every_page_resident_and_a_plain_slice_stays_lazy() {
        // 64 MiB each: above glibc's largest mmap threshold (32 MiB), so neither reuses
        // memory already touched.
        let lazy: Box<[AtomicU64]> = zeroed_slice(8 << 20);
        let faulted: Box<[AtomicU64]> = zeroed_slice(8 << 20);
        prefault(&faulted);
        let (lazy_kib, faulted_kib) = (
            resident_kib(&lazy).expect("mincore works"),
            resident_kib(&faulted).expect("mincore works"),
        );
        // The negative control: nothing touched the lazy slice, so (almost) none of it is in
        // memory; the prefaulted one is whole (MADV_POPULATE_WRITE needs Linux 5.14).
        assert!(lazy_kib < 4 << 10, "lazy slice resident: {lazy_kib} KiB");
        assert!(
            faulted_kib >= 63 << 10,
            "prefaulted slice resident: {faulted_kib} KiB"
        );
        assert!(faulted
            .iter()
            .step_by(4099)
            .all(|x| x.load(Ordering::Relaxed) == 0));
    }
}
