//! The host's side of a step's small transfers, without pageable copies and without waiting for
//! the stream:
//! - [`StagingRing`]: host-to-device copies (token ids, positions, block tables) through a ring
//!   of page-locked slots, in stream order. A pageable copy makes the driver stage the data
//!   itself and may stall the host; from page-locked memory the copy is an async DMA, and a slot
//!   is reused only after the copy that last read it has run.
//! - [`Mailbox`]: page-locked host memory mapped into the device, which a kernel writes a few
//!   words into (the sampled token and the device error flag). The host reads it after an event,
//!   so no copy sits in the stream between one decode step and the next.
//! - [`Readback`]: page-locked host memory that device words are copied into in stream order,
//!   read after an event recorded behind those copies: reading waits for them, not for the
//!   work enqueued after them (a batched decode step enqueued ahead).

use crate::error::{Context, CudaError};
use crate::Gpu;
use cudarc::driver::{sys, CudaEvent, CudaViewMut, DevicePtr, DevicePtrMut, PinnedHostSlice};

/// Page-locked `u32` slots for host-to-device copies, used round robin.
pub struct StagingRing {
    host: PinnedHostSlice<u32>,
    slot_len: usize,
    /// Per slot: recorded after the copy that last read it.
    copied: Vec<CudaEvent>,
    next: usize,
}

impl StagingRing {
    pub fn new(gpu: &Gpu, slots: usize, slot_len: usize) -> Result<Self, CudaError> {
        let what = || format!("allocating a staging ring of {slots} x {slot_len} words");
        let ctx = gpu.context();
        // SAFETY: the memory is written before any copy reads it (`copy` fills a slot first).
        let host = unsafe { ctx.alloc_pinned::<u32>(slots * slot_len.max(1)) }.context(what)?;
        let copied = (0..slots).map(|_| ctx.new_event(None)).collect::<Result<_, _>>().context(what)?;
        Ok(Self { host, slot_len: slot_len.max(1), copied, next: 0 })
    }

    /// Copy `src` into `dst[..src.len()]`, in stream order, through the next slot.
    pub fn copy(&mut self, gpu: &Gpu, src: &[u32], dst: &mut CudaViewMut<'_, u32>) -> Result<(), CudaError> {
        if src.len() > dst.len() {
            return Err(CudaError::invalid("staging copy", format!("{} words into a buffer of {}", src.len(), dst.len())));
        }
        if src.is_empty() {
            return Ok(());
        }
        if src.len() > self.slot_len {
            // Grow (rare: a larger batch table than ever before): every slot's copy must have run.
            for e in &self.copied {
                e.synchronize().context(|| "waiting for the staging ring's copies".into())?;
            }
            *self = Self::new(gpu, self.copied.len(), src.len().next_power_of_two())?;
        }
        let slot = self.next;
        self.next = (slot + 1) % self.copied.len();
        let done = &self.copied[slot];
        // Only the copy that read this slot a whole ring ago can still be pending.
        done.synchronize().context(|| "waiting for a staging slot".into())?;
        let stream = gpu.stream();
        let host = self.host.as_mut_slice().context(|| "mapping the staging ring".into())?;
        let staged = &mut host[slot * self.slot_len..slot * self.slot_len + src.len()];
        staged.copy_from_slice(src);
        let (dst_ptr, _sync) = dst.device_ptr_mut(stream);
        // SAFETY: `staged` is page-locked and stays untouched until `done` has fired, which is
        // recorded right after this copy in the same stream.
        unsafe { cudarc::driver::result::memcpy_htod_async(dst_ptr, staged, stream.cu_stream()) }
            .context(|| format!("copying {} words to the device", src.len()))?;
        done.record(stream).context(|| "recording a staging copy".into())
    }
}

/// Slots of [`Mailbox::SLOT_WORDS`] `u32` words of page-locked host memory that kernels write
/// through a device mapping. The host reads a slot once the event [`Mailbox::post`] recorded
/// for it after the writing kernel has fired.
pub struct Mailbox {
    host: PinnedHostSlice<u32>,
    device_addr: u64,
    posted: Vec<CudaEvent>,
}

impl Mailbox {
    /// Words of a slot: token, the device error flag's two words, tag.
    pub const SLOT_WORDS: usize = 4;

    pub fn new(gpu: &Gpu, slots: usize) -> Result<Self, CudaError> {
        let words = slots * Self::SLOT_WORDS;
        let what = || format!("allocating a {slots}-slot device-mapped host mailbox");
        let ctx = gpu.context();
        // SAFETY: zeroed below before any use.
        let mut host = unsafe { ctx.alloc_pinned_with_flags::<u32>(words, sys::CU_MEMHOSTALLOC_DEVICEMAP) }.context(what)?;
        let words_mut = host.as_mut_slice().context(what)?;
        words_mut.fill(0);
        let ptr = words_mut.as_mut_ptr();
        let mut device_addr: sys::CUdeviceptr = 0;
        // SAFETY: `ptr` is the start of a live allocation made with CU_MEMHOSTALLOC_DEVICEMAP.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device_addr, ptr.cast(), 0) }.result().context(what)?;
        let posted = (0..slots).map(|_| ctx.new_event(None)).collect::<Result<_, _>>().context(what)?;
        Ok(Self { host, device_addr, posted })
    }

    /// The address kernels write slot `slot` at (`op` names the caller in the error).
    pub fn slot_addr(&self, op: &'static str, slot: usize) -> Result<u64, CudaError> {
        if slot >= self.posted.len() {
            return Err(CudaError::invalid(op, format!("mailbox slot {slot} of {}", self.posted.len())));
        }
        Ok(self.device_addr + (slot * Self::SLOT_WORDS * 4) as u64)
    }

    /// Mark the end of the kernels that write `slot` (call right after enqueueing them).
    pub fn post(&self, gpu: &Gpu, slot: usize) -> Result<(), CudaError> {
        self.posted[slot].record(gpu.stream()).context(|| "recording the mailbox event".into())
    }

    /// Wait for `slot`'s last [`Self::post`], then read its words.
    pub fn read(&self, slot: usize) -> Result<[u32; Self::SLOT_WORDS], CudaError> {
        self.posted[slot].synchronize().context(|| "waiting for the mailbox".into())?;
        let words = self.host.as_slice().context(|| "reading the mailbox".into())?;
        // Volatile: the device wrote these behind the compiler's back.
        Ok(std::array::from_fn(|i| unsafe { std::ptr::read_volatile(&words[slot * Self::SLOT_WORDS + i]) }))
    }
}

/// Page-locked `u32` words that device data is copied into, in stream order; the host reads them
/// once the event [`Readback::post`] recorded behind the copies has fired.
pub struct Readback {
    host: PinnedHostSlice<u32>,
    copied: CudaEvent,
}

impl Readback {
    pub fn new(gpu: &Gpu, words: usize) -> Result<Self, CudaError> {
        let what = || format!("allocating a {words}-word page-locked readback buffer");
        let ctx = gpu.context();
        // Cached (not write-combined) memory: the host reads it. SAFETY: the host reads only
        // words a copy wrote (`read` after `post`).
        let host = unsafe { ctx.alloc_pinned_with_flags::<u32>(words.max(1), 0) }.context(what)?;
        let copied = ctx.new_event(None).context(what)?;
        Ok(Self { host, copied })
    }

    /// Enqueue a copy of `src` into words `at..at + src.len()`.
    pub fn copy(&mut self, gpu: &Gpu, src: &impl DevicePtr<u32>, at: usize) -> Result<(), CudaError> {
        let (ptr, _sync) = src.device_ptr(gpu.stream());
        self.copy_from(gpu, ptr, src.len(), at)
    }

    /// Enqueue a copy of the device error flag (2 words) into words `at..at + 2`: a nonzero
    /// first word means [`Gpu::check_device`] has an error to report.
    pub fn copy_error_flag(&mut self, gpu: &Gpu, at: usize) -> Result<(), CudaError> {
        self.copy_from(gpu, gpu.error_flag_ptr(), 2, at)
    }

    fn copy_from(&mut self, gpu: &Gpu, src: u64, len: usize, at: usize) -> Result<(), CudaError> {
        if at + len > self.host.len() {
            return Err(CudaError::invalid("readback", format!("words {at}..{} of a buffer of {}", at + len, self.host.len())));
        }
        let host = self.host.as_mut_slice().context(|| "mapping the readback buffer".into())?;
        // SAFETY: page-locked memory, read by the host only after `post`'s event has fired.
        unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut host[at..at + len], src, gpu.stream().cu_stream()) }
            .context(|| format!("copying {len} words to the host"))
    }

    /// Mark the end of the copies (call right after enqueueing them).
    pub fn post(&self, gpu: &Gpu) -> Result<(), CudaError> {
        self.copied.record(gpu.stream()).context(|| "recording the readback event".into())
    }

    /// Wait for the last [`Self::post`], then read words `range`.
    pub fn read(&self, range: std::ops::Range<usize>) -> Result<Vec<u32>, CudaError> {
        self.copied.synchronize().context(|| "waiting for the readback".into())?;
        let words = self.host.as_slice().context(|| "reading the readback buffer".into())?;
        // Volatile: written by the device's copy engine behind the compiler's back.
        Ok(words[range].iter().map(|w| unsafe { std::ptr::read_volatile(w) }).collect())
    }
}
