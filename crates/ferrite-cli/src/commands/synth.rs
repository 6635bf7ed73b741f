use anyhow::{anyhow, Result};
use clap::Args;
use ferrite_gguf::GgmlType;
use ferrite_model::synth;
use std::path::PathBuf;

#[derive(Args)]
pub struct SynthArgs {
    /// Model shape (the real model's tensor shapes).
    #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(synth::SHAPES.iter().map(|s| s.name)))]
    pub shape: String,
    /// Weight type of the matrices: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, F16, BF16, F32.
    #[arg(long, default_value = "Q4_0")]
    pub dtype: String,
    /// Output file.
    #[arg(short, long)]
    pub output: PathBuf,
    /// Seed of the random weights.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

pub fn run(args: SynthArgs) -> Result<()> {
    let shape = synth::shape(&args.shape).ok_or_else(|| anyhow!("unknown shape `{}`", args.shape))?;
    let dtype = GgmlType::from_name(&args.dtype).ok_or_else(|| anyhow!("unknown dtype `{}`", args.dtype))?;
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(indicatif::ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} tensors {elapsed}").unwrap());
    bar.set_message(format!("writing {}", args.output.display()));
    synth::write(&args.output, shape, dtype, args.seed, |done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    })?;
    bar.finish();
    let size = std::fs::metadata(&args.output)?.len();
    eprintln!("wrote {} ({:.1} MiB): {} {} random weights", args.output.display(), size as f64 / 1048576.0, shape.name, dtype);
    Ok(())
}
