//! `ferrite serve` over real HTTP: a server on 127.0.0.1 (port 0) inside the test, with the real
//! SmolLM2 model, and reqwest as the client.

use ferrite_engine::{BackendKind, EngineConfig, SamplerParams, Session};
use ferrite_model::{ExecutorOptions, FusionOptions, Model};
use ferrite_server::ServeOptions;
use ferrite_tokenizer::Tokenizer;
use futures_util::StreamExt;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn model_path() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(p.is_file(), "{} is missing: run scripts/fetch-model.sh first", p.display());
    p
}

fn model() -> Arc<Model> {
    Arc::new(Model::load(model_path(), FusionOptions::ALL).unwrap())
}

fn exec_options() -> ExecutorOptions {
    ExecutorOptions { max_batch: 64, context_len: 512, trace: false, progress: None }
}

fn engine_config() -> EngineConfig {
    EngineConfig { block_size: 16, n_blocks: 256, max_seqs: 8, max_batch_tokens: 64, max_queue: 64, max_context: 512, prefix_cache: true, state_snapshots: 0, snapshot_stride: 0 }
}

struct Server {
    base: String,
    client: reqwest::Client,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    done: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
    key: Option<String>,
}

async fn start_with(engine: EngineConfig, api_key: Option<&str>) -> Server {
    let opts = ServeOptions {
        backend: BackendKind::Cpu,
        executor: exec_options(),
        engine,
        api_key: api_key.map(str::to_string),
        model_id: "smollm2".into(),
    };
    let (state, _thread) = ferrite_server::start_engine(model(), &opts).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let done = tokio::spawn(ferrite_server::serve(listener, Arc::new(state), async {
        let _ = rx.await;
    }));
    Server { base, client: reqwest::Client::new(), shutdown: Some(tx), done: Some(done), key: api_key.map(str::to_string) }
}

async fn start() -> Server {
    start_with(engine_config(), None).await
}

impl Server {
    fn post(&self, path: &str) -> reqwest::RequestBuilder {
        let r = self.client.post(format!("{}{path}", self.base));
        match &self.key {
            Some(k) => r.bearer_auth(k),
            None => r,
        }
    }

    async fn json(&self, path: &str, body: Value) -> (u16, Value) {
        let r = self.post(path).json(&body).send().await.unwrap();
        let status = r.status().as_u16();
        (status, r.json().await.unwrap())
    }

    /// The `data:` payloads of an SSE response, up to and including `[DONE]`.
    async fn stream(&self, path: &str, body: Value) -> Vec<String> {
        let r = self.post(path).json(&body).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 200);
        assert!(r.headers()["content-type"].to_str().unwrap().starts_with("text/event-stream"));
        let text = r.text().await.unwrap();
        let events: Vec<String> = text.split("\n\n").filter(|e| !e.trim().is_empty()).map(|e| e.strip_prefix("data: ").unwrap_or_else(|| panic!("not a data event: {e:?}")).to_string()).collect();
        assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "stream does not end with [DONE]");
        events
    }

    async fn metrics(&self) -> String {
        self.client.get(format!("{}/metrics", self.base)).send().await.unwrap().text().await.unwrap()
    }

    async fn metric(&self, name: &str) -> f64 {
        let m = self.metrics().await;
        m.lines().find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' '))).unwrap_or_else(|| panic!("no metric {name}")).parse().unwrap()
    }

    /// Wait until no sequence runs and no KV block is referenced.
    async fn wait_idle(&self) {
        let t = Instant::now();
        loop {
            let idle = self.metric("ferrite_running_sequences").await == 0.0 && self.metric("ferrite_kv_blocks_in_use").await == 0.0 && self.metric("ferrite_queue_depth").await == 0.0;
            if idle {
                return;
            }
            assert!(t.elapsed() < Duration::from_secs(30), "engine not idle:\n{}", self.metrics().await);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn stop(mut self) {
        let _ = self.shutdown.take().unwrap().send(());
        tokio::time::timeout(Duration::from_secs(30), self.done.take().unwrap()).await.expect("server did not shut down").unwrap().unwrap();
    }
}

/// `Session::generate` greedy on the same prompt ids, decoded.
fn reference(ids: &[u32], max_tokens: usize) -> String {
    let model = model();
    let tok = Tokenizer::from_gguf(&model.file.metadata).unwrap();
    let exec = ferrite_engine::open_executor(Arc::clone(&model), BackendKind::Cpu, exec_options()).unwrap();
    let mut s = Session::new(exec);
    let mut out = vec![];
    s.generate(ids, max_tokens, &SamplerParams::greedy(), |t| tok.is_end_of_generation(t), |t| {
        out.push(t);
        true
    })
    .unwrap();
    tok.decode(&out)
}

fn chunks(events: &[String]) -> Vec<Value> {
    events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_over_http_equals_session_generate() {
    let s = start().await;
    let tok = Tokenizer::from_gguf(&model().file.metadata).unwrap();
    // Completions, plain and streamed.
    let prompt = "The three primary colors are";
    let want = reference(&tok.encode(prompt, true).unwrap(), 20);
    let (status, body) = s.json("/v1/completions", json!({"model": "smollm2", "prompt": prompt, "max_tokens": 20, "temperature": 0})).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "text_completion");
    assert_eq!(body["choices"][0]["text"], want.as_str());
    assert_eq!(body["usage"]["completion_tokens"], 20);
    assert_eq!(body["usage"]["total_tokens"].as_u64(), Some(body["usage"]["prompt_tokens"].as_u64().unwrap() + 20));
    let events = s.stream("/v1/completions", json!({"prompt": prompt, "max_tokens": 20, "temperature": 0, "stream": true})).await;
    let text: String = chunks(&events).iter().map(|c| c["choices"][0]["text"].as_str().unwrap().to_string()).collect();
    assert_eq!(text, want);
    // Chat through the model's template, plain and streamed.
    let messages = json!([{"role": "system", "content": "You are a concise assistant."}, {"role": "user", "content": "Name a large mammal."}]);
    let template = tok.chat_template().unwrap().unwrap();
    let rendered = template
        .apply(&[ferrite_tokenizer::Message::new("system", "You are a concise assistant."), ferrite_tokenizer::Message::new("user", "Name a large mammal.")], true)
        .unwrap();
    let want = reference(&tok.encode(&rendered, true).unwrap(), 24);
    let (status, body) = s.json("/v1/chat/completions", json!({"messages": messages, "max_tokens": 24, "temperature": 0})).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["choices"][0]["message"]["role"], "assistant");
    assert_eq!(body["choices"][0]["message"]["content"], want.as_str());
    let events = s.stream("/v1/chat/completions", json!({"messages": messages, "max_tokens": 24, "temperature": 0, "stream": true, "stream_options": {"include_usage": true}})).await;
    let cs = chunks(&events);
    assert_eq!(cs[0]["choices"][0]["delta"], json!({"role": "assistant", "content": ""}));
    assert!(cs.iter().all(|c| c["object"] == "chat.completion.chunk" && c["id"] == cs[0]["id"]));
    let text: String = cs.iter().filter_map(|c| c["choices"].get(0)?["delta"]["content"].as_str().map(str::to_string)).collect();
    assert_eq!(text, want);
    let fin = &cs[cs.len() - 2];
    assert!(fin["choices"][0]["finish_reason"] == "length" || fin["choices"][0]["finish_reason"] == "stop");
    let usage = &cs[cs.len() - 1];
    assert_eq!(usage["choices"], json!([]));
    // The system prompt's first block(s) came from the prefix cache on the repeat.
    assert!(usage["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap() >= 16, "{usage}");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_load_completes_and_leaks_nothing() {
    let s = Arc::new(start().await);
    const STREAMS: usize = 8;
    const REQUESTS: usize = 24;
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut workers = Vec::new();
    for _ in 0..STREAMS {
        let (s, next) = (Arc::clone(&s), Arc::clone(&next));
        workers.push(tokio::spawn(async move {
            let mut totals = (0u64, 0u64);
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= REQUESTS {
                    return totals;
                }
                let max_tokens = 4 + (i * 5) % 17;
                let prompt = format!("Request {i}: write a short sentence about the number {}.", i * 37);
                let usage = if i % 2 == 0 {
                    let events = s.stream("/v1/completions", json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.7, "seed": i, "stream": true, "stream_options": {"include_usage": true}})).await;
                    let cs = chunks(&events);
                    let fin = &cs[cs.len() - 2]["choices"][0]["finish_reason"];
                    assert!(fin == "length" || fin == "stop", "request {i}: {fin}");
                    cs[cs.len() - 1]["usage"].clone()
                } else {
                    let (status, body) = s.json("/v1/chat/completions", json!({"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0.7, "seed": i})).await;
                    assert_eq!(status, 200, "request {i}: {body}");
                    body["usage"].clone()
                };
                let (p, c) = (usage["prompt_tokens"].as_u64().unwrap(), usage["completion_tokens"].as_u64().unwrap());
                assert!(c <= max_tokens as u64, "request {i}: {c} tokens for max_tokens {max_tokens}");
                assert_eq!(usage["total_tokens"].as_u64().unwrap(), p + c);
                totals.0 += p;
                totals.1 += c;
            }
        }));
    }
    let (mut prompt, mut completion) = (0, 0);
    for w in workers {
        let (p, c) = w.await.unwrap();
        prompt += p;
        completion += c;
    }
    s.wait_idle().await;
    assert_eq!(s.metric("ferrite_requests_finished_total").await as u64, REQUESTS as u64);
    assert_eq!(s.metric("ferrite_generation_tokens_total").await as u64, completion, "generated tokens do not add up");
    assert_eq!(s.metric("ferrite_prompt_tokens_total").await as u64, prompt, "prompt tokens do not add up");
    assert_eq!(s.metric("ferrite_kv_blocks_in_use").await, 0.0);
    let m = s.metrics().await;
    assert!(m.contains(&format!("ferrite_time_to_first_token_seconds_count {REQUESTS}")), "{m}");
    Arc::try_unwrap(s).ok().unwrap().stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_mid_stream_frees_the_sequence() {
    let s = start().await;
    // End-of-generation tokens are banned so that only the disconnect can end these requests.
    let tok = Tokenizer::from_gguf(&model().file.metadata).unwrap();
    let no_end: serde_json::Map<String, Value> = (0..tok.vocab_size() as u32).filter(|&t| tok.is_end_of_generation(t)).map(|t| (t.to_string(), json!(-100))).collect();
    let r = s.post("/v1/completions").json(&json!({"prompt": "Tell me a long story.", "max_tokens": 400, "temperature": 0, "stream": true, "logit_bias": no_end})).send().await.unwrap();
    let mut body = r.bytes_stream();
    let mut seen = 0;
    while seen < 3 {
        let chunk = body.next().await.unwrap().unwrap();
        seen += String::from_utf8_lossy(&chunk).matches("data: ").count();
    }
    assert!(s.metric("ferrite_running_sequences").await >= 1.0);
    drop(body);
    s.wait_idle().await;
    assert_eq!(s.metric("ferrite_requests_cancelled_total").await, 1.0);
    assert!(s.metric("ferrite_generation_tokens_total").await < 400.0, "generation went on after the disconnect");
    // Non-streaming request abandoned by a client timeout (`ignore_eos` keeps it going).
    let r = s.post("/v1/completions").timeout(Duration::from_millis(300)).json(&json!({"prompt": "Count to a thousand.", "max_tokens": 450, "temperature": 0, "ignore_eos": true})).send().await;
    assert!(r.is_err(), "expected the client timeout");
    s.wait_idle().await;
    assert_eq!(s.metric("ferrite_requests_cancelled_total").await, 2.0);
    s.stop().await;
}

fn assert_error(status: u16, body: &Value, want_status: u16, needle: &str) {
    assert_eq!(status, want_status, "{body}");
    let msg = body["error"]["message"].as_str().unwrap_or_else(|| panic!("not an OpenAI error body: {body}"));
    assert!(body["error"]["type"].is_string(), "{body}");
    assert!(msg.contains(needle), "expected `{needle}` in `{msg}`");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_openai_errors() {
    let s = start().await;
    let raw = |path: &'static str, body: &'static str| {
        let r = s.post(path).header("content-type", "application/json").body(body);
        async move {
            let r = r.send().await.unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap())
        }
    };
    let (st, b) = raw("/v1/chat/completions", "{\"messages\": [").await;
    assert_error(st, &b, 400, "malformed JSON");
    let (st, b) = raw("/v1/completions", "[1, 2]").await;
    assert_error(st, &b, 400, "invalid request");
    let (st, b) = raw("/v1/completions", "").await;
    assert_error(st, &b, 400, "malformed JSON");
    let cases: Vec<(&str, Value, u16, &str)> = vec![
        ("/v1/completions", json!({"prompt": "x", "bogus": 1}), 400, "unknown field `bogus`"),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "x", "extra": true}]}), 400, "unknown field `extra`"),
        ("/v1/completions", json!({"prompt": "x", "temperature": 3.5}), 400, "temperature"),
        ("/v1/completions", json!({"prompt": "x", "temperature": "hot"}), 400, "invalid type"),
        ("/v1/completions", json!({"prompt": "x", "top_p": 0}), 400, "top_p"),
        ("/v1/completions", json!({"prompt": "x", "top_k": -5}), 400, "top_k"),
        ("/v1/completions", json!({"prompt": "x", "max_tokens": 0}), 400, "max_tokens"),
        ("/v1/completions", json!({"prompt": "x", "max_tokens": -1}), 400, "invalid value"),
        ("/v1/completions", json!({"prompt": "x", "n": 2}), 400, "n: 1"),
        ("/v1/completions", json!({"prompt": "x", "presence_penalty": 9}), 400, "presence_penalty"),
        ("/v1/completions", json!({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}), 400, "stop"),
        ("/v1/completions", json!({"prompt": "x", "logit_bias": {"abc": 1}}), 400, "logit_bias"),
        ("/v1/completions", json!({"prompt": [999999999u32]}), 400, "outside the vocabulary"),
        ("/v1/completions", json!({"prompt": ""}), 400, "empty"),
        ("/v1/completions", json!({"prompt": "x", "model": "gpt-4"}), 404, "does not exist"),
        ("/v1/completions", json!({"prompt": "x", "echo": true}), 400, "echo"),
        ("/v1/chat/completions", json!({"messages": []}), 400, "messages"),
        ("/v1/chat/completions", json!({"messages": [{"role": "wizard", "content": "x"}]}), 400, "role"),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}), 400, "logprobs"),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "x"}], "tools": []}), 400, "unknown field `tools`"),
        ("/v1/completions", json!({"prompt": "word ".repeat(600)}), 400, "context"),
    ];
    for (path, body, want, needle) in cases {
        let (st, b) = s.json(path, body.clone()).await;
        assert_error(st, &b, want, needle);
    }
    // Over the 2 MB body limit: 413 with an OpenAI error body. On a connection of its own: the
    // server answers before reading the whole body and closes that connection, which a pooled
    // client could otherwise pick up again for the next request (a flaky "incomplete message").
    let huge = json!({"prompt": "x".repeat(3 << 20)});
    let once = reqwest::Client::builder().pool_max_idle_per_host(0).build().unwrap();
    let r = once.post(format!("{}/v1/completions", s.base)).json(&huge).send().await.unwrap();
    let st = r.status().as_u16();
    assert_error(st, &r.json().await.unwrap(), 413, "body");
    let r = s.client.get(format!("{}/v1/nothing", s.base)).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 404);
    assert!(r.json::<Value>().await.unwrap()["error"]["message"].is_string());
    let r = s.client.get(format!("{}/v1/completions", s.base)).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 405);
    // After all that the server still works and holds nothing.
    let (st, b) = s.json("/v1/completions", json!({"prompt": "Hello", "max_tokens": 2})).await;
    assert_eq!(st, 200, "{b}");
    s.wait_idle().await;
    assert_eq!(s.metric("ferrite_requests_failed_total").await, 0.0);
    s.stop().await;

    // A full queue answers 429.
    let s = start_with(EngineConfig { max_queue: 0, ..engine_config() }, None).await;
    let (st, b) = s.json("/v1/completions", json!({"prompt": "Hello"})).await;
    assert_error(st, &b, 429, "queue is full");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_key_is_enforced_on_v1() {
    let s = start_with(engine_config(), Some("sekret")).await;
    let url = format!("{}/v1/models", s.base);
    let r = s.client.get(&url).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 401);
    assert_eq!(r.json::<Value>().await.unwrap()["error"]["code"], "invalid_api_key");
    assert_eq!(s.client.get(&url).bearer_auth("wrong").send().await.unwrap().status().as_u16(), 401);
    let r = s.client.post(format!("{}/v1/completions", s.base)).json(&json!({"prompt": "x"})).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 401);
    let models: Value = s.client.get(&url).bearer_auth("sekret").send().await.unwrap().json().await.unwrap();
    assert_eq!(models["data"][0]["id"], "smollm2");
    assert_eq!(s.client.get(format!("{}/health", s.base)).send().await.unwrap().status().as_u16(), 200);
    let (st, _) = s.json("/v1/completions", json!({"prompt": "x", "max_tokens": 1})).await;
    assert_eq!(st, 200);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_strings_seeds_logprobs_and_penalties() {
    let s = start().await;
    let base = json!({"prompt": "List the days of the week: Monday, Tuesday,", "max_tokens": 24, "temperature": 0});
    let (_, full) = s.json("/v1/completions", base.clone()).await;
    let full = full["choices"][0]["text"].as_str().unwrap().to_string();
    // Stop at the second comma of the greedy text and the two characters after it.
    let second = full.match_indices(',').nth(1).map(|(i, _)| i).expect("greedy text has two commas");
    let stop: String = full[second..].chars().take(3).collect();
    let cut = full.find(&stop).unwrap();
    let mut req = base.clone();
    req["stop"] = json!(["zzz", stop]);
    let (_, b) = s.json("/v1/completions", req.clone()).await;
    assert_eq!(b["choices"][0]["text"].as_str().unwrap(), &full[..cut]);
    assert_eq!(b["choices"][0]["finish_reason"], "stop");
    req["stream"] = json!(true);
    let events = s.stream("/v1/completions", req).await;
    let cs = chunks(&events);
    let text: String = cs.iter().map(|c| c["choices"][0]["text"].as_str().unwrap().to_string()).collect();
    assert_eq!(text, &full[..cut]);
    assert_eq!(cs.last().unwrap()["choices"][0]["finish_reason"], "stop");
    // Seeded sampling is reproducible; another seed differs (over 24 tokens at temperature 1).
    let sampled = |seed: u64| {
        let mut r = base.clone();
        r["temperature"] = json!(1.0);
        r["seed"] = json!(seed);
        let s = &s;
        async move { s.json("/v1/completions", r).await.1["choices"][0]["text"].as_str().unwrap().to_string() }
    };
    let (a, b, c) = (sampled(7).await, sampled(7).await, sampled(8).await);
    assert_eq!(a, b);
    assert_ne!(a, c);
    // Logprobs: the chosen greedy token is the top alternative; probabilities are <= 1.
    let (_, b) = s.json("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0, "logprobs": true, "top_logprobs": 3})).await;
    let content = b["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 4);
    for e in content {
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        assert_eq!(top[0]["token"], e["token"]);
        assert!(e["logprob"].as_f64().unwrap() <= 0.0);
    }
    // A strong frequency penalty changes a repetitive greedy continuation.
    let rep = json!({"prompt": "a a a a a a a a", "max_tokens": 8, "temperature": 0});
    let (_, plain) = s.json("/v1/completions", rep.clone()).await;
    let mut pen = rep.clone();
    pen["frequency_penalty"] = json!(2.0);
    pen["presence_penalty"] = json!(2.0);
    let (_, penalised) = s.json("/v1/completions", pen).await;
    assert_ne!(plain["choices"][0]["text"], penalised["choices"][0]["text"]);
    // logit_bias can force a token.
    let tok = Tokenizer::from_gguf(&model().file.metadata).unwrap();
    let forced = tok.encode(" banana", false).unwrap()[0];
    let mut biased = rep.clone();
    biased["logit_bias"] = json!({ forced.to_string(): 100 });
    biased["max_tokens"] = json!(2);
    let (_, b) = s.json("/v1/completions", biased).await;
    assert_eq!(b["choices"][0]["text"].as_str().unwrap(), tok.decode(&[forced, forced]));
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_drains_streams_in_flight() {
    let s = start().await;
    let r = s.post("/v1/completions").json(&json!({"prompt": "Once upon a time", "max_tokens": 120, "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true}})).send().await.unwrap();
    let reader = tokio::spawn(async move { r.text().await.unwrap() });
    tokio::time::sleep(Duration::from_millis(100)).await;
    s.stop().await;
    let text = reader.await.unwrap();
    assert!(text.trim_end().ends_with("data: [DONE]"), "stream cut short: {text}");
    assert!(text.contains("\"completion_tokens\":120"), "{text}");
}
