//! `ferrite serve`: an OpenAI-compatible HTTP server over the continuous-batching engine.
//!
//! Routes: `POST /v1/chat/completions`, `POST /v1/completions` (both with `stream: true` as
//! server-sent events ending in `data: [DONE]`), `GET /v1/models`, `GET /health`, `GET /metrics`
//! (Prometheus text). With an API key every `/v1/*` route wants `Authorization: Bearer KEY`.
//!
//! Each request becomes a [`GenRequest`] for the engine; a task turns the engine's token events
//! into text (UTF-8-safe streaming detokenization, stop strings) and into OpenAI bodies. A client
//! that goes away drops that task's receiver, which cancels the sequence in the engine.

pub mod metrics;
pub mod openai;
pub mod stop;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use ferrite_engine::{EngineHandle, FinishReason, GenEvent, GenRequest, SamplerParams, SubmitError, TokenLogprob};
use ferrite_tokenizer::{ChatTemplate, Message, StreamDecoder, Tokenizer};
use openai::*;
use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};
use stop::StopMatcher;
use tokio::sync::mpsc;
use futures_util::stream::{self, Stream, StreamExt};
use tokio_stream::wrappers::ReceiverStream;

/// Everything the handlers share.
pub struct ServerState {
    pub engine: EngineHandle,
    pub tokenizer: Arc<Tokenizer>,
    pub template: Option<ChatTemplate>,
    /// The model id clients see in `/v1/models` and in responses.
    pub model_id: String,
    pub api_key: Option<String>,
    /// Token ids that end generation.
    pub stop_tokens: Vec<u32>,
    /// Token ids accepted in prompts: below both the tokenizer's and the model's vocabulary.
    pub vocab_limit: usize,
    pub created: u64,
    pub http: metrics::HttpMetrics,
}

impl ServerState {
    pub fn new(engine: EngineHandle, tokenizer: Tokenizer, template: Option<ChatTemplate>, model_id: String, api_key: Option<String>) -> Self {
        let stop_tokens = (0..tokenizer.vocab_size() as u32).filter(|&t| tokenizer.is_end_of_generation(t)).collect();
        let vocab_limit = tokenizer.vocab_size();
        Self {
            engine,
            tokenizer: Arc::new(tokenizer),
            template,
            model_id,
            api_key,
            vocab_limit,
            stop_tokens,
            created: now(),
            http: metrics::HttpMetrics::default(),
        }
    }
}

type AppState = Arc<ServerState>;

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

fn new_id(prefix: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
    format!("{prefix}-{nanos:x}{:04x}", NEXT.fetch_add(1, Relaxed) & 0xffff)
}

/// An error answered as an OpenAI error body.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub code: Option<&'static str>,
    pub param: Option<String>,
    pub message: String,
}

impl ApiError {
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self { status: StatusCode::BAD_REQUEST, kind: "invalid_request_error", code: None, param: None, message: message.into() }
    }

    fn param(mut self, p: &str) -> Self {
        self.param = Some(p.to_string());
        self
    }

    fn with_code(mut self, c: &'static str) -> Self {
        self.code = Some(c);
        self
    }

    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self { status, kind, code: None, param: None, message: message.into() }
    }

    fn body(&self) -> ErrorBody {
        ErrorBody { error: ErrorDetail { message: self.message.clone(), kind: self.kind, param: self.param.clone(), code: self.code } }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
    }
}

/// The application's routes over `state`.
pub fn router(state: AppState) -> Router {
    let v1 = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route_layer(middleware::from_fn_with_state(Arc::clone(&state), auth));
    Router::new()
        .merge(v1)
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "invalid_request_error", "unknown route").with_code("not_found") })
        .method_not_allowed_fallback(|| async { ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "invalid_request_error", "method not allowed for this route") })
        .layer(middleware::from_fn_with_state(Arc::clone(&state), count_responses))
        .with_state(state)
}

/// Serve on `listener` until `shutdown` resolves, then stop accepting and wait for the requests
/// in flight (streams included) to finish.
pub async fn serve(listener: tokio::net::TcpListener, state: AppState, shutdown: impl Future<Output = ()> + Send + 'static) -> std::io::Result<()> {
    axum::serve(listener, router(state)).with_graceful_shutdown(shutdown).await
}

async fn count_responses(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let path = req.uri().path().to_string();
    let response = next.run(req).await;
    state.http.count(&path, response.status().as_u16());
    response
}

async fn auth(State(state): State<AppState>, headers: HeaderMap, req: Request, next: Next) -> Response {
    if let Some(key) = &state.api_key {
        let given = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
        // Compare without stopping at the first differing byte.
        let ok = given.is_some_and(|g| g.len() == key.len() && g.bytes().zip(key.bytes()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0);
        if !ok {
            let msg = if given.is_none() { "missing API key: send `Authorization: Bearer KEY`" } else { "incorrect API key" };
            return ApiError::new(StatusCode::UNAUTHORIZED, "invalid_request_error", msg).with_code("invalid_api_key").into_response();
        }
    }
    next.run(req).await
}

async fn health(State(state): State<AppState>) -> Response {
    if state.engine.is_alive() {
        Json(serde_json::json!({ "status": "ok" })).into_response()
    } else {
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", "the engine thread has stopped").into_response()
    }
}

async fn models(State(state): State<AppState>) -> impl IntoResponse {
    Json(ModelList {
        object: "list",
        data: vec![ModelCard { id: state.model_id.clone(), object: "model", created: state.created, owned_by: "ferrite" }],
    })
}

async fn metrics_text(State(state): State<AppState>) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], metrics::render(state.engine.metrics(), &state.http))
}

fn parse_body<T: serde::de::DeserializeOwned>(body: Result<Bytes, BytesRejection>) -> Result<T, ApiError> {
    let body = body.map_err(|e| ApiError::new(e.status(), "invalid_request_error", format!("could not read the request body: {e}")))?;
    serde_json::from_slice(&body).map_err(|e| {
        let what = if e.is_syntax() || e.is_eof() { "malformed JSON" } else { "invalid request" };
        ApiError::bad_request(format!("{what}: {e}"))
    })
}

/// Validated generation settings of one request.
struct Plan {
    req: GenRequest,
    stops: Vec<String>,
}

fn check_model(state: &ServerState, model: &Option<String>) -> Result<(), ApiError> {
    match model {
        Some(m) if m != &state.model_id => Err(ApiError::new(StatusCode::NOT_FOUND, "invalid_request_error", format!("the model `{m}` does not exist; this server serves `{}`", state.model_id))
            .param("model")
            .with_code("model_not_found")),
        _ => Ok(()),
    }
}

fn in_range(name: &str, v: Option<f32>, lo: f32, hi: f32) -> Result<Option<f32>, ApiError> {
    match v {
        Some(x) if !(x.is_finite() && x >= lo && x <= hi) => Err(ApiError::bad_request(format!("`{name}` must be between {lo} and {hi}, got {x}")).param(name)),
        other => Ok(other),
    }
}

#[allow(clippy::too_many_arguments)]
fn plan(state: &ServerState, prompt: Vec<u32>, p: CommonParams, max_tokens: Option<u32>, default_max: Option<usize>, logprobs: Option<usize>, ignore_eos: bool) -> Result<Plan, ApiError> {
    if p.n.is_some_and(|n| n != 1) {
        return Err(ApiError::bad_request("only `n: 1` is supported").param("n"));
    }
    let temperature = in_range("temperature", p.temperature, 0.0, 2.0)?.unwrap_or(1.0);
    let top_p = p.top_p.unwrap_or(1.0);
    if !(top_p.is_finite() && top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::bad_request(format!("`top_p` must be in (0, 1], got {top_p}")).param("top_p"));
    }
    let top_k = match p.top_k {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => k as usize,
        Some(k) => return Err(ApiError::bad_request(format!("`top_k` must be -1, 0 (off) or positive, got {k}")).param("top_k")),
    };
    let min_p = in_range("min_p", p.min_p, 0.0, 1.0)?.unwrap_or(0.0);
    let presence = in_range("presence_penalty", p.presence_penalty, -2.0, 2.0)?.unwrap_or(0.0);
    let frequency = in_range("frequency_penalty", p.frequency_penalty, -2.0, 2.0)?.unwrap_or(0.0);
    let repeat = in_range("repetition_penalty", p.repetition_penalty, 0.01, 100.0)?.unwrap_or(1.0);
    let seed = p.seed.map(|s| s as u64).unwrap_or_else(|| SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0));
    let stops = p.stop.map(OneOrMany::into_vec).unwrap_or_default();
    if stops.len() > 4 || stops.iter().any(String::is_empty) {
        return Err(ApiError::bad_request("`stop` takes up to 4 non-empty strings").param("stop"));
    }
    let vocab = state.tokenizer.vocab_size();
    let mut logit_bias = Vec::new();
    for (k, v) in p.logit_bias.unwrap_or_default() {
        let id: u32 = k.parse().ok().filter(|&id: &u32| (id as usize) < vocab).ok_or_else(|| ApiError::bad_request(format!("`logit_bias` key `{k}` is not a token id below {vocab}")).param("logit_bias"))?;
        in_range("logit_bias", Some(v), -100.0, 100.0)?;
        logit_bias.push((id, v));
    }
    let config = state.engine.config();
    if prompt.is_empty() {
        return Err(ApiError::bad_request("the prompt is empty").param("prompt"));
    }
    if prompt.len() >= config.max_context {
        return Err(ApiError::bad_request(format!(
            "this model's context holds {} tokens; the prompt has {} (plus at least 1 to generate)",
            config.max_context,
            prompt.len()
        ))
        .with_code("context_length_exceeded"));
    }
    if max_tokens == Some(0) {
        return Err(ApiError::bad_request("`max_tokens` must be at least 1").param("max_tokens"));
    }
    let room = config.max_context - prompt.len();
    let max_tokens = max_tokens.map(|m| m as usize).or(default_max).unwrap_or(room).min(room);
    let sampling = SamplerParams { temperature, top_k, top_p, min_p, repeat_penalty: repeat, repeat_last_n: SamplerParams::DEFAULT.repeat_last_n, seed };
    sampling.validate().map_err(ApiError::bad_request)?;
    let req = GenRequest {
        prompt,
        max_tokens,
        sampling,
        presence_penalty: presence,
        frequency_penalty: frequency,
        logit_bias,
        logprobs,
        stop_tokens: if ignore_eos { Vec::new() } else { state.stop_tokens.clone() },
    };
    Ok(Plan { req, stops })
}

/// What the generation task hands to a response writer.
enum Out {
    /// New text, and the tokens that produced it (with log-probabilities when asked for).
    Text { text: String, tokens: Vec<(u32, Option<TokenLogprob>)> },
    Done { finish_reason: &'static str, usage: UsageBody },
    Error(ApiError),
}

fn submit(state: &ServerState, req: GenRequest) -> Result<mpsc::UnboundedReceiver<GenEvent>, ApiError> {
    state.engine.submit(req).map_err(|e| match e {
        SubmitError::QueueFull => ApiError::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", e.to_string()).with_code("queue_full"),
        SubmitError::BadPrompt(m) => ApiError::bad_request(m).with_code("context_length_exceeded"),
        SubmitError::Stopped => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", e.to_string()),
    })
}

/// Turn the engine's events into text pieces on `out`. Ends when generation ends or `out` is
/// closed (the client went away): dropping `events` then cancels the sequence.
async fn drive(state: AppState, mut events: mpsc::UnboundedReceiver<GenEvent>, prompt_tokens: usize, stops: Vec<String>, out: mpsc::Sender<Out>) {
    let tokenizer = Arc::clone(&state.tokenizer);
    let mut dec = StreamDecoder::new(&tokenizer);
    let mut stop = StopMatcher::new(stops);
    let (mut completion, mut cached) = (0usize, 0usize);
    let mut pending: Vec<(u32, Option<TokenLogprob>)> = Vec::new();
    loop {
        let event = tokio::select! {
            e = events.recv() => e,
            _ = out.closed() => return,
        };
        let Some(event) = event else {
            let _ = out.send(Out::Error(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "the engine stopped"))).await;
            return;
        };
        match event {
            GenEvent::Started { cached_tokens } => cached = cached_tokens,
            GenEvent::Token { id, logprob } => {
                completion += 1;
                pending.push((id, logprob));
                let (text, stopped) = stop.push(&dec.push(id));
                if stopped {
                    let tokens = std::mem::take(&mut pending);
                    if (!text.is_empty() || !tokens.is_empty()) && out.send(Out::Text { text, tokens }).await.is_err() {
                        return;
                    }
                    let usage = UsageBody::new(prompt_tokens, completion, cached);
                    let _ = out.send(Out::Done { finish_reason: "stop", usage }).await;
                    return; // dropping `events` ends the sequence
                }
                if !text.is_empty() {
                    let tokens = std::mem::take(&mut pending);
                    if out.send(Out::Text { text, tokens }).await.is_err() {
                        return;
                    }
                }
            }
            GenEvent::Finished { reason, usage } => {
                let (tail, _) = stop.push(&std::mem::replace(&mut dec, StreamDecoder::new(&tokenizer)).finish());
                let text = tail + &stop.finish();
                let tokens = std::mem::take(&mut pending);
                if (!text.is_empty() || !tokens.is_empty()) && out.send(Out::Text { text, tokens }).await.is_err() {
                    return;
                }
                let finish_reason = match reason {
                    FinishReason::Stop => "stop",
                    FinishReason::Length => "length",
                };
                let usage = UsageBody::new(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens);
                let _ = out.send(Out::Done { finish_reason, usage }).await;
                return;
            }
            GenEvent::Error(m) => {
                let _ = out.send(Out::Error(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", m))).await;
                return;
            }
        }
    }
}

fn start(state: &AppState, plan: Plan) -> Result<mpsc::Receiver<Out>, ApiError> {
    let prompt_tokens = plan.req.prompt.len();
    let events = submit(state, plan.req)?;
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(drive(Arc::clone(state), events, prompt_tokens, plan.stops, tx));
    Ok(rx)
}

fn token_text(tok: &Tokenizer, id: u32) -> (String, Vec<u8>) {
    let bytes = tok.token_bytes(id).to_vec();
    (String::from_utf8_lossy(&bytes).into_owned(), bytes)
}

fn chat_logprobs(tok: &Tokenizer, tokens: &[(u32, Option<TokenLogprob>)]) -> Option<ChatLogprobs> {
    let content: Vec<ChatLogprobEntry> = tokens
        .iter()
        .filter_map(|(id, lp)| {
            let lp = lp.as_ref()?;
            let (token, bytes) = token_text(tok, *id);
            let top_logprobs = lp
                .top
                .iter()
                .map(|&(t, l)| {
                    let (token, bytes) = token_text(tok, t);
                    TopLogprob { token, logprob: l, bytes }
                })
                .collect();
            Some(ChatLogprobEntry { token, logprob: lp.logprob, bytes, top_logprobs })
        })
        .collect();
    (!content.is_empty()).then_some(ChatLogprobs { content })
}

fn completion_logprobs(tok: &Tokenizer, tokens: &[(u32, Option<TokenLogprob>)], offset: &mut usize) -> Option<CompletionLogprobs> {
    let mut lp = CompletionLogprobs::default();
    for (id, l) in tokens {
        let Some(l) = l else { continue };
        let (text, _) = token_text(tok, *id);
        lp.text_offset.push(*offset);
        *offset += text.len();
        lp.tokens.push(text);
        lp.token_logprobs.push(l.logprob);
        lp.top_logprobs.push(l.top.iter().map(|&(t, v)| (token_text(tok, t).0, v)).collect());
    }
    (!lp.tokens.is_empty()).then_some(lp)
}

fn chat_prompt(state: &ServerState, messages: &[ChatMessage]) -> Result<Vec<u32>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::bad_request("`messages` must not be empty").param("messages"));
    }
    let mut msgs = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        if !matches!(m.role.as_str(), "system" | "developer" | "user" | "assistant") {
            return Err(ApiError::bad_request(format!("messages[{i}]: unsupported role `{}`", m.role)).param("messages"));
        }
        let content = match &m.content {
            None => String::new(),
            Some(Content::Text(t)) => t.clone(),
            Some(Content::Parts(parts)) => {
                let mut s = String::new();
                for p in parts {
                    match (p.kind.as_str(), &p.text) {
                        ("text", Some(t)) => s.push_str(t),
                        _ => return Err(ApiError::bad_request(format!("messages[{i}]: only text content parts are supported")).param("messages")),
                    }
                }
                s
            }
        };
        let role = if m.role == "developer" { "system" } else { m.role.as_str() };
        msgs.push(Message::new(role, content));
    }
    let text = match &state.template {
        Some(t) => t.apply(&msgs, true).map_err(|e| ApiError::bad_request(format!("the chat template rejected the messages: {e}")))?,
        None => msgs.iter().map(|m| format!("{}: {}\n", m.role, m.content)).collect::<String>() + "assistant:",
    };
    state.tokenizer.encode(&text, true).map_err(|e| ApiError::bad_request(format!("cannot tokenize the prompt: {e}")))
}

async fn chat_completions(State(state): State<AppState>, body: Result<Bytes, BytesRejection>) -> Response {
    match chat_inner(state, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn chat_inner(state: AppState, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let req: ChatCompletionRequest = parse_body(body)?;
    check_model(&state, &req.model)?;
    let logprobs = match (req.logprobs.unwrap_or(false), req.top_logprobs) {
        (_, Some(n)) if n > 20 => return Err(ApiError::bad_request("`top_logprobs` must be between 0 and 20").param("top_logprobs")),
        (false, Some(_)) => return Err(ApiError::bad_request("`top_logprobs` needs `logprobs: true`").param("top_logprobs")),
        (true, n) => Some(n.unwrap_or(0) as usize),
        (false, None) => None,
    };
    let prompt = chat_prompt(&state, &req.messages)?;
    let max_tokens = req.max_completion_tokens.or(req.max_tokens);
    let plan = plan(&state, prompt, req.common(), max_tokens, None, logprobs, req.ignore_eos)?;
    let mut rx = start(&state, plan)?;
    let (id, created, model) = (new_id("chatcmpl"), now(), state.model_id.clone());
    if req.stream {
        let include_usage = req.stream_options.as_ref().is_some_and(|o| o.include_usage);
        let chunk = move |choices: Vec<ChatChunkChoice>, usage: Option<Option<UsageBody>>| ChatCompletionChunk {
            id: id.clone(),
            object: "chat.completion.chunk",
            created,
            model: model.clone(),
            choices,
            usage: if include_usage { Some(usage.flatten()) } else { None },
        };
        let tok = Arc::clone(&state.tokenizer);
        let first = chunk(vec![ChatChunkChoice { index: 0, delta: Delta { role: Some("assistant"), content: Some(String::new()) }, logprobs: None, finish_reason: None }], None);
        let events = ReceiverStream::new(rx).flat_map(move |o| {
            let items: Vec<String> = match o {
                Out::Text { text, tokens } => vec![json(&chunk(
                    vec![ChatChunkChoice { index: 0, delta: Delta { role: None, content: Some(text) }, logprobs: chat_logprobs(&tok, &tokens), finish_reason: None }],
                    None,
                ))],
                Out::Done { finish_reason, usage } => {
                    let mut v = vec![json(&chunk(vec![ChatChunkChoice { index: 0, delta: Delta::default(), logprobs: None, finish_reason: Some(finish_reason) }], None))];
                    if include_usage {
                        v.push(json(&chunk(vec![], Some(Some(usage)))));
                    }
                    v.push("[DONE]".to_string());
                    v
                }
                Out::Error(e) => vec![json(&e.body()), "[DONE]".to_string()],
            };
            stream::iter(items)
        });
        return Ok(sse(json(&first), events));
    }
    let mut text = String::new();
    let mut all_tokens = Vec::new();
    loop {
        match rx.recv().await {
            Some(Out::Text { text: t, tokens }) => {
                text.push_str(&t);
                all_tokens.extend(tokens);
            }
            Some(Out::Done { finish_reason, usage }) => {
                let logprobs = if logprobs.is_some() { Some(chat_logprobs(&state.tokenizer, &all_tokens).unwrap_or(ChatLogprobs { content: vec![] })) } else { None };
                let body = ChatCompletion {
                    id,
                    object: "chat.completion",
                    created,
                    model,
                    choices: vec![ChatChoice { index: 0, message: AssistantMessage { role: "assistant", content: text }, logprobs, finish_reason }],
                    usage,
                };
                return Ok(Json(body).into_response());
            }
            Some(Out::Error(e)) => return Err(e),
            None => return Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "generation ended unexpectedly")),
        }
    }
}

fn json<T: serde::Serialize>(v: &T) -> String {
    serde_json::to_string(v).unwrap_or_else(|e| format!("{{\"error\":{{\"message\":\"serialization failed: {e}\"}}}}"))
}

fn sse(first: String, rest: impl Stream<Item = String> + Send + 'static) -> Response {
    let stream = stream::once(async { first }).chain(rest).map(|data| Ok::<_, Infallible>(Event::default().data(data)));
    Sse::new(stream).keep_alive(KeepAlive::default()).into_response()
}

async fn completions(State(state): State<AppState>, body: Result<Bytes, BytesRejection>) -> Response {
    match completions_inner(state, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn completions_inner(state: AppState, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let req: CompletionRequest = parse_body(body)?;
    check_model(&state, &req.model)?;
    if req.echo {
        return Err(ApiError::bad_request("`echo` is not supported").param("echo"));
    }
    if req.best_of.is_some_and(|b| b != 1) {
        return Err(ApiError::bad_request("only `best_of: 1` is supported").param("best_of"));
    }
    if req.logprobs.is_some_and(|n| n > 20) {
        return Err(ApiError::bad_request("`logprobs` must be between 0 and 20").param("logprobs"));
    }
    let vocab = state.tokenizer.vocab_size();
    let encode = |text: &str| {
        state.tokenizer.encode(text, true).map_err(|e| ApiError::bad_request(format!("cannot tokenize the prompt: {e}")))
    };
    let prompt = match &req.prompt {
        Prompt::Text(t) => encode(t)?,
        Prompt::Texts(v) if v.len() == 1 => encode(&v[0])?,
        Prompt::Texts(_) => return Err(ApiError::bad_request("only one prompt per request is supported").param("prompt")),
        Prompt::Tokens(ids) => {
            let vocab = vocab.min(state.vocab_limit);
            if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab) {
                return Err(ApiError::bad_request(format!("token id {bad} is outside the vocabulary ({vocab})")).param("prompt"));
            }
            ids.clone()
        }
    };
    // OpenAI's default for completions is 16 tokens.
    let logprobs = req.logprobs.map(|n| n as usize);
    let plan = plan(&state, prompt, req.common(), req.max_tokens, Some(16), logprobs, req.ignore_eos)?;
    let mut rx = start(&state, plan)?;
    let (id, created, model) = (new_id("cmpl"), now(), state.model_id.clone());
    if req.stream {
        let include_usage = req.stream_options.as_ref().is_some_and(|o| o.include_usage);
        let chunk = move |choices: Vec<CompletionChoice>, usage: Option<Option<UsageBody>>| Completion {
            id: id.clone(),
            object: "text_completion",
            created,
            model: model.clone(),
            choices,
            usage: if include_usage { Some(usage.flatten()) } else { None },
        };
        let tok = Arc::clone(&state.tokenizer);
        let mut offset = 0usize;
        let events = ReceiverStream::new(rx).flat_map(move |o| {
            let items: Vec<String> = match o {
                Out::Text { text, tokens } => {
                    let logprobs = completion_logprobs(&tok, &tokens, &mut offset);
                    vec![json(&chunk(vec![CompletionChoice { text, index: 0, logprobs, finish_reason: None }], None))]
                }
                Out::Done { finish_reason, usage } => {
                    let mut v = vec![json(&chunk(vec![CompletionChoice { text: String::new(), index: 0, logprobs: None, finish_reason: Some(finish_reason) }], None))];
                    if include_usage {
                        v.push(json(&chunk(vec![], Some(Some(usage)))));
                    }
                    v.push("[DONE]".to_string());
                    v
                }
                Out::Error(e) => vec![json(&e.body()), "[DONE]".to_string()],
            };
            stream::iter(items)
        });
        let stream = events.map(|data| Ok::<_, Infallible>(Event::default().data(data)));
        return Ok(Sse::new(stream).keep_alive(KeepAlive::default()).into_response());
    }
    let mut text = String::new();
    let mut all_tokens = Vec::new();
    loop {
        match rx.recv().await {
            Some(Out::Text { text: t, tokens }) => {
                text.push_str(&t);
                all_tokens.extend(tokens);
            }
            Some(Out::Done { finish_reason, usage }) => {
                let logprobs = if logprobs.is_some() { Some(completion_logprobs(&state.tokenizer, &all_tokens, &mut 0).unwrap_or_default()) } else { None };
                let body = Completion {
                    id,
                    object: "text_completion",
                    created,
                    model,
                    choices: vec![CompletionChoice { text, index: 0, logprobs, finish_reason: Some(finish_reason) }],
                    usage: Some(Some(usage)),
                };
                return Ok(Json(body).into_response());
            }
            Some(Out::Error(e)) => return Err(e),
            None => return Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "generation ended unexpectedly")),
        }
    }
}

/// How to start a server over a model.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    pub backend: ferrite_engine::BackendKind,
    pub executor: ferrite_model::ExecutorOptions,
    pub engine: ferrite_engine::EngineConfig,
    pub api_key: Option<String>,
    pub model_id: String,
}

/// Start the engine thread for `model` (the executor is created on it) and build the server
/// state: tokenizer, chat template, stop tokens.
pub fn start_engine(model: Arc<ferrite_model::Model>, opts: &ServeOptions) -> anyhow::Result<(ServerState, std::thread::JoinHandle<()>)> {
    use anyhow::Context as _;
    let tokenizer = Tokenizer::from_gguf(&model.file.metadata).context("ferrite serve needs the model's tokenizer")?;
    let template = tokenizer.chat_template().context("the model's chat template does not compile")?;
    let (backend, exec_opts) = (opts.backend, opts.executor.clone());
    let model_vocab = model.config.vocab_size;
    let make = move || ferrite_engine::open_executor(model, backend, exec_opts);
    let (engine, thread) = EngineHandle::start(make, opts.engine.clone())?;
    let mut state = ServerState::new(engine, tokenizer, template, opts.model_id.clone(), opts.api_key.clone());
    state.vocab_limit = state.vocab_limit.min(model_vocab);
    Ok((state, thread))
}
