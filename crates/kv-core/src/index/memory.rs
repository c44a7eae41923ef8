//! Large zeroed allocations for the index, with a transparent-huge-page hint.
//!
//! The index's table and node chunks are probed at random; on 4 KiB pages nearly every probe
//! also misses the TLB. On Linux, `madvise(MADV_HUGEPAGE)` lets the kernel back them with 2 MiB
//! pages where THP is enabled (`always` or `madvise`). Zeroed allocation also means no
//! initialisation pass: untouched memory stays untouched.

/// Types whose all-zero bit pattern is a valid, default value.
///
/// # Safety
/// Implementors must be valid when every byte is zero.
pub unsafe trait Zeroable: Sized {}

// SAFETY: atomics of integers are plain integers; zero is a valid value.
unsafe impl Zeroable for std::sync::atomic::AtomicU64 {}

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
    advise_huge(ptr as *mut u8, layout.size());
    // SAFETY: `ptr` is a fresh allocation of `len` Ts with `T`'s layout, all zero, which is a
    // valid `T` (Zeroable); the Box takes ownership and frees it with the same layout.
    unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(ptr, len)) }
}

#[cfg(target_os = "linux")]
fn advise_huge(ptr: *mut u8, len: usize) {
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
fn advise_huge(_ptr: *mut u8, _len: usize) {}

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
}
