//! The kernel module cache: compiled CUBINs in memory (per [`crate::Gpu`]) and on disk.
//!
//! Key = blake3 over (format version, family, full source, NVRTC options — which hold the
//! sorted `-D` macro set and the `--gpu-architecture` —, NVRTC version). Every disk entry
//! carries a header with the full key, the payload length and the payload's blake3, so a
//! truncated or bit-flipped file is detected, deleted and rebuilt instead of being loaded.

use crate::compile::{compile_cubin, require_nvrtc};
use crate::error::{Context, CudaError};
use crate::kernels::KernelVariant;
use crate::timeline::{ModuleLabel, Timeline};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::Ptx;
use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Bumped whenever the key derivation or the entry layout changes.
const FORMAT_VERSION: u32 = 1;
const MAGIC: &[u8; 8] = b"FRTCUBIN";
/// magic + format version + key + payload length + payload hash.
const HEADER_LEN: usize = 8 + 4 + 32 + 8 + 32;

/// Identifies one compiled module: same key, same CUBIN.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CacheKey(pub [u8; 32]);

impl CacheKey {
    pub fn new(family: &str, source: &str, options: &[String], nvrtc_version: (i32, i32)) -> Self {
        let mut h = blake3::Hasher::new();
        let mut field = |bytes: &[u8]| {
            // Length-prefix every field so that no two field lists hash alike.
            h.update(&(bytes.len() as u64).to_le_bytes());
            h.update(bytes);
        };
        field(&FORMAT_VERSION.to_le_bytes());
        field(family.as_bytes());
        field(source.as_bytes());
        for opt in options {
            field(opt.as_bytes());
        }
        field(&nvrtc_version.0.to_le_bytes());
        field(&nvrtc_version.1.to_le_bytes());
        CacheKey(*h.finalize().as_bytes())
    }

    pub fn hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// Result of looking a key up on disk.
#[derive(Debug, PartialEq, Eq)]
pub enum DiskLookup {
    Hit(Vec<u8>),
    Missing,
    /// The entry existed but failed verification; it has been deleted.
    Corrupt(String),
}

/// CUBIN files under one folder, one file per key.
#[derive(Debug, Clone)]
pub struct DiskCache {
    dir: PathBuf,
}

impl DiskCache {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        DiskCache { dir: dir.into() }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn entry_path(&self, family: &str, key: &CacheKey) -> PathBuf {
        self.dir.join(format!("{family}-{}.cubin", key.hex()))
    }

    /// Read and verify an entry. A corrupt entry is removed so that the rebuild replaces it.
    pub fn load(&self, family: &str, key: &CacheKey) -> DiskLookup {
        let path = self.entry_path(family, key);
        let bytes = match fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return DiskLookup::Missing,
            Err(e) => return self.discard(&path, format!("unreadable: {e}")),
        };
        match verify(&bytes, key) {
            Ok(()) => DiskLookup::Hit(bytes[HEADER_LEN..].to_vec()),
            Err(reason) => self.discard(&path, reason),
        }
    }

    fn discard(&self, path: &Path, reason: String) -> DiskLookup {
        let _ = fs::remove_file(path);
        DiskLookup::Corrupt(format!("{}: {reason}", path.display()))
    }

    /// Remove an entry (used when a verified CUBIN still fails to load).
    pub fn remove(&self, family: &str, key: &CacheKey) {
        let _ = fs::remove_file(self.entry_path(family, key));
    }

    /// Write an entry atomically (temp file + rename), so readers never see half a file.
    pub fn store(&self, family: &str, key: &CacheKey, cubin: &[u8]) -> Result<(), CudaError> {
        let path = self.entry_path(family, key);
        let err = |message: String| CudaError::Cache { path: path.display().to_string(), message };
        fs::create_dir_all(&self.dir).map_err(|e| err(format!("cannot create folder: {e}")))?;
        // Unique per process and call, so concurrent writers of one key never share a temp file.
        static WRITES: AtomicU64 = AtomicU64::new(0);
        let n = WRITES.fetch_add(1, Ordering::Relaxed);
        let tmp = self.dir.join(format!(".{}.{}.{n}.tmp", key.hex(), std::process::id()));
        let write = || -> std::io::Result<()> {
            let mut f = fs::File::create(&tmp)?;
            f.write_all(MAGIC)?;
            f.write_all(&FORMAT_VERSION.to_le_bytes())?;
            f.write_all(&key.0)?;
            f.write_all(&(cubin.len() as u64).to_le_bytes())?;
            f.write_all(blake3::hash(cubin).as_bytes())?;
            f.write_all(cubin)?;
            f.sync_all()?;
            fs::rename(&tmp, &path)
        };
        write().map_err(|e| {
            let _ = fs::remove_file(&tmp);
            err(format!("cannot write: {e}"))
        })
    }
}

fn verify(bytes: &[u8], key: &CacheKey) -> Result<(), String> {
    if bytes.len() < HEADER_LEN {
        return Err(format!("truncated header ({} bytes)", bytes.len()));
    }
    if &bytes[..8] != MAGIC {
        return Err("bad magic".into());
    }
    if bytes[8..12] != FORMAT_VERSION.to_le_bytes() {
        return Err("old format version".into());
    }
    if bytes[12..44] != key.0 {
        return Err("key mismatch".into());
    }
    let len = u64::from_le_bytes(bytes[44..52].try_into().expect("8 bytes"));
    let payload = &bytes[HEADER_LEN..];
    if payload.len() as u64 != len {
        return Err(format!("payload is {} bytes, header says {len}", payload.len()));
    }
    if blake3::hash(payload).as_bytes() != &bytes[52..84] {
        return Err("checksum mismatch".into());
    }
    Ok(())
}

/// NVRTC flags for a variant: the target arch (`sm_90`, or `sm_90a` for an arch-specific
/// variant), then the sorted macro set.
pub(crate) fn nvrtc_options<V: KernelVariant>(variant: &V, arch: &str) -> Vec<String> {
    let mut macros = variant.macros();
    macros.sort();
    let suffix = if variant.arch_specific() { "a" } else { "" };
    let mut opts = vec![format!("--gpu-architecture={arch}{suffix}"), "-std=c++17".to_string()];
    opts.extend(macros.into_iter().map(|(name, value)| format!("-D{name}={value}")));
    opts
}

/// Compile a variant for `arch` (e.g. `sm_90`) with NVRTC alone, no device or cache involved:
/// ahead-of-time checks of the kernel sources. Returns the CUBIN.
pub fn compile_variant<V: KernelVariant>(variant: &V, arch: &str) -> Result<Vec<u8>, CudaError> {
    require_nvrtc()?;
    compile_cubin(V::FAMILY, &V::SOURCES.concat(), &nvrtc_options(variant, arch))
}

/// Counters of how modules were obtained (tests and diagnostics read them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub memory_hits: u64,
    pub disk_hits: u64,
    pub compiles: u64,
    pub corrupt_entries: u64,
}

#[derive(Default)]
struct Counters {
    memory_hits: AtomicU64,
    disk_hits: AtomicU64,
    compiles: AtomicU64,
    corrupt_entries: AtomicU64,
}

/// A module loaded into the context, with its entry points resolved once.
pub(crate) struct LoadedModule {
    functions: Vec<(&'static str, CudaFunction)>,
    _module: Arc<CudaModule>,
}

/// Resource use of one compiled kernel (from the driver), for diagnostics.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelInfo {
    pub name: &'static str,
    pub registers: i32,
    /// Local memory per thread: non-zero means register spills.
    pub local_bytes: i32,
    pub static_shared_bytes: i32,
}

impl LoadedModule {
    pub(crate) fn info(&self) -> Result<Vec<KernelInfo>, CudaError> {
        self.functions
            .iter()
            .map(|(name, f)| {
                let ctx = || format!("reading the attributes of kernel {name}");
                Ok(KernelInfo {
                    name,
                    registers: f.num_regs().context(ctx)?,
                    local_bytes: f.local_size_bytes().context(ctx)?,
                    static_shared_bytes: f.shared_size_bytes().context(ctx)?,
                })
            })
            .collect()
    }

    pub(crate) fn function(&self, name: &str) -> &CudaFunction {
        self.functions
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, f)| f)
            .unwrap_or_else(|| panic!("kernel `{name}` is not among the module's declared entry points"))
    }
}

/// Per-context cache of loaded modules, backed by the disk cache.
pub(crate) struct ModuleCache {
    ctx: Arc<CudaContext>,
    arch: String,
    nvrtc_version: (i32, i32),
    disk: Option<DiskCache>,
    /// TypeId of a variant type -> HashMap<Variant, Arc<LoadedModule>>.
    loaded: Mutex<HashMap<TypeId, Box<dyn Any + Send>>>,
    counters: Counters,
    /// `FERRITE_CUDA_TIMELINE`: every module is compiled with `TIMELINE=1` and attached to it.
    timeline: Option<Arc<Timeline>>,
}

impl ModuleCache {
    pub(crate) fn new(
        ctx: Arc<CudaContext>,
        arch: String,
        nvrtc_version: (i32, i32),
        disk: Option<DiskCache>,
        timeline: Option<Arc<Timeline>>,
    ) -> Self {
        ModuleCache { ctx, arch, nvrtc_version, disk, loaded: Mutex::default(), counters: Counters::default(), timeline }
    }

    pub(crate) fn timeline(&self) -> Option<&Timeline> {
        self.timeline.as_deref()
    }

    pub(crate) fn stats(&self) -> CacheStats {
        let c = &self.counters;
        CacheStats {
            memory_hits: c.memory_hits.load(Ordering::Relaxed),
            disk_hits: c.disk_hits.load(Ordering::Relaxed),
            compiles: c.compiles.load(Ordering::Relaxed),
            corrupt_entries: c.corrupt_entries.load(Ordering::Relaxed),
        }
    }

    pub(crate) fn disk(&self) -> Option<&DiskCache> {
        self.disk.as_ref()
    }

    /// The variant's NVRTC flags, plus the device-wide `TIMELINE=1` (common header) when the
    /// timeline records: part of the cache key like every other flag.
    pub(crate) fn options<V: KernelVariant>(&self, variant: &V) -> Vec<String> {
        let mut options = nvrtc_options(variant, &self.arch);
        if self.timeline.is_some() {
            options.push("-DTIMELINE=1".to_string());
        }
        options
    }

    pub(crate) fn key<V: KernelVariant>(&self, variant: &V) -> CacheKey {
        CacheKey::new(V::FAMILY, &V::SOURCES.concat(), &self.options(variant), self.nvrtc_version)
    }

    /// The module of `variant`, compiling it (or reading it from disk) on first use.
    /// The lock is not held while compiling, so different variants build in parallel; two
    /// threads racing on the same variant both build it and the first insert wins.
    pub(crate) fn get<V: KernelVariant>(&self, variant: &V) -> Result<Arc<LoadedModule>, CudaError> {
        if let Some(module) = self.with_map::<V, _>(|map| map.get(variant).cloned()) {
            self.counters.memory_hits.fetch_add(1, Ordering::Relaxed);
            return Ok(module);
        }
        let built = Arc::new(self.build(variant)?);
        Ok(self.with_map::<V, _>(|map| map.entry(*variant).or_insert(built).clone()))
    }

    fn with_map<V: KernelVariant, R>(&self, f: impl FnOnce(&mut HashMap<V, Arc<LoadedModule>>) -> R) -> R {
        let mut loaded = self.loaded.lock().unwrap_or_else(|p| p.into_inner());
        let map = loaded
            .entry(TypeId::of::<V>())
            .or_insert_with(|| Box::new(HashMap::<V, Arc<LoadedModule>>::new()))
            .downcast_mut::<HashMap<V, Arc<LoadedModule>>>()
            .expect("the map is keyed by the variant's TypeId");
        f(map)
    }

    fn build<V: KernelVariant>(&self, variant: &V) -> Result<LoadedModule, CudaError> {
        let source = V::SOURCES.concat();
        let options = self.options(variant);
        let key = CacheKey::new(V::FAMILY, &source, &options, self.nvrtc_version);
        if let Some(disk) = &self.disk {
            match disk.load(V::FAMILY, &key) {
                DiskLookup::Hit(cubin) => match self.load(variant, cubin) {
                    Ok(module) => {
                        self.counters.disk_hits.fetch_add(1, Ordering::Relaxed);
                        return Ok(module);
                    }
                    Err(e) => {
                        disk.remove(V::FAMILY, &key);
                        self.corrupt(&format!("{} does not load: {e}", disk.entry_path(V::FAMILY, &key).display()));
                    }
                },
                DiskLookup::Corrupt(reason) => self.corrupt(&reason),
                DiskLookup::Missing => {}
            }
        }
        let cubin = compile_cubin(V::FAMILY, &source, &options)?;
        self.counters.compiles.fetch_add(1, Ordering::Relaxed);
        if let Some(disk) = &self.disk {
            // A read-only or full cache folder costs recompiles, never a failed run.
            if let Err(e) = disk.store(V::FAMILY, &key, &cubin) {
                eprintln!("warning: {e}");
            }
        }
        self.load(variant, cubin)
    }

    fn corrupt(&self, reason: &str) {
        self.counters.corrupt_entries.fetch_add(1, Ordering::Relaxed);
        eprintln!("warning: corrupt kernel cache entry {reason}; rebuilding it");
    }

    fn load<V: KernelVariant>(&self, variant: &V, cubin: Vec<u8>) -> Result<LoadedModule, CudaError> {
        let module = self
            .ctx
            .load_module(Ptx::from_binary(cubin))
            .context(|| format!("loading the CUBIN of kernel family {}", V::FAMILY))?;
        if let Some(timeline) = &self.timeline {
            let mut macros: Vec<(String, String)> = variant.macros().into_iter().map(|(k, v)| (k.to_string(), v)).collect();
            macros.sort();
            // A diagnostic: a module it cannot attach to still runs, unrecorded.
            if let Err(e) = timeline.attach(&module, ModuleLabel { family: V::FAMILY, macros }) {
                eprintln!("warning: kernel timeline: {e}");
            }
        }
        let functions = V::ENTRY_POINTS
            .iter()
            .map(|&name| {
                module
                    .load_function(name)
                    .context(|| format!("finding kernel `{name}` in family {}", V::FAMILY))
                    .map(|f| (name, f))
            })
            .collect::<Result<_, _>>()?;
        Ok(LoadedModule { functions, _module: module })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("ferrite-cache-test-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        dir
    }

    fn key(opts: &[&str]) -> CacheKey {
        let opts: Vec<String> = opts.iter().map(|s| s.to_string()).collect();
        CacheKey::new("gemv", "src", &opts, (13, 0))
    }

    #[test]
    fn key_changes_with_every_input() {
        let base = key(&["--gpu-architecture=sm_90", "-DNTOK=1"]);
        assert_eq!(base, key(&["--gpu-architecture=sm_90", "-DNTOK=1"]));
        assert_ne!(base, key(&["--gpu-architecture=sm_90", "-DNTOK=2"]));
        assert_ne!(base, key(&["--gpu-architecture=sm_89", "-DNTOK=1"]));
        let opts = vec!["--gpu-architecture=sm_90".to_string(), "-DNTOK=1".to_string()];
        assert_ne!(base, CacheKey::new("gemv", "src2", &opts, (13, 0)));
        assert_ne!(base, CacheKey::new("gemv", "src", &opts, (13, 1)));
        assert_ne!(base, CacheKey::new("norm", "src", &opts, (13, 0)));
        // Field boundaries matter: moving text between fields changes the key.
        assert_ne!(key(&["-DA=1", "-DB=2"]), key(&["-DA=1-DB=2"]));
    }

    #[test]
    fn store_then_load_round_trips() {
        let disk = DiskCache::new(temp_dir("roundtrip"));
        let k = key(&["x"]);
        assert_eq!(disk.load("gemv", &k), DiskLookup::Missing);
        disk.store("gemv", &k, b"cubin bytes").unwrap();
        assert_eq!(disk.load("gemv", &k), DiskLookup::Hit(b"cubin bytes".to_vec()));
        let _ = fs::remove_dir_all(disk.dir());
    }

    #[test]
    fn corrupt_entries_are_detected_and_deleted() {
        let disk = DiskCache::new(temp_dir("corrupt"));
        let k = key(&["y"]);
        let payload: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
        let path = disk.entry_path("gemv", &k);
        type Damage = fn(&mut Vec<u8>);
        let damages: [(&str, Damage); 5] = [
            ("truncated payload", |b| b.truncate(b.len() - 10)),
            ("truncated header", |b| b.truncate(20)),
            ("flipped payload bit", |b| b[HEADER_LEN + 500] ^= 0x10),
            ("flipped hash bit", |b| b[60] ^= 1),
            ("appended garbage", |b| b.extend_from_slice(b"junk")),
        ];
        for (what, damage) in damages {
            disk.store("gemv", &k, &payload).unwrap();
            let mut bytes = fs::read(&path).unwrap();
            damage(&mut bytes);
            fs::write(&path, &bytes).unwrap();
            assert!(matches!(disk.load("gemv", &k), DiskLookup::Corrupt(_)), "{what} not detected");
            assert!(!path.exists(), "{what}: corrupt entry was not deleted");
        }
        // An entry stored under another key is not accepted for this one.
        let other = key(&["z"]);
        disk.store("gemv", &other, &payload).unwrap();
        fs::copy(disk.entry_path("gemv", &other), &path).unwrap();
        assert!(matches!(disk.load("gemv", &k), DiskLookup::Corrupt(r) if r.contains("key mismatch")));
        let _ = fs::remove_dir_all(disk.dir());
    }
}
