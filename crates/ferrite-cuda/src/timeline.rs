//! `FERRITE_CUDA_TIMELINE=1`: where a replayed decode step's time goes, kernel by kernel.
//!
//! `FERRITE_PROFILE` brackets every op with events and waits for them, which takes programmatic
//! dependent launch and graph replay (the things a decode step's speed rests on) out of what it
//! measures. Here every module is compiled with `TIMELINE=1` instead: block (0, 0, 0) of each
//! kernel appends the GPU's global timer and its module's tag to one device buffer as it passes
//! `pdl_wait` (see the common header). A kernel passes that wait when its predecessor has
//! finished, so the gap from one entry to the next is what the earlier kernel adds to the
//! critical path: its own run after the wait, its tail, and the hand-over to the next one.
//! The cost is one L2 atomic on one thread per launch, a round trip on that kernel's critical
//! path (when the mark also read its buffer's address and slot count after the wait, SmolLM2
//! ran at 55% of its rate with the timeline on: docs/perf.md, stop 44). Like every profile,
//! the numbers explain where the time goes and are never optimisation targets (those come from
//! `ferrite bench` without the switch).

use crate::error::{Context, CudaError};
use cudarc::driver::{CudaModule, CudaSlice, CudaStream, DevicePtr};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// Entries the buffer holds; later launches are counted but not recorded.
const SLOTS: u32 = 1 << 20;
/// Gaps between two entries longer than this are the host's (between runs, while loading, …),
/// not a kernel's, and are left out of the table.
const HOST_GAP_NS: u64 = 1_000_000;

/// One compiled module as the table names it: its family and its macros.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ModuleLabel {
    pub family: &'static str,
    pub macros: Vec<(String, String)>,
}

/// The device buffer (the entry count in the low half of word 0, then (time ns, tag) per
/// entry; the kernels know its slot count from their `ferrite_timeline` global) and the
/// labels of the modules that write to it, indexed by tag.
pub(crate) struct Timeline {
    stream: Arc<CudaStream>,
    buffer: CudaSlice<u64>,
    labels: Mutex<Vec<ModuleLabel>>,
}

impl Timeline {
    pub(crate) fn new(stream: Arc<CudaStream>) -> Result<Self, CudaError> {
        let buffer = stream
            .alloc_zeros::<u64>(2 + 2 * SLOTS as usize)
            .context(|| "allocating the timeline buffer".into())?;
        Ok(Timeline { stream, buffer, labels: Mutex::default() })
    }

    /// Points a freshly loaded module (compiled with `TIMELINE=1`) at the buffer, under a new tag.
    pub(crate) fn attach(&self, module: &Arc<CudaModule>, label: ModuleLabel) -> Result<(), CudaError> {
        let mut labels = self.labels.lock().unwrap_or_else(|p| p.into_inner());
        let tag = labels.len() as u64;
        let (address, _) = self.buffer.device_ptr(&self.stream);
        let mut global = module
            .get_global("ferrite_timeline", &self.stream)
            .context(|| format!("finding the timeline global of kernel family {}", label.family))?;
        // SAFETY: the global is `u64 ferrite_timeline[3]` in the common header.
        let mut words = unsafe { global.transmute_mut::<u64>(3) }
            .ok_or_else(|| CudaError::DeviceCheck(format!("kernel family {}: ferrite_timeline is not three u64s", label.family)))?;
        self.stream
            .memcpy_htod(&[address, tag, u64::from(SLOTS)], &mut words)
            .context(|| format!("writing the timeline global of kernel family {}", label.family))?;
        labels.push(label);
        Ok(())
    }

    /// Forgets what was recorded (stream-ordered: launches enqueued before are dropped too).
    pub(crate) fn reset(&self) -> Result<(), CudaError> {
        let (address, _) = self.buffer.device_ptr(&self.stream);
        // SAFETY: the first 4 bytes of the buffer (the entry count), on the buffer's own stream.
        unsafe { cudarc::driver::result::memset_d8_async(address, 0, 4, self.stream.cu_stream()) }
            .context(|| "resetting the timeline buffer".into())
    }

    /// The table of everything recorded since the last reset (waits for the stream).
    pub(crate) fn report(&self) -> Result<String, CudaError> {
        let raw = self.stream.clone_dtoh(&self.buffer).context(|| "reading the timeline buffer".into())?;
        let recorded = (raw[0] as u32).min(SLOTS) as usize;
        let entries: Vec<(u64, usize)> = raw[2..2 + 2 * recorded].chunks_exact(2).map(|e| (e[0], e[1] as usize)).collect();
        let labels = self.labels.lock().unwrap_or_else(|p| p.into_inner());
        let mut text = format!(
            "kernel timeline ({} launches recorded{}) — WARNING: profiled timings are not optimisation targets; measure with `ferrite bench`\n",
            recorded,
            if raw[0] as u32 > SLOTS { format!(", {} more not recorded", raw[0] as u32 - SLOTS) } else { String::new() }
        );
        text += &render(&summarize(&entries), &labels);
        Ok(text)
    }
}

/// Time one kernel adds, keyed by its module's tag and the tag of the kernel before it (so the
/// same variant in two places of a step, e.g. two projections of one tiling, stays apart).
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Summary {
    /// (tag, previous tag or None) -> (total ns, launches)
    pub by_kernel: BTreeMap<(usize, Option<usize>), (u64, u64)>,
    pub total_ns: u64,
    /// Gaps left out as the host's.
    pub host_gaps: u64,
    /// Shortest non-zero gap seen: the timer's resolution, at best.
    pub finest_ns: u64,
}

/// Attributes the gap from each entry to the next to the earlier entry's kernel.
pub(crate) fn summarize(entries: &[(u64, usize)]) -> Summary {
    let mut s = Summary::default();
    let mut previous = None;
    for pair in entries.windows(2) {
        let ((t0, tag), (t1, _)) = (pair[0], pair[1]);
        let gap = t1.saturating_sub(t0);
        if gap > HOST_GAP_NS {
            s.host_gaps += 1;
            previous = None;
            continue;
        }
        let e = s.by_kernel.entry((tag, previous)).or_default();
        e.0 += gap;
        e.1 += 1;
        s.total_ns += gap;
        if gap > 0 && (s.finest_ns == 0 || gap < s.finest_ns) {
            s.finest_ns = gap;
        }
        previous = Some(tag);
    }
    s
}

/// The table, longest total first. A label shows its family and only the macros whose values
/// differ between that family's modules (the rest say nothing about which kernel it is).
pub(crate) fn render(s: &Summary, labels: &[ModuleLabel]) -> String {
    let name = |tag: usize| -> String {
        let Some(label) = labels.get(tag) else { return format!("tag {tag}") };
        let siblings: Vec<&ModuleLabel> = labels.iter().filter(|l| l.family == label.family).collect();
        let varying: Vec<String> = label
            .macros
            .iter()
            .filter(|(k, v)| siblings.iter().any(|o| o.macros.iter().any(|(k2, v2)| k2 == k && v2 != v)))
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        if varying.is_empty() { label.family.to_string() } else { format!("{} {}", label.family, varying.join(" ")) }
    };
    let mut rows: Vec<_> = s.by_kernel.iter().collect();
    rows.sort_by_key(|r| std::cmp::Reverse(r.1 .0));
    let mut out = format!("{:<70} {:<22} {:>8} {:>9} {:>7}\n", "kernel", "after", "launches", "us/launch", "share");
    for ((tag, previous), (ns, n)) in rows {
        let after = previous.map_or("(first)".to_string(), |p| labels.get(p).map_or(format!("tag {p}"), |l| l.family.to_string()));
        out += &format!(
            "{:<70} {:<22} {:>8} {:>9.2} {:>6.1}%\n",
            name(*tag),
            after,
            n,
            *ns as f64 / *n as f64 / 1e3,
            100.0 * *ns as f64 / s.total_ns.max(1) as f64
        );
    }
    out += &format!(
        "recorded kernel time {:.3} ms; {} host gaps over {} us left out; finest gap {} ns\n",
        s.total_ns as f64 / 1e6,
        s.host_gaps,
        HOST_GAP_NS / 1000,
        s.finest_ns
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gaps_go_to_the_earlier_kernel_and_host_gaps_are_left_out() {
        // Kernels 0, 1, 0, 1 back to back, a host pause, then 0, 1 again.
        let entries = [(0, 0), (1_000, 1), (4_000, 0), (5_500, 1), (3_000_000, 0), (3_001_000, 1), (3_004_000, 0)];
        let s = summarize(&entries);
        // 0 first (at the start, and again after the pause): 1 000 + 1 000; 1 after 0: 3 000 +
        // 3 000; 0 after 1: 1 500; the pause itself left out.
        assert_eq!(s.by_kernel[&(0, None)], (2_000, 2));
        assert_eq!(s.by_kernel[&(1, Some(0))], (6_000, 2));
        assert_eq!(s.by_kernel[&(0, Some(1))], (1_500, 1));
        assert_eq!(s.by_kernel.len(), 3);
        assert_eq!((s.host_gaps, s.total_ns, s.finest_ns), (1, 9_500, 1_000));
    }

    /// The header's recording code compiles into kernels that wait early (`KERNEL_ENTRY`) and
    /// late (the GEMV's `pdl_wait` after its first weight loads). Needs only libnvrtc.
    #[test]
    fn kernels_compile_with_the_timeline() {
        use crate::cache::nvrtc_options;
        use crate::kernels::{gemv::GemvQ8Variant, norm::NormVariant, KernelVariant};
        if let Err(e) = crate::compile::require_nvrtc() {
            eprintln!("skipped: {e}");
            return;
        }
        fn compile<V: KernelVariant>(v: &V) {
            let mut options = nvrtc_options(v, "sm_90");
            options.push("-DTIMELINE=1".into());
            crate::compile::compile_cubin(V::FAMILY, &V::SOURCES.concat(), &options).unwrap_or_else(|e| panic!("{e}"));
        }
        compile(&GemvQ8Variant::for_shape(ferrite_gguf::GgmlType::Q4_0, 4096, 4096, 1, 132).emitting(2));
        compile(&NormVariant::for_dim(576));
    }

    #[test]
    fn labels_show_only_the_macros_that_tell_modules_apart() {
        let label = |family, emit: &str| ModuleLabel {
            family,
            macros: vec![("EMIT".into(), emit.into()), ("NWARPS".into(), "8".into())],
        };
        let labels = [label("gemv_q8", "0"), label("gemv_q8", "2"), label("attention", "0")];
        let s = summarize(&[(0, 0), (2_000, 2), (5_000, 1), (6_000, 0)]);
        let table = render(&s, &labels);
        assert!(table.contains("gemv_q8 EMIT=0 "), "{table}");
        assert!(table.contains("gemv_q8 EMIT=2 "), "{table}");
        assert!(!table.contains("NWARPS"), "{table}");
        assert!(table.lines().any(|l| l.starts_with("attention ") && l.contains("gemv_q8")), "{table}");
    }
}
