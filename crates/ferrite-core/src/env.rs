//! The one registry of `FERRITE_*` environment switches.
//!
//! Every switch the code reads is declared here with its default, its effect and its status,
//! and `ferrite env` prints this table. Code reads a switch only through [`Switch::get`] /
//! [`Switch::flag`] / [`Switch::parse`], so an undeclared variable cannot sneak in.
//!
//! Value convention (as in MNN's registry): `1` is explicitly on, `0` explicitly off, unset means
//! the documented default.

use std::fmt;

/// Lifecycle of a switch: whether it is a permanent knob or a temporary A/B lever.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    /// Supported user-facing setting.
    Stable,
    /// Kept for A/B measurements between kernel paths; may be removed once a path wins.
    AbTest,
    /// Diagnostics only: output from these is not an optimisation target.
    Diagnostic,
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Status::Stable => "stable",
            Status::AbTest => "a/b",
            Status::Diagnostic => "diagnostic",
        })
    }
}

/// One declared environment switch.
#[derive(Debug)]
pub struct Switch {
    pub name: &'static str,
    pub default: &'static str,
    pub effect: &'static str,
    pub status: Status,
}

fn parse_flag(v: &str) -> Option<bool> {
    match v.to_ascii_lowercase().as_str() {
        "1" | "true" | "on" | "yes" => Some(true),
        "0" | "false" | "off" | "no" => Some(false),
        _ => None,
    }
}

impl Switch {
    /// The raw value, if set and non-empty.
    pub fn get(&self) -> Option<String> {
        std::env::var(self.name).ok().filter(|v| !v.is_empty())
    }

    /// Boolean switch: `1`/`true`/`on` are on, `0`/`false`/`off` are off, unset is the
    /// registry's default (so the code and `ferrite env` cannot disagree). Any other value is
    /// reported on stderr and treated as the default.
    pub fn flag(&self) -> bool {
        let default = parse_flag(self.default).unwrap_or(false);
        match self.get() {
            None => default,
            Some(v) => parse_flag(&v).unwrap_or_else(|| {
                eprintln!("warning: {}={v:?} is not 0/1; using the default", self.name);
                default
            }),
        }
    }

    /// Parsed switch; an unparsable value is reported and the default is used.
    pub fn parse<T: std::str::FromStr>(&self, default: T) -> T {
        match self.get() {
            None => default,
            Some(v) => v.parse().unwrap_or_else(|_| {
                eprintln!("warning: {}={v:?} cannot be parsed; using the default", self.name);
                default
            }),
        }
    }
}

macro_rules! switches {
    ($( $(#[$m:meta])* $id:ident = ($name:literal, $default:literal, $status:ident, $effect:literal); )*) => {
        $( $(#[$m])* pub static $id: Switch = Switch {
            name: $name, default: $default, effect: $effect, status: Status::$status,
        }; )*
        /// Every declared switch, in declaration order.
        pub static ALL: &[&Switch] = &[ $( &$id ),* ];
    };
}

switches! {
    /// CPU worker threads.
    THREADS = ("FERRITE_THREADS", "all cores", Stable,
        "Number of CPU threads for the CPU backend's matmuls and attention.");
    /// Where downloaded/default models live.
    MODEL_DIR = ("FERRITE_MODEL_DIR", "./models", Stable,
        "Folder searched for the default model (SmolLM2-135M-Instruct.Q4_1.gguf).");
    /// Disable SIMD kernels on the CPU (forces the scalar fallback).
    CPU_SCALAR = ("FERRITE_CPU_SCALAR", "0", AbTest,
        "1 forces the scalar CPU dot-product kernels instead of AVX2/AVX-512/NEON.");
    /// Q4_0/Q4_1/Q8_0 matrices repacked into row groups at load (AVX2 and AVX-512 VNNI CPUs).
    CPU_ROW_GROUPS = ("FERRITE_CPU_ROW_GROUPS", "1", AbTest,
        "0 keeps Q4_0/Q4_1/Q8_0 matrices in the GGUF layout (row kernels) instead of repacking them into row groups (8 rows for the AVX2, 16 for the AVX-512 VNNI group matmul) (one copy in RAM).");
    /// The CPU KV cache's element type.
    CPU_KV_DTYPE = ("FERRITE_CPU_KV_DTYPE", "f16", AbTest,
        "f16|f32: the element type of the quantized CPU path's KV cache (the reference precision, cpu-ref, always keeps f32). f16 halves the bytes a decode step's attention reads from memory, where a batched step's caches come from.");
    /// Kernel cache folder for NVRTC output.
    KERNEL_CACHE = ("FERRITE_KERNEL_CACHE", "$XDG_CACHE_HOME/ferrite/kernels", Stable,
        "Directory of the on-disk CUDA kernel (cubin) cache.");
    /// Turn the on-disk kernel cache off.
    KERNEL_CACHE_OFF = ("FERRITE_KERNEL_CACHE_OFF", "0", Stable,
        "1 disables the on-disk kernel cache (every run recompiles with NVRTC).");
    DISABLE_QKV_FUSION = ("FERRITE_DISABLE_QKV_FUSION", "0", AbTest,
        "1 keeps Q, K and V as three linears instead of one over a fused weight (declared at load).");
    DISABLE_GATE_UP_FUSION = ("FERRITE_DISABLE_GATE_UP_FUSION", "0", AbTest,
        "1 keeps the MLP gate and up projections as two linears.");
    DISABLE_NORM_FUSION = ("FERRITE_DISABLE_NORM_FUSION", "0", AbTest,
        "1 runs RMSNorm as its own op instead of folding it into the next projection's prologue.");
    DISABLE_RESIDUAL_FUSION = ("FERRITE_DISABLE_RESIDUAL_FUSION", "0", AbTest,
        "1 runs the residual add as its own op instead of the output/down projection's epilogue (or, after Gemma's post-norms, the norm's).");
    /// Fusion of the MLP activation into the gate/up linear.
    DISABLE_GLU_FUSION = ("FERRITE_DISABLE_GLU_FUSION", "0", AbTest,
        "1 keeps SwiGLU/GeGLU as a separate op after the fused gate/up projection instead of its epilogue.");
    DISABLE_CUDA_GRAPH = ("FERRITE_DISABLE_CUDA_GRAPH", "0", AbTest,
        "1 launches every decode op separately instead of replaying the decode step captured as a CUDA graph.");
    DISABLE_CUDA_GEMM_GLU = ("FERRITE_DISABLE_CUDA_GEMM_GLU", "0", AbTest,
        "1 runs a fused gate/up projection of a 33-64-row batch as the warpgroup-MMA GEMM writing both halves, then the SwiGLU/GeGLU kernel, instead of the GEMM applying the activation in its epilogue.");
    DISABLE_CUDA_STAGED_HANDOFF = ("FERRITE_DISABLE_CUDA_STAGED_HANDOFF", "0", AbTest,
        "1: the producers of 16-bit GEMM inputs write f32 rows only and their consumers convert them in a launch of their own; by default a gated linear whose GLU runs in the warpgroup-MMA GEMM's epilogue writes the down projection's staged input directly, and attention writes the output projection's bf16 rows when that runs on cuBLAS (batched steps of 33-64 tokens).");
    DISABLE_CUDA_BATCH_GRAPHS = ("FERRITE_DISABLE_CUDA_BATCH_GRAPHS", "0", AbTest,
        "1 launches every op of a batched decode step (one token per sequence, serving) separately instead of replaying the step captured as a CUDA graph per (sequences, block-table width); FERRITE_DISABLE_CUDA_GRAPH=1 turns these off too.");
    CUDA_KV_DTYPE = ("FERRITE_CUDA_KV_DTYPE", "f16", Stable,
        "Element type of the CUDA KV cache: f16 (default) or f32 (for fp32 comparisons with the CPU).");
    /// API key of `ferrite serve`.
    API_KEY = ("FERRITE_API_KEY", "none", Stable,
        "ferrite serve: require `Authorization: Bearer <value>` on /v1/* (--api-key takes precedence).");
    SKIP_FUZZ = ("FERRITE_SKIP_FUZZ", "0", Stable,
        "scripts/test.sh: 1 skips the bounded cargo-fuzz run of the GGUF parser.");
    SKIP_OPENAI_CHECK = ("FERRITE_SKIP_OPENAI_CHECK", "0", Stable,
        "scripts/test.sh: 1 skips checking `ferrite serve` with the official openai Python client (scripts/openai-check.sh).");
    FUZZ_SECONDS = ("FERRITE_FUZZ_SECONDS", "30", Stable,
        "scripts/test.sh: length of the GGUF parser fuzzing run in seconds.");
    /// Per-op profiling.
    PROFILE = ("FERRITE_PROFILE", "0", Diagnostic,
        "1 prints a per-op time table when a backend closes (CPU: wall clock; CUDA: events around every op, which serialises them). Profiled numbers are NOT optimisation targets.");
    /// In-kernel timeline of the CUDA stream.
    CUDA_TIMELINE = ("FERRITE_CUDA_TIMELINE", "0", Diagnostic,
        "1 compiles every CUDA kernel to note the GPU timer as it starts (after waiting for its predecessor) and prints, when the device is closed, the time each kernel adds to the stream with graph replay and dependent launch left on (FERRITE_PROFILE's events serialise the ops). Profiled numbers are NOT optimisation targets.");
    /// Machine code of every compiled CUDA kernel, for inspection.
    KERNEL_DUMP = ("FERRITE_KERNEL_DUMP", "", Diagnostic,
        "A directory: every CUDA module NVRTC compiles is also written there as <family><-D macros>.cubin (scripts/kernel-sass.sh disassembles them: instructions, registers, spills and the loads issued before the dependent-launch wait of each variant).");
    /// Force a CUDA linear-layer path.
    CUDA_LINEAR = ("FERRITE_CUDA_LINEAR", "auto", AbTest,
        "auto|gemv|gemm: gemv takes the quantized GEMV at every token count (float weights with cols % 32 != 0 still use GEMM), gemm takes dequantize + cuBLAS.");
    /// Token-count threshold of the CUDA GEMV.
    CUDA_GEMV_MAX_TOKENS = ("FERRITE_CUDA_GEMV_MAX_TOKENS", "8", AbTest,
        "Largest token count that takes the quantized GEMV under FERRITE_CUDA_LINEAR=auto; more tokens take the small-batch tensor-core GEMM (up to FERRITE_CUDA_MMA_MAX_TOKENS) or dequantize + cuBLAS.");
    CUDA_MMA_MAX_TOKENS = ("FERRITE_CUDA_MMA_MAX_TOKENS", "64", AbTest,
        "Largest token count that takes the small-batch tensor-core GEMM on packed quantized weights (above FERRITE_CUDA_GEMV_MAX_TOKENS; batched decode steps of a server); a weight with a resident bf16 copy takes it up to 32 tokens and above that cuBLAS on the copy unless the warpgroup-MMA kernel is faster for it (FERRITE_DISABLE_CUDA_WGMMA); 0 sends those batches to cuBLAS (on the copy, or dequantized per call).");
    /// Warpgroup MMAs in the small-batch GEMM (CUDA, sm_90).
    DISABLE_CUDA_WGMMA = ("FERRITE_DISABLE_CUDA_WGMMA", "0", AbTest,
        "1 keeps the small-batch tensor-core GEMM on mma.sync at every batch size (33-64-token batches then take cuBLAS on a resident bf16 copy where there is one), instead of warpgroup MMAs (wgmma, sm_90 only) above 32 tokens on rows of whole 128-column chunks (over a resident copy only for weights with at least 8 chunks of work per block slot).");
    /// Programmatic dependent launch on sm_90+.
    DISABLE_CUDA_PDL = ("FERRITE_DISABLE_CUDA_PDL", "0", AbTest,
        "1 launches CUDA kernels without programmatic dependent launch (each kernel then starts only after the previous one has finished, instead of overlapping its start-up and weight loads).");
    /// Projections around attention releasing the next launch before their wait (CUDA).
    DISABLE_CUDA_EARLY_RELEASE = ("FERRITE_DISABLE_CUDA_EARLY_RELEASE", "0", AbTest,
        "1: every CUDA kernel releases the next launch only after waiting for its predecessor; by default the int8 GEMVs into and out of attention in one-token steps release it before (the attention and the MLP then become resident and request their cached rows and weights one kernel sooner).");
    /// One-token GEMVs that would leave half the SMs idle write f32 rows on more blocks (CUDA).
    DISABLE_CUDA_SPREAD_ROWS = ("FERRITE_DISABLE_CUDA_SPREAD_ROWS", "0", AbTest,
        "1 keeps the int8 hand-off of every one-token GEMV producer; by default one whose 32-row blocks would fill at most half the SMs over rows of 128+ Q4-family units (the 1B shape's down projection) writes its f32 row on a grid of 16-row blocks instead, and the next GEMV quantizes that row itself (H100, 1B Q4_0 tg128: +4.7%).");
    /// RoPE applied inside the attention op.
    DISABLE_ROPE_FUSION = ("FERRITE_DISABLE_ROPE_FUSION", "0", AbTest,
        "1 rotates Q and K with a separate in-place RoPE op before attention, instead of inside the attention op as it stores K in the cache and reads Q (CUDA: one kernel fewer per layer).");
    /// QK-norm applied inside the attention op.
    DISABLE_HEAD_NORM_FUSION = ("FERRITE_DISABLE_HEAD_NORM_FUSION", "0", AbTest,
        "1 normalises each Q and K head (Qwen3's and Gemma 3's QK-norm) with two separate in-place ops before attention, instead of inside the attention op before its RoPE (CUDA: two kernels fewer per layer). Needs the RoPE fusion.");
    /// Producers leave int8 activations for the next int8 GEMV (CUDA).
    DISABLE_INT8_HANDOFF = ("FERRITE_DISABLE_INT8_HANDOFF", "0", AbTest,
        "1 drops the int8 hand-offs declared at load: each int8 GEMV quantizes its input (and applies its RMSNorm) in a launch of its own, instead of the attention or the previous GEMV leaving it quantized (CUDA: up to four kernels fewer per layer).");
    /// Threads of one-token CPU steps.
    DECODE_THREADS = ("FERRITE_DECODE_THREADS", "auto", Stable,
        "Threads that run a one-token CPU step (decode): auto = one per 16 MB of linear weights a token reads, at least 4 and at most the pool's (--threads / FERRITE_THREADS), so a small model's decode does not fork and join over every core of a large machine (SmolLM2 on 16 cores: 2-8 threads decode at the same rate, 16 a third slower); a number sets it. Prefill and batched steps use the whole pool.");
    /// Decoder layers declared at load (CUDA: the fused MLP of a one-token step).
    DISABLE_LAYER_FUSION = ("FERRITE_DISABLE_LAYER_FUSION", "0", AbTest,
        "1 declares no decoder layers at load (a Llama-family layer's five ops after the other fusions: QKV, attention, output projection, gate/up, down), so that no CUDA one-token step runs a layer's MLP as one launch (FERRITE_CUDA_FUSED_MLP).");
    /// The MLP of a declared decoder layer as one int8 GEMV launch (CUDA).
    CUDA_FUSED_MLP = ("FERRITE_CUDA_FUSED_MLP", "1", AbTest,
        "1: in untraced one-token CUDA steps, the gate/up and down projections of each decoder layer declared at load run as one launch (ops::mlp_q8: each block quantizes its SwiGLU outputs, multiplies them by their columns of the down projection and adds the products into the residual stream with atomic adds, so the logits' last bits vary from run to run), and the next layer's QKV projection quantizes that stream itself; only where the adds stay few (ops::MLP_MAX_ADDS: SmolLM2-sized layers; +4% tg128 there, measured on the H100, docs/perf.md stop 35); a note at load names layers it cannot run. 0: two launches, bit-reproducible.");
    /// Decode attention stores the token's K/V itself (CUDA).
    DISABLE_KV_STORE_FUSION = ("FERRITE_DISABLE_KV_STORE_FUSION", "0", AbTest,
        "1 runs the CUDA decode steps' K/V store (and RoPE) as its own store_qkv launch before attention, instead of inside the attention kernel (one-token steps, and batched serving steps of one token per sequence).");
    /// Decode steps enqueued before the previous token is read back.
    DECODE_AHEAD = ("FERRITE_DECODE_AHEAD", "1", AbTest,
        "1: where the backend samples on the device (CUDA), each generated token goes from the sampler to the next step's input on the device and that step is enqueued before the token is read back (through mapped host memory), so the device does not wait for the host between tokens; batched serving steps of decodes likewise enqueue the next step on the drawn tokens before reading them back (where the next batch is likely the same sequences); 0 reads each token back, then enqueues the next step.");
    /// Greedy decode steps that draw their own next token inside their graph (CUDA).
    DISABLE_CUDA_STEP_DRAWS = ("FERRITE_DISABLE_CUDA_STEP_DRAWS", "0", AbTest,
        "1 launches every CUDA draw on its own between two decode steps' graphs; by default a greedy one-token step enqueued ahead of the host (FERRITE_DECODE_AHEAD) ends with its own draw, captured in its graph: the token goes to the next step's inputs (at the step's position + 1, read on the device) and to one of two mailbox slots by parity, so no launch sits between two steps (H100, SmolLM2 tg128 +0.6%, 1B +0.3%).");
    /// Two-stage device sampling (chunk candidates, then one block over them).
    DISABLE_SAMPLE_CANDIDATES = ("FERRITE_DISABLE_SAMPLE_CANDIDATES", "0", AbTest,
        "1: CUDA draws read the whole vocabulary in one block; by default a block per 1024 logits works on its chunk first (top-k up to 1024: keeps the chunk's top-k for the one sampling block, about 6x faster for top-k 40 over 49152 logits; greedy: the chunk's best, the last block to finish picks the best of those). The same token either way.");
    /// One launch for all of a batched step's sampled draws (CUDA).
    DISABLE_CUDA_ROW_DRAWS = ("FERRITE_DISABLE_CUDA_ROW_DRAWS", "0", AbTest,
        "1: a batched step's sampled (non-greedy) sequences draw one launch after another, as a single sequence does; by default one launch draws them all side by side, a block per sequence (and one launch keeps the chunk candidates of all those with top-k up to 1024). The same tokens either way.");
    /// Split-KV (flash-decoding) attention for decode on CUDA.
    SPLIT_ATTENTION = ("FERRITE_SPLIT_ATTENTION", "1", AbTest,
        "1 runs CUDA decode attention on caches over 256 positions split-KV: each query's keys cut into shares of at least 128 computed by separate blocks (as many as the position needs), merged by the last to finish; 0 gives each query one block.");
    /// Activation format of the CUDA GEMV on quantized weights.
    CUDA_GEMV_ACTIVATIONS = ("FERRITE_CUDA_GEMV_ACTIVATIONS", "q8", AbTest,
        "q8|f32: q8 quantizes activations to int8 blocks (the CPU quantized path's numerics) and multiplies with dp4a, fusing norm, bias and residual; f32 multiplies f32 activations (matches the fp32 CPU reference to rounding).");
    /// Force a CUDA Gated DeltaNet path.
    CUDA_GDN_PATH = ("FERRITE_CUDA_GDN_PATH", "auto", AbTest,
        "auto|recurrent|chunked: the CUDA Gated DeltaNet delta rule; auto runs batches of 128+ tokens in the chunked (WY/UT transform, 64-token chunks) form and shorter ones token by token; the others force one path for every batch.");
    DISABLE_GEMV_SPLIT_K = ("FERRITE_DISABLE_GEMV_SPLIT_K", "0", AbTest,
        "1: the int8 GEMV never splits a row's units over slices of a block (by default it does, up to 4 slices, when its grid has at most one block per SM, e.g. the emitting output/down projections).");
    CUDA_ATTENTION_GROUPS = ("FERRITE_CUDA_ATTENTION_GROUPS", "adaptive", AbTest,
        "off|paged|adaptive|all (auto: adaptive): where a CUDA attention block serves up to 8 query heads of one KV group, which score each K row and weigh each V row they load together (same results per head); paged: the batched serving steps (2x faster kernel at 64 sequences); adaptive: also one-token decode steps deep in a context (FERRITE_CUDA_ATTENTION_GROUP_SHARE_VALUES), each layout a captured graph of its own; all: one-token decode at every length (8B: +12% at 4096 cached positions, -7% at short contexts); off: a block per query head everywhere.");
    /// K/V values per share from which adaptive decode attention groups heads.
    CUDA_ATTENTION_GROUP_SHARE_VALUES = ("FERRITE_CUDA_ATTENTION_GROUP_SHARE_VALUES", "16384", AbTest,
        "With FERRITE_CUDA_ATTENTION_GROUPS=adaptive: a one-token decode step whose per-head launch would give each key share this many K/V values or more (keys times head size) runs a block per KV group instead (H200: the 8B shape, 9 shares of 128-value rows, from 1 152 keys on; the 1B shape, 64-value rows, from 2 304; SmolLM2's 30 shares from 7 680).");

    /// Most warps of a wide one-token decode attention block.
    CUDA_ATTENTION_WARPS = ("FERRITE_CUDA_ATTENTION_WARPS", "16", AbTest,
        "4|8|16: the most warps of a wide CUDA decode attention block. A one-token step's attention runs a 4-warp block per query head, each warp scoring 32 keys per batch, and splits a context past 128 keys into shares merged through global memory; from 129 keys up to 32 x warps a block of more warps per head (16 for heads of 64 values, 8 for 128, none for 256) holds them all and merges its warps in shared memory, a decode graph of its own (H100, stop 55: SmolLM2 tg128 at depth 256 +23%, the 1B +14%, depth 0 and 1 024 unchanged). 4: no wide blocks.");
    /// Batches of keys a warp of a wide decode attention block takes.
    CUDA_ATTENTION_WIDE_BATCHES = ("FERRITE_CUDA_ATTENTION_WIDE_BATCHES", "2", AbTest,
        "1-64: how many batches of 32 keys each warp of a wide CUDA decode attention block (FERRITE_CUDA_ATTENTION_WARPS) takes, one after the other, so the wide stage serves up to 32 x warps x batches keys (2: 1 024 keys with 16 warps). More batches cost a memory round trip each and spare the short layout's merge of shares through global memory (H100, stop 55, tg128 at depth 512 against 1: SmolLM2 +3%, the 1B +10%; 4 batches: depth 1 024 16% slower).");
    /// Wide decode attention blocks per query head, as one thread-block cluster.
    CUDA_ATTENTION_WIDE_CLUSTER = ("FERRITE_CUDA_ATTENTION_WIDE_CLUSTER", "1", AbTest,
        "1-8: the wide CUDA decode attention blocks per query head (sm_90), launched as one thread-block cluster whose blocks split the keys and merge their states through distributed shared memory (a cluster barrier) instead of global memory, so the wide stage serves up to 32 x warps x batches x blocks keys on more SMs. 1: one block per head, no cluster. Not yet measured on a GPU (stop 55).");
    /// Cap on the query heads a grouped CUDA attention block serves.
    CUDA_ATTENTION_MAX_GROUP = ("FERRITE_CUDA_ATTENTION_MAX_GROUP", "8", AbTest,
        "1-8: the most query heads of one KV group that a grouped CUDA attention block (FERRITE_CUDA_ATTENTION_GROUPS) serves; the group is the largest divisor of the heads per KV head up to it. Fewer heads per block mean more blocks, each with less arithmetic, and each K/V row loaded by more blocks.");
    CUDA_ATTENTION_PATH = ("FERRITE_CUDA_ATTENTION_PATH", "auto", AbTest,
        "auto|simt|tensor: the CUDA attention kernel; auto runs batches of 16+ queries over an f16 cache in the tensor-core flash-attention kernel (prefill) and the rest in the one-query-per-block SIMT kernel; tensor on an f32 cache is an error.");
    /// Force a CUDA MoE expert path.
    CUDA_MOE_PATH = ("FERRITE_CUDA_MOE_PATH", "auto", AbTest,
        "auto|pairs|grouped: how the CUDA MoE expert GEMVs walk a batch's (token, slot) pairs; auto and pairs run them pair by pair; grouped groups the pairs by expert on the device first (each weight chunk loaded serves up to 8 pairs of one expert; slower than pairs on the H200 so far, docs/perf.md) and needs int8 activations on quantized banks, else it is an error.");
    /// Resident GEMM-type copies of the weights for prefill.
    CUDA_EXPAND_WEIGHTS = ("FERRITE_CUDA_EXPAND_WEIGHTS", "auto", AbTest,
        "auto|on|off: keep a copy of every batched linear's weight dequantized to the GEMM input type (bf16: 2 bytes per weight) so prefill GEMMs skip the per-call dequantization; auto does it when the copies fit in half the free device memory after the KV cache.");
    CUDA_GEMM_PRECISION = ("FERRITE_CUDA_GEMM_PRECISION", "bf16", Stable,
        "f32|f16|bf16: input type of the cuBLAS GEMM path (prefill; weights dequantized to it, f32 accumulate): bf16 runs on tensor cores, f32 matches the CPU reference to rounding.");
}

/// Look a switch up by name (used by `ferrite env NAME`).
pub fn find(name: &str) -> Option<&'static Switch> {
    ALL.iter().copied().find(|s| s.name == name)
}

/// Render the registry as an aligned text table, with the current value of each switch.
pub fn table() -> String {
    let rows: Vec<[String; 5]> = ALL
        .iter()
        .map(|s| {
            [
                s.name.to_string(),
                s.get().unwrap_or_else(|| "-".into()),
                s.default.to_string(),
                s.status.to_string(),
                s.effect.to_string(),
            ]
        })
        .collect();
    let header = ["switch", "value", "default", "status", "effect"].map(String::from);
    let mut widths = [0usize; 4];
    for r in std::iter::once(&header).chain(rows.iter()) {
        for (w, c) in widths.iter_mut().zip(r.iter()) {
            *w = (*w).max(c.chars().count());
        }
    }
    let mut out = String::new();
    for r in std::iter::once(&header).chain(rows.iter()) {
        for (i, w) in widths.iter().enumerate() {
            out.push_str(&format!("{:<w$}  ", r[i], w = *w));
        }
        out.push_str(&r[4]);
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_prefixed() {
        let mut names: Vec<_> = ALL.iter().map(|s| s.name).collect();
        assert!(names.iter().all(|n| n.starts_with("FERRITE_")));
        names.sort();
        let n = names.len();
        names.dedup();
        assert_eq!(n, names.len(), "duplicate switch name");
    }

    #[test]
    fn flags_default_to_the_registry() {
        // Unset switches (these names are never set; spelled in halves so the registry scan
        // does not take them for real switches) read as their declared default.
        let on = Switch { name: concat!("FERRITE", "_TEST_UNSET_ON"), default: "1", effect: "", status: Status::AbTest };
        let off = Switch { name: concat!("FERRITE", "_TEST_UNSET_OFF"), default: "0", effect: "", status: Status::AbTest };
        assert!(on.flag() && !off.flag());
        // Every 0/1 switch's default parses as a flag.
        for s in ALL.iter().filter(|s| matches!(s.default, "0" | "1")) {
            assert_eq!(parse_flag(s.default), Some(s.default == "1"), "{}", s.name);
        }
    }

    #[test]
    fn table_lists_every_switch() {
        let t = table();
        for s in ALL {
            assert!(t.contains(s.name));
        }
    }
}
