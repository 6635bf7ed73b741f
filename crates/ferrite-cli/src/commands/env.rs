use anyhow::{bail, Result};
use clap::Args;

#[derive(Args)]
pub struct EnvArgs {
    /// Show one switch only.
    pub name: Option<String>,
}

pub fn run(args: EnvArgs) -> Result<()> {
    match args.name {
        None => print!("{}", ferrite_core::env::table()),
        Some(n) => match ferrite_core::env::find(&n) {
            Some(s) => println!(
                "{}\n  value:   {}\n  default: {}\n  status:  {}\n  effect:  {}",
                s.name,
                s.get().unwrap_or_else(|| "(unset)".into()),
                s.default,
                s.status,
                s.effect
            ),
            None => bail!("no switch named `{n}`; `ferrite env` lists them all"),
        },
    }
    Ok(())
}
