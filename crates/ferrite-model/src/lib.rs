//! The model layer: what a model *is*, independent of where it runs.
//!
//! A GGUF file is turned into a [`ModelConfig`] (hyper-parameters), a [`WeightSet`] (named weights,
//! with fused weights declared at load time) and a [`Graph`] (an op list over activation values).
//! The [`planner`] assigns buffers to values; backends implement [`Executor`] and run the graph.

pub mod arch;
pub mod collective;
pub mod config;
pub mod error;
pub mod executor;
pub mod fusion;
pub mod graph;
pub mod hf;
pub mod planner;
pub mod profile;
pub mod shard;
pub mod synth;
pub mod weights;

pub use collective::{Collective, RankThreads};
pub use config::{Arch, ModelConfig, MoeConfig, RopeConfig, RopeStyle};
pub use error::ModelError;
pub use executor::{argmax, AheadSeq, BatchRows, DeviceSampling, Executor, ExecutorOptions, HardwareCeilings, LayerTrace, LoadProgress, PagedKvConfig, PagedOutput, RecurrentCursor, SeqChunk};
pub use fusion::FusionOptions;
pub use graph::{Graph, Op, ValueId, WeightId};
pub use weights::{WeightPart, WeightSet, WeightSpec};

/// Everything needed to instantiate a backend: the parsed file, its config, weights and graph.
pub struct Model {
    /// Shared by the ranks of a tensor-parallel model, whose weights are slices of its tensors.
    pub file: std::sync::Arc<ferrite_gguf::GgufFile>,
    pub config: ModelConfig,
    pub weights: WeightSet,
    pub graph: Graph,
}

impl Model {
    /// Bytes of the linears' weights (GGUF sizes): what a one-token step must read once.
    pub fn linear_weight_bytes(&self) -> usize {
        self.graph
            .ops
            .iter()
            .filter_map(|op| match op {
                Op::Linear { w, .. } | Op::GatedLinear { w, .. } => Some(self.weights.spec(*w)),
                _ => None,
            })
            .map(|spec| spec.rows * spec.dtype.row_bytes(spec.cols).unwrap_or(0))
            .sum()
    }

    /// Open a model — a GGUF file, or a Hugging Face folder (`config.json` + safetensors) — read
    /// its config and build its graph with the given fusion choices.
    pub fn load(path: impl AsRef<std::path::Path>, fusion: FusionOptions) -> Result<Self, ModelError> {
        let path = path.as_ref();
        let file = if hf::is_hf_dir(path) { hf::load_hf_dir(path)? } else { ferrite_gguf::GgufFile::open(path)? };
        Self::from_file(file, fusion)
    }

    pub fn from_file(file: ferrite_gguf::GgufFile, fusion: FusionOptions) -> Result<Self, ModelError> {
        let config = ModelConfig::from_gguf(&file)?;
        let (weights, graph) = arch::build(&config, &file, fusion)?;
        Ok(Self { file: std::sync::Arc::new(file), config, weights, graph })
    }
}
