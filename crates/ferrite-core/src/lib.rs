//! Shared pieces every ferrite crate may use. Today that is the env-switch registry:
//! every `FERRITE_*` variable the project reads is declared in [`env`], nowhere else.

pub mod env;
