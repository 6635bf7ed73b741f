//! Huge pages for the large buffers a step streams through whole: the repacked weights. (Not the
//! KV caches: a short context would commit 2 MiB per layer where it touches 4 KiB.)

/// Asks the kernel to back the whole 2 MiB pages inside `buf` with transparent huge pages (Linux
/// THP in its common `madvise` mode; elsewhere, or where THP is off, nothing happens). Call it
/// before the buffer is first written: pages already touched stay small until khugepaged
/// merges them.
///
/// A decode step streams ~100 MB of weights: in 4 KiB pages a TLB miss and page walk every
/// 4 KiB, ~6% of a SmolLM2 decode step on the 2-core CI VM (docs/perf.md, stop 30).
pub(crate) fn advise_huge_pages<T>(buf: &[T]) {
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let start = (buf.as_ptr() as usize).next_multiple_of(HUGE);
        let end = (buf.as_ptr() as usize + std::mem::size_of_val(buf)) / HUGE * HUGE;
        if end > start {
            // SAFETY: madvise only advises on pages of this live allocation; MADV_HUGEPAGE
            // changes neither their contents nor their mapping's validity.
            unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = buf;
}

