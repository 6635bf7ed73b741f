//! One module per subcommand; `common` holds the model/backend options they share.

pub mod bench;
pub mod chat;
pub mod common;
pub mod compare;
pub mod env;
pub mod info;
pub mod run;
pub mod serve;
pub mod synth;
