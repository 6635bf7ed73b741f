use thiserror::Error;

#[derive(Debug, Error)]
pub enum ModelError {
    #[error(transparent)]
    Gguf(#[from] ferrite_gguf::GgufError),
    #[error("unsupported model architecture `{0}` (supported: {1})")]
    UnsupportedArch(String, &'static str),
    #[error("invalid model config: {0}")]
    Config(String),
    #[error("tensor `{name}`: {msg}")]
    Tensor { name: String, msg: String },
    #[error("missing tensor `{0}`")]
    MissingTensor(String),
    #[error("tensor parallelism over {ranks} ranks: {msg}")]
    Shard { ranks: usize, msg: String },
}

impl ModelError {
    pub fn tensor(name: &str, msg: impl Into<String>) -> Self {
        Self::Tensor { name: name.to_string(), msg: msg.into() }
    }
}
