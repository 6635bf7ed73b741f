use super::common::{load_model, ModelArgs};
use anyhow::Result;
use clap::Args;
use ferrite_gguf::Value;

#[derive(Args)]
pub struct InfoArgs {
    /// Also list every tensor.
    #[arg(long)]
    pub tensors: bool,
    /// The backend given by --backend is instantiated to report its memory use.
    #[command(flatten)]
    pub model: ModelArgs,
}

fn show(v: &Value) -> String {
    match v {
        Value::Array(a) if a.len() > 8 => format!("[{} items: {}, ...]", a.len(), a.iter().take(4).map(show).collect::<Vec<_>>().join(", ")),
        Value::Array(a) => format!("[{}]", a.iter().map(show).collect::<Vec<_>>().join(", ")),
        Value::String(s) if s.len() > 120 => format!("{:?}... ({} bytes)", &s[..s.floor_char_boundary(100)], s.len()),
        Value::String(s) => format!("{s:?}"),
        other => format!("{other:?}").split(['(', ')']).nth(1).unwrap_or("").to_string(),
    }
}

pub fn run(args: InfoArgs) -> Result<()> {
    let loaded = load_model(&args.model)?;
    let m = &loaded.model;
    println!("file: GGUF v{}, {} tensors, {:.1} MiB", m.file.version, m.file.tensors.len(), m.file.file_size() as f64 / 1048576.0);
    println!("\nmetadata:");
    for (k, v) in m.file.metadata.iter() {
        println!("  {k} = {}", show(v));
    }
    let c = &m.config;
    println!("\nconfig: {c:#?}");
    let mut by_type = std::collections::BTreeMap::<String, (usize, usize)>::new();
    for t in &m.file.tensors {
        let e = by_type.entry(t.dtype.name().to_string()).or_default();
        e.0 += 1;
        e.1 += t.n_bytes;
    }
    println!("\ntensor types:");
    for (ty, (n, bytes)) in by_type {
        println!("  {ty:6} {n:5} tensors  {:8.1} MiB", bytes as f64 / 1048576.0);
    }
    if args.tensors {
        println!("\ntensors:");
        for t in &m.file.tensors {
            println!("  {:40} {:6} {:?}", t.name, t.dtype.name(), t.shape);
        }
    }
    println!("\ngraph: {} ops, {} values, {} weights", m.graph.ops.len(), m.graph.values.len(), m.weights.used_by(&m.graph).len());
    let mut session = loaded.session(&args.model, args.model.backend, false)?;
    println!("\nmemory ({}):\n{}", args.model.backend, session.executor().memory_report());
    Ok(())
}
