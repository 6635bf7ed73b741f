//! The engine: sessions over a backend executor, sampling, generation and benchmarking.

pub mod backend;
pub mod bench;
pub mod sampling;
pub mod session;

pub use backend::{open_executor, BackendKind};
pub use sampling::{Sampler, SamplerParams};
pub use session::{GenStats, Session, StopReason};
