//! `ferrite`: command-line front end.

mod commands;
mod model_path;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "ferrite", version, about = "Fast, checked LLM inference: GGUF models on CPU and CUDA")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a continuation of a prompt, streamed to stdout.
    Run(commands::run::RunArgs),
    /// Interactive chat using the model's chat template.
    Chat(commands::chat::ChatArgs),
    /// Show model metadata, config and tensors.
    Info(commands::info::InfoArgs),
    /// Measure prompt processing (pp) and token generation (tg) speed.
    Bench(commands::bench::BenchArgs),
    /// Compare two backends layer by layer on one prompt.
    Compare(commands::compare::CompareArgs),
    /// Serve the model over an OpenAI-compatible HTTP API (continuous batching, paged KV cache).
    Serve(commands::serve::ServeArgs),
    /// Write a GGUF with the tensor shapes of a real model and random weights.
    Synth(commands::synth::SynthArgs),
    /// List the FERRITE_* environment switches.
    Env(commands::env::EnvArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(a) => commands::run::run(a),
        Command::Chat(a) => commands::chat::run(a),
        Command::Info(a) => commands::info::run(a),
        Command::Bench(a) => commands::bench::run(a),
        Command::Compare(a) => commands::compare::run(a),
        Command::Serve(a) => commands::serve::run(a),
        Command::Synth(a) => commands::synth::run(a),
        Command::Env(a) => commands::env::run(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
