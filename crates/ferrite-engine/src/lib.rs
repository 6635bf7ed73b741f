//! The engine: sessions over a backend executor, sampling, generation and benchmarking, and the
//! continuous-batching scheduler over a paged KV cache for serving.

pub mod backend;
pub mod bench;
pub mod kv_pages;
pub mod metrics;
pub mod sampling;
pub mod scheduler;
pub mod session;
pub mod state_snapshots;

pub use backend::{open_executor, BackendKind};
pub use sampling::{Sampler, SamplerParams};
pub use scheduler::{EngineConfig, EngineHandle, FinishReason, GenEvent, GenRequest, SubmitError, TokenLogprob, Usage};
pub use session::{GenStats, Session, StopReason};
