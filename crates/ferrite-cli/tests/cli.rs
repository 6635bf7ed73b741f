//! The `ferrite` binary end to end: real generation, and clear errors (never a panic) on bad input.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn model() -> PathBuf {
    let p = root().join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(p.is_file(), "{} is missing: run scripts/fetch-model.sh", p.display());
    p
}

fn ferrite(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ferrite")).args(args).env("FERRITE_THREADS", "2").output().unwrap()
}

fn text(o: &Output) -> (String, String) {
    (String::from_utf8_lossy(&o.stdout).into_owned(), String::from_utf8_lossy(&o.stderr).into_owned())
}

/// Failed cleanly: non-zero exit, a message containing `needle`, and no panic.
fn assert_clean_error(o: &Output, needle: &str) {
    let (out, err) = text(o);
    assert!(!o.status.success(), "expected failure; stdout: {out}");
    assert!(!err.contains("panicked"), "panic: {err}");
    assert!(err.to_lowercase().contains(&needle.to_lowercase()), "expected `{needle}` in: {err}");
}

fn temp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferrite-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

#[test]
fn run_generates_a_sensible_greedy_continuation() {
    let m = model();
    let o = ferrite(&["run", "The capital of France is", "-n", "8", "--temp", "0", "--model", m.to_str().unwrap()]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    assert!(out.starts_with("The capital of France is Paris"), "{out}");
    assert!(err.contains("tok/s"), "{err}");
}

#[test]
fn chat_reads_stdin_and_answers() {
    let m = model();
    let mut child = Command::new(env!("CARGO_BIN_EXE_ferrite"))
        .args(["chat", "--temp", "0", "-n", "16", "--model", m.to_str().unwrap()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(b"What is 2+2? Answer briefly.\n").unwrap();
    let o = child.wait_with_output().unwrap();
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    assert!(out.contains('4'), "answer: {out}");
}

/// A conversation outgrowing the context drops its oldest exchanges and goes on; a message that
/// cannot fit on its own is refused with a clear line, and the chat continues.
#[test]
fn chat_drops_old_exchanges_to_fit_the_context() {
    let m = model();
    let mut child = Command::new(env!("CARGO_BIN_EXE_ferrite"))
        .args(["chat", "--temp", "0", "-n", "40", "-c", "128", "--model", m.to_str().unwrap()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let long = "word ".repeat(200);
    let input = format!("Hello there, how are you today?\nTell me a long story about dragons please.\n{long}\nWhat is 2+2?\n");
    child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    let o = child.wait_with_output().unwrap();
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("oldest exchange(s) were dropped"), "{err}");
    assert!(err.contains("does not fit the context"), "{err}");
    // Three replies' statistics: the refused message produced none.
    assert_eq!(err.matches(" tok/s]").count(), 3, "{err}\n{out}");
}

#[test]
fn truncated_and_corrupt_files_give_clear_errors() {
    let bytes = std::fs::read(model()).unwrap();
    let cut = temp("truncated.gguf");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let o = ferrite(&["run", "x", "--model", cut.to_str().unwrap()]);
    assert_clean_error(&o, "truncated.gguf");
    // Said once: the file's error is not repeated by the error chain.
    assert_eq!(text(&o).1.matches("runs past the end").count(), 1, "{}", text(&o).1);
    let garbage = temp("garbage.gguf");
    std::fs::write(&garbage, b"this is not a gguf file at all").unwrap();
    assert_clean_error(&ferrite(&["info", "--model", garbage.to_str().unwrap()]), "garbage.gguf");
    assert_clean_error(&ferrite(&["run", "x", "--model", "/no/such/model.gguf"]), "does not exist");
    // A safetensors folder without a tokenizer: generation says so; bench works without one.
    let hf = root().join("fixtures/tiny/qwen3-hf");
    assert_clean_error(&ferrite(&["run", "x", "--model", hf.to_str().unwrap()]), "no usable tokenizer");
    let o = ferrite(&["bench", "-p", "8", "-n", "4", "-r", "1", "--seqs", "3", "--model", hf.to_str().unwrap()]);
    assert!(o.status.success() && text(&o).0.contains("tg4") && text(&o).0.contains("tg4 x3"), "{:?}", text(&o));
    // With an x86 SIMD level, the CPU's ceilings are measured and each test set against one.
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        let out = text(&o).0;
        assert!(out.contains("ceilings measured in this run: read of") && out.contains("% of the matrix rate") && out.contains("% of the bandwidth"), "{out}");
    }
    assert_clean_error(&ferrite(&["bench", "--seqs", "0", "--model", hf.to_str().unwrap()]), "--seqs");
    assert_clean_error(&ferrite(&["bench", "--seqs", "2", "--top-p", "1.5", "--model", hf.to_str().unwrap()]), "top-p must be in (0, 1]");
    assert_clean_error(&ferrite(&["bench", "--seqs", "2", "--seq-temp=-1", "--model", hf.to_str().unwrap()]), "temperature must be >= 0");
    // Sampled draws (the old --seq-* names still accepted) name their tests so, batch 1 too.
    let o = ferrite(&["bench", "-p", "0", "-n", "4", "-r", "1", "--seqs", "2", "--temp", "0.8", "--seq-top-k", "40", "--min-p", "0.05", "--model", hf.to_str().unwrap()]);
    assert!(o.status.success() && text(&o).0.contains("| tg4 sampled |") && text(&o).0.contains("| tg4 x2 sampled | tg4 sampled |"), "{:?}", text(&o));
    assert_clean_error(&ferrite(&["bench", "-p", "0", "-n", "0", "--model", hf.to_str().unwrap()]), "nothing to measure");
    // At a depth (llama-bench's --n-depth): the tests say so and the context grows to fit.
    let o = ferrite(&["bench", "-p", "8", "-n", "4", "-d", "0,40", "-r", "1", "--model", hf.to_str().unwrap()]);
    let out = text(&o).0;
    assert!(o.status.success() && out.contains("| pp8 |") && out.contains("pp8 @ d40") && out.contains("tg4 @ d40"), "{:?}", text(&o));
    let o = ferrite(&["compare", "--backend", "cpu", "--ids", "1,2,3", "--steps", "4", "--model", hf.to_str().unwrap()]);
    assert!(o.status.success() && text(&o).0.contains("greedy tokens agree"), "{:?}", text(&o));
    assert_clean_error(&ferrite(&["compare", "--ids", "1,999999", "--backend", "cpu", "--model", hf.to_str().unwrap()]), "outside the vocabulary");
}

/// A safetensors folder with tokenizer.json and tokenizer_config.json (the tiny Gemma 3): `run`
/// tokenizes, generates and decodes with them, `--chat` uses the config's chat template.
#[test]
fn hf_folder_with_tokenizer_json_runs() {
    let hf = root().join("fixtures/tiny/gemma3-hf");
    let hf = hf.to_str().unwrap();
    let o = ferrite(&["run", "--model", hf, "--temp", "0", "-n", "6", "Hello world"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    assert!(out.starts_with("Hello world") && out.len() > "Hello world".len(), "{out}");
    assert!(err.contains("generated: 6 tokens"), "{err}");
    let o = ferrite(&["run", "--model", hf, "--chat", "--temp", "0", "-n", "4", "Hi"]);
    assert!(o.status.success(), "{:?}", text(&o));
}

#[test]
fn unknown_architecture_is_named() {
    let mut w = ferrite_gguf::GgufWriter::new();
    w.add_metadata("general.architecture", ferrite_gguf::Value::String("mamba99".into()));
    let p = temp("mamba.gguf");
    w.write_file(&p).unwrap();
    assert_clean_error(&ferrite(&["run", "x", "--model", p.to_str().unwrap()]), "unsupported model architecture `mamba99`");
}

#[test]
fn bad_arguments_are_rejected() {
    let m = model();
    let m = m.to_str().unwrap();
    assert_clean_error(&ferrite(&["run", "x", "--temp=-1", "--model", m]), "temperature");
    assert_clean_error(&ferrite(&["run", "x", "--top-p", "0", "--model", m]), "top-p");
    assert_clean_error(&ferrite(&["run", "x", "--backend", "tpu", "--model", m]), "unknown backend");
    assert_clean_error(&ferrite(&["bench", "-r", "0", "--model", m]), "repetitions");
    assert_clean_error(&ferrite(&["synth", "--shape", "gpt-5", "-o", "/tmp/x.gguf"]), "possible values: smollm2-135m");
    // Spelled in two halves so the registry-completeness scan does not take it for a real switch.
    assert_clean_error(&ferrite(&["env", concat!("FERRITE", "_NOPE")]), "no switch");
}

#[test]
fn oversized_prompt_is_refused() {
    let m = model();
    let long = "word ".repeat(100);
    assert_clean_error(&ferrite(&["run", &long, "--ctx-size", "16", "--model", m.to_str().unwrap()]), "context");
}

#[test]
fn cuda_backend_without_a_gpu_says_so() {
    if ferrite_cuda::cuda_available().is_ok() {
        println!("skipped: a CUDA device is present");
        return;
    }
    let m = model();
    assert_clean_error(&ferrite(&["run", "x", "-n", "1", "--backend", "cuda", "--model", m.to_str().unwrap()]), "no CUDA device");
}

#[test]
fn env_lists_the_registry() {
    let o = ferrite(&["env"]);
    let (out, _) = text(&o);
    assert!(o.status.success());
    for s in ferrite_core::env::ALL {
        assert!(out.contains(s.name), "{} missing from `ferrite env`", s.name);
    }
}

/// One HTTP/1.1 request over a plain socket; returns the whole response (the server closes it).
fn http(port: u16, method: &str, path: &str, body: &str) -> String {
    use std::io::Read;
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(s, "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

/// `ferrite serve` as a process: it reports its port, answers, and on SIGTERM finishes the
/// streamed request in flight before exiting with status 0.
#[cfg(unix)]
#[test]
fn serve_answers_and_drains_on_sigterm() {
    use std::io::BufRead;
    let m = model();
    /// Kills the server if the test fails before it exits.
    struct Guard(std::process::Child);
    impl Drop for Guard {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut child = Guard(
        Command::new(env!("CARGO_BIN_EXE_ferrite"))
            .args(["serve", "--port", "0", "--kv-memory", "64MiB", "--ctx-size", "512", "--model", m.to_str().unwrap()])
            .env("FERRITE_THREADS", "2")
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut lines = std::io::BufReader::new(child.0.stderr.take().unwrap()).lines();
    let port: u16 = loop {
        let line = lines.next().expect("serve exited before listening").unwrap();
        if let Some(rest) = line.split("http://127.0.0.1:").nth(1) {
            break rest.split(|c: char| !c.is_ascii_digit()).next().unwrap().parse().unwrap();
        }
    };
    let health = http(port, "GET", "/health", "");
    assert!(health.starts_with("HTTP/1.1 200"), "{health}");
    let bad = http(port, "POST", "/v1/completions", "{\"prompt\": \"x\",");
    assert!(bad.starts_with("HTTP/1.1 400") && bad.contains("malformed JSON"), "{bad}");
    let streamer = std::thread::spawn(move || {
        http(port, "POST", "/v1/completions", r#"{"prompt": "Once upon a time", "max_tokens": 200, "temperature": 0, "ignore_eos": true, "stream": true}"#)
    });
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert!(Command::new("kill").args(["-TERM", &child.0.id().to_string()]).status().unwrap().success());
    let streamed = streamer.join().unwrap();
    assert!(streamed.contains("\"finish_reason\":\"length\"") && streamed.contains("data: [DONE]"), "stream cut short: {streamed}");
    let status = child.0.wait().unwrap();
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    assert!(status.success(), "serve exited with {status}: {rest:?}");
    assert!(rest.iter().any(|l| l.contains("all requests finished")), "{rest:?}");
}

/// A Qwen3.5 hybrid (synthetic weights, SmolLM2's tokenizer) through `run` (CPU backends, and
/// CUDA where there is a GPU) and a two-turn `chat`: the second turn continues the recurrent
/// state (the session reuses the whole cache) and the generation loop works with recurrent layers.
#[test]
fn qwen35_hybrid_runs_and_chats() {
    use ferrite_model::synth::{self, SynthGdn, SynthShape};
    let gdn = Some(SynthGdn { n_k_heads: 2, n_v_heads: 4, k_dim: 32, v_dim: 32 });
    let s = SynthShape { name: "cli-qwen35", arch: "qwen35", n_layers: 4, n_embd: 128, n_heads: 4, n_kv_heads: 2, head_dim: 64, n_ff: 256, rope_theta: 1e7, context_length: 512, tied_embeddings: false, gdn, moe: None };
    let path = synth::write_temp(&s, ferrite_gguf::GgmlType::Q8_0, 6).unwrap();
    let m = path.to_str().unwrap();
    for backend in ["cpu", "cpu-ref"] {
        let o = ferrite(&["run", "--temp", "0", "-n", "8", "--backend", backend, "--model", m, "Hello there"]);
        let (_, err) = text(&o);
        assert!(o.status.success(), "{backend}: {err}");
    }
    let mut child = Command::new(env!("CARGO_BIN_EXE_ferrite"))
        .args(["chat", "--temp", "0", "-n", "6", "--model", m])
        .env("FERRITE_THREADS", "2")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(b"Hi\nAnd again?\n").unwrap();
    let o = child.wait_with_output().unwrap();
    let (_, err) = text(&o);
    assert!(o.status.success(), "{err}");
    assert!(!err.contains("cannot be rewound"), "{err}");
    // CUDA runs it too, or says there is no device.
    let o = ferrite(&["run", "--temp", "0", "-n", "8", "--backend", "cuda", "--model", m, "Hello there"]);
    if ferrite_cuda::cuda_available().is_ok() {
        assert!(o.status.success(), "cuda: {}", text(&o).1);
    } else {
        assert_clean_error(&o, "no CUDA device");
    }
}
